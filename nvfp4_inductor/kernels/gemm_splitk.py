"""The split-K NVFP4 GEMM for small M (decode and serving batches): y = x @ W^T, W NVFP4 (N, K/2) +
e4m3 scales (row-major, or the tiled layout of nvfp4_inductor.reference.tiled), x (M, K) bf16.

At small M the GEMM is a weight stream: every weight byte is read once and used M times, so the
kernel must decode weights at HBM speed (device/mainloops.py: the decode and the mainloops). K is
cut into ranges so that every SM streams weights; each program writes fp32 partials, and the last
of an output tile's splits to finish (an atomic counter, device/epilogue.last_split) sums them and
runs the epilogue (global scales, bias, output dtype): one kernel a call. On sm_90 with tiled W
the same kernel serves batches of 33..128 rows with the wgmma mainloop, blocks of 64 rows each.
W4A4 runs it on x's quantized values (nvfp4.quantize_values: e2m1 * s_x, exact in bf16), both
global scales in the epilogue's g, or on sm_100 on x's codes (the block-scaled MMA).

The launch is plan.py's (SplitKLaunch): this module carries it out. Under the Triton interpreter
(CPU tensors) the decode is the byte form and the products run in fp32 (no inline PTX, no bf16
tl.dot), so CPU tests check the indexing and the numerics.
"""

import functools

import torch
import triton
import triton.language as tl

from nvfp4_inductor import capability
from nvfp4_inductor.format import BLOCK_SIZE
from nvfp4_inductor.kernels import launch as launches
from nvfp4_inductor.kernels import plan
from nvfp4_inductor.kernels.device.common import LAYOUT_GROUPED, LAYOUTS, check_swizzled_offsets
from nvfp4_inductor.kernels.device.epilogue import epilogue, last_split, split_tiles, sum_splits
from nvfp4_inductor.kernels.device.mainloops import MAINLOOP_WGMMA, MAINLOOPS, mainloop
from nvfp4_inductor.kernels.gemm_configs import MMA_GROUP

GROUP: tl.constexpr = tl.constexpr(MMA_GROUP)


@triton.jit
def _splitk_kernel(
    # pointers
    x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, w_global_scale_ptr, bias_ptr, out_ptr, partial_ptr, counter_ptr,
    # sizes
    M, N, K, w_scale_cols, tiles_per_split,
    # strides
    stride_xm, stride_om,
    # meta-parameters
    MAINLOOP: tl.constexpr, LAYOUT: tl.constexpr, W_GLOBAL_SCALE_PER_ROW: tl.constexpr, HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr, USE_ASM: tl.constexpr, OPERAND: tl.constexpr, EVEN: tl.constexpr,
    REG_MMA: tl.constexpr, UNSCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SUM_ROWS: tl.constexpr, SUM_SPLITS: tl.constexpr, PDL: tl.constexpr,
):
    pid_k = tl.program_id(1)
    if MAINLOOP == MAINLOOP_WGMMA:  # blocks of rows first: a weight tile's programs run together
        pid_n = tl.program_id(2)
        m0 = tl.program_id(0) * BLOCK_M
    else:  # all rows in one program
        pid_n = tl.program_id(0)
        m0 = 0
    if LAYOUT == LAYOUT_GROUPED:  # K-tiles counted by whole groups (device/mma.py)
        tiles = tl.cdiv(K, GROUP * BLOCK_K) * GROUP
    else:
        tiles = tl.cdiv(K, BLOCK_K)
    tile_begin, tile_end = split_tiles(pid_k, tiles_per_split, tiles)
    acc = mainloop(x_ptr + m0.to(tl.int64) * stride_xm, x_scale_ptr, w_ptr, w_scale_ptr, M - m0, N, K, stride_xm,
                   w_scale_cols, pid_n, tile_begin, tile_end, MAINLOOP, LAYOUT, USE_ASM, OPERAND, EVEN, REG_MMA,
                   PDL, BLOCK_M, BLOCK_N, BLOCK_K)
    ms = m0 + tl.arange(0, BLOCK_M)
    cols_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if SPLIT:
        # partials (num_splits, M, N) fp32; the last split of the tile to finish sums them
        mask = (cols_n < N)[:, None] & (ms < M)[None, :]
        tl.store(partial_ptr + (pid_k * M + ms)[None, :].to(tl.int64) * N + cols_n[:, None], acc,
                 mask=mask)
        num_splits = tl.num_programs(1)
        if last_split(counter_ptr + pid_n, num_splits):
            total = sum_splits(partial_ptr, num_splits, M, N, cols_n, BLOCK_N, SUM_ROWS, SUM_SPLITS)
            epilogue(total, tl.arange(0, SUM_ROWS), cols_n, M, N, w_global_scale_ptr, bias_ptr, out_ptr,
                     stride_om, W_GLOBAL_SCALE_PER_ROW, HAS_BIAS, UNSCALE)
    else:
        epilogue(acc, ms, cols_n, M, N, w_global_scale_ptr, bias_ptr, out_ptr, stride_om,
                 W_GLOBAL_SCALE_PER_ROW, HAS_BIAS, UNSCALE)



@functools.lru_cache(maxsize=4096)
def _meta(launch: plan.SplitKLaunch, use_asm: bool) -> dict:
    """The kernel's meta-parameters and launch options for a launch (but for the per-call two)."""
    return dict(
        MAINLOOP=MAINLOOPS[launch.mainloop], LAYOUT=LAYOUTS[launch.layout], SPLIT=launch.splits > 1,
        USE_ASM=use_asm, OPERAND=tl.bfloat16 if use_asm else tl.float32, EVEN=launch.even,
        REG_MMA=launch.reg_mma, UNSCALE=1.0 if launch.mainloop == "dot_scaled" else 2.0**7,
        BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, SUM_ROWS=launch.sum_rows,
        SUM_SPLITS=launch.sum_splits, PDL=int(launch.pdl), launch_pdl=launch.pdl,
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )


# Direct launches of compiled split-K kernels, by launch and the arguments' dtypes and alignments.
_compiled: dict = {}


def _compiled_key(launch, x, flags, args):
    """The key of a direct launch: the launch and what Triton specializes the kernel on (the
    arguments' dtypes and 16-byte alignments, x's row stride and the two flags)."""
    return (launch, x.device.index, x.stride(0), *flags.values(),
            *((t.dtype, t.data_ptr() % 16 == 0) for t in args[:9] if t is not None))


def gemm_splitk(x, w_data, w_scale, w_global_scale, bias, out_dtype, swizzled, tiled_n=None, x_scale=None,
                launch: plan.SplitKLaunch | None = None):
    """x (M, K) (bf16 on the GPU: the word decode multiplies in bf16; under the interpreter in fp32);
    W NVFP4 (N, K/2) + uint8 scale bits + g (() or (N,)) -> (M, N) out_dtype.
    tiled_n: W is in the tiled layout of nvfp4_inductor.reference.tiled, with N = tiled_n rows. x_scale
    (sm_100, tiled W only): x is NVFP4 itself, codes (M, K/2) + these plain scale bits (M, K/16),
    for the block-scaled MMA; w_global_scale must then hold both global scales (W's times x's).
    Elsewhere W4A4 passes x's quantized values. launch: plan.splitk_launch's for these operands
    (planned from them where None)."""
    m = x.shape[0]
    n = w_data.shape[0] if tiled_n is None else tiled_n
    tiled = tiled_n is not None
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if swizzled:
        check_swizzled_offsets("w.scale", *w_scale.shape)
    if bias is not None:
        bias = bias.contiguous()  # read as (N,) with unit stride
    x_format = "nvfp4" if x_scale is not None else "bf16"
    if x_format == "nvfp4" and not (tiled and capability.block_scaled_mma(x.device)):
        raise ValueError("an NVFP4 x (x_scale) needs tiled weights on sm_100 or newer; elsewhere pass "
                         "x's quantized values (nvfp4.quantize_values)")
    if launch is None:
        launch = plan.splitk_launch_for(x, w_data, w_scale, swizzled=swizzled, tiled_n=tiled_n, x_format=x_format)
    max_m = plan.WGMMA_MAX_M if launch.mainloop == "wgmma" else plan.SPLITK_MAX_M_TILED
    if m > max_m:
        raise ValueError(f"the split-K NVFP4 GEMM takes at most {max_m} rows with this mainloop; got {m}")
    k = x.shape[1] * (2 if x_format == "nvfp4" else 1)
    scale_cols_pad = w_scale.shape[1] if swizzled else k // BLOCK_SIZE
    if launch.splits > 1:
        partial = torch.empty((launch.splits, m, n), dtype=torch.float32, device=x.device)
        counters = launches.split_counters(x.device, launch.tiles)
    else:
        partial = counters = out
    args = (x, x_scale if x_scale is not None else x, w_data, w_scale, w_global_scale,
            bias if bias is not None else w_global_scale, out, partial, counters,
            m, n, k, scale_cols_pad, launch.steps_per_split, x.stride(0), out.stride(0))
    flags = dict(W_GLOBAL_SCALE_PER_ROW=w_global_scale.dim() > 0, HAS_BIAS=bias is not None)
    meta = _meta(launch, x.is_cuda)
    if not x.is_cuda:
        _splitk_kernel[launch.grid](*args, **flags, **meta)
        return out
    # The compiled kernel for this launch and these arguments' dtypes and alignments (what Triton
    # specializes a kernel on), launched without Triton's per-call argument binding.
    key = _compiled_key(launch, x, flags, args)
    compiled = _compiled.get(key)
    if compiled is None:
        kernel = _splitk_kernel[launch.grid](*args, **flags, **meta)
        if launches.direct_launch_runs(kernel):
            values = {**flags, **meta}
            _compiled[key] = (kernel, tuple(values[name] for name in _splitk_kernel.arg_names[len(args):]))
        return out
    kernel, constexprs = compiled
    launches.run(kernel, launch.grid, launches.current_stream(x.device.index), args + constexprs)
    return out


def bind_splitk(x, w_data, w_scale, w_global_scale, bias, out_dtype, tiled_n: int, out_shape,
                launch: plan.SplitKLaunch) -> launches.BoundLaunch | None:
    """A BoundLaunch of gemm_splitk(x, ..., tiled_n=tiled_n, launch=launch) for xs like x (CUDA, (M, K)
    bf16, unit K stride; W4A16 on tiled W, w_global_scale and bias contiguous), whose output is
    returned in out_shape (M * N elements); None if gemm_splitk has not launched it directly yet,
    or will not."""
    if not (x.is_cuda and x.dim() == 2 and x.dtype == torch.bfloat16 and x.stride(1) == 1
            and w_global_scale.is_contiguous() and (bias is None or bias.is_contiguous())):
        return None
    m, n, k = x.shape[0], tiled_n, x.shape[1]
    if not 0 < m <= plan.WGMMA_MAX_M or n == 0 or launch.mainloop == "dot_scaled":
        return None
    # the key's other tensors as gemm_splitk makes them (what it reads: dtypes, alignments)
    out = torch.empty((1,), dtype=out_dtype, device=x.device)
    partial, counters = ((torch.empty((1,), dtype=dtype, device=x.device) for dtype in (torch.float32, torch.int32))
                         if launch.splits > 1 else (out, out))
    weights = (w_data, w_scale, w_global_scale, bias if bias is not None else w_global_scale)
    flags = dict(W_GLOBAL_SCALE_PER_ROW=w_global_scale.dim() > 0, HAS_BIAS=bias is not None)
    compiled = _compiled.get(_compiled_key(launch, x, flags, (x, x, *weights, out, partial, counters)))
    if compiled is None:
        return None
    bound = launches.BoundLaunch()
    bound.compiled, constexprs = compiled
    bound.grid, bound.device, bound.out_shape, bound.out_dtype = launch.grid, x.device, tuple(out_shape), out_dtype
    bound.partial_numel = launch.splits * m * n if launch.splits > 1 else 0
    bound.tiles, bound.weights = launch.tiles, weights
    bound.tail = (m, n, k, k // BLOCK_SIZE, launch.steps_per_split, x.stride(0), n, *constexprs)
    return bound
