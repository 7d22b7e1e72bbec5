"""Grouped NVFP4 GEMM for mixture-of-experts layers (W4A16 and W4A4, eager): y[t] = x[t] @ W_e^T for the
tokens t of each expert e. W: the experts' codes and plain e4m3 scale bits laid out by
tiled.tile_experts (each expert in the dense GEMM's tiled layout, N_pad stored rows, one expert
after another; gated: gate and up rows interleaved by 32) + one fp32 global scale per expert.

Tokens arrive sorted by expert with `offsets` (E,) int32, the `torch._grouped_mm` convention:
expert e owns rows [offsets[e - 1], offsets[e]) (offsets[-1] read as 0). The counts stay on the
device, so the launch is sized for the worst case and every program finds its work itself:

1. Work list. Expert e needs ceil(count_e / BLOCK_M) row tiles; over all experts that is at most
   floor(T / BLOCK_M) + min(E, T) (each expert with rows adds at most one partial tile). The grid
   is that bound times ceil(N_pad / BLOCK_N), by the K splits, blocks of rows first. Program
   (m, n) loads the E offsets, takes the inclusive cumulative sum of the tile counts, and finds
   its expert as the number of experts whose sum is <= m; a program past the last tile returns at
   once. No host sync, so a launch can be captured in a CUDA graph and replayed with other routings.
2. Mainloop: the dense split-K kernel's (device/mainloops.mainloop), on the expert's tiles and the tile's rows of x, as
   plan.plan_grouped chooses by the
   rows an expert gets on average (T / E; the counts stay on the device):
   - decode (at most 16 on CUDA, sm_90 and up, bf16 x): the register-fed mainloop
     (device/mma.mma_mainloop) on 8, 16 or 32 rows of x, K split so that the few experts hit still
     fill the SMs (the dense split-K scheme: fp32 partials, the tile's last split sums them in order);
   - serving batches (17 to plan.WGMMA_MAX_M on sm_90, bf16 x): the wgmma mainloop on
     blocks of 64 rows;
   - W4A4 on GPUs with the block-scaled MMA (sm_100 and up), any rows (dot_scaled): x's per-group
     NVFP4 codes and scales and the experts' go to tl.dot_scaled (device/mainloops.dot_scaled_mainloop);
     compiled for sm_100 in CI and run on the CPU through a stand-in, never on hardware;
   - prefill (above those on CUDA, sm_90 and up, K a multiple of 16; not with x's codes): every
     expert dequantized to bf16 once, torch._grouped_mm, then step 3 as a kernel of its own over
     a work list of its own tiles (`_grouped_dequant`; each linear rounded once more, to bf16, in
     between);
   - otherwise, and under the interpreter: the tl.dot mainloop (each 64 x 64 tile decoded
     in registers to e2m1 * s * 2^-7, exact in bf16, and multiplied by tl.dot in fp32);
   x enters rounded to bf16 (W4A16); W4A4 passes x's quantized values (e2m1 * s_x, exact; on
   sm_100 its codes and scale bits) and one global scale per row.
3. Epilogue: acc * 2^7 (the decode's 2^-7 back; not after tl.dot_scaled or torch._grouped_mm)
   * g_e (* g_x per row) + bias_e, rounded once to the output dtype. The gated form (GATED)
   pairs each tile's 32 gate rows with its 32 up rows and writes silu(gate) * up, each linear
   rounded to the output dtype first, as reference.silu_mul.
Rows at or past offsets[E - 1] are zero in the output (torch._grouped_mm leaves them unwritten).

On CUDA the offsets are never read back, so they are not checked there: values are clamped to
[0, T] (memory-safe; rows of an unordered group are computed with whichever expert the clamped
ranges give). The CPU reference raises on them.

Under the Triton interpreter (no inline PTX, no bf16 tl.dot) the decode is the byte form and the
products run in fp32.
"""

import torch
import triton
import triton.language as tl

from nvfp4_inductor.kernels import launch as launches
from nvfp4_inductor.kernels import plan
from nvfp4_inductor.kernels.device.common import BLOCK, LAYOUT_TILED, TILED_K, TILED_N, round_to
from nvfp4_inductor.kernels.device.epilogue import last_split, silu_mul_halves, split_tiles
from nvfp4_inductor.kernels.device.mainloops import MAINLOOP_DOT_SCALED, MAINLOOPS, mainloop
from nvfp4_inductor.reference.tiled import expert_rows, stored_rows


_UNSCALE: tl.constexpr = tl.constexpr(2.0**7)  # the decode's 2^-7 (device/mainloops.py)


@triton.jit
def _find_tile(offsets_ptr, E, T, pid_m, BLOCK_M: tl.constexpr, E_POW2: tl.constexpr):
    """Token tile pid_m of the work list -> (expert, first row, end row of that expert, valid)."""
    es = tl.arange(0, E_POW2)
    in_range = es < E
    ends = tl.load(offsets_ptr + es, mask=in_range, other=0)
    starts = tl.load(offsets_ptr + es - 1, mask=in_range & (es > 0), other=0)
    ends = tl.minimum(tl.maximum(ends, 0), T)
    starts = tl.minimum(tl.maximum(starts, 0), T)
    tiles = tl.where(in_range, tl.cdiv(tl.maximum(ends - starts, 0), BLOCK_M), 0)
    cum = tl.cumsum(tiles, 0)  # inclusive
    expert = tl.sum((cum <= pid_m).to(tl.int32), 0)
    valid = pid_m < tl.sum(tiles, 0)
    this = es == expert
    local = pid_m - tl.sum(tl.where(this, cum - tiles, 0), 0)
    row0 = tl.sum(tl.where(this, starts, 0), 0) + local * BLOCK_M
    end = tl.sum(tl.where(this, ends, 0), 0)
    return expert, row0, end, valid


@triton.jit
def grouped_linear_kernel(
    # pointers
    x_ptr, offsets_ptr, w_ptr, w_scale_ptr, w_global_scale_ptr, x_global_scale_ptr, bias_ptr, out_ptr,
    partial_ptr, counter_ptr, x_scale_ptr,
    # sizes
    T, NP, K, E, N_OUT, M_TILES, steps_per_split,
    # strides
    stride_xt, stride_ot,
    # meta-parameters
    MAINLOOP: tl.constexpr, HAS_BIAS: tl.constexpr, X_SCALED: tl.constexpr, GATED: tl.constexpr,
    USE_ASM: tl.constexpr, OPERAND: tl.constexpr, SPLIT: tl.constexpr, EVEN: tl.constexpr,
    E_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    REG_MMA: tl.constexpr, ACC_M: tl.constexpr,
):
    """out (T, N_OUT) for the work-list tile of this program (module docstring). NP: the rows an
    expert's tiled weight stores (tiled.expert_rows), N_OUT the output columns (with GATED half
    the logical rows: column n from the interleaved gate and up rows). Program (tile, split), the
    tile m + M_TILES * n (blocks of rows first: an expert's weight tile is read by its row blocks
    together), multiplies K-steps [split * steps_per_split, ...); with SPLIT, its fp32 products go
    to partial (splits, T, NP) and the tile's last split to finish sums them in split order and
    runs the epilogue (the dense split-K kernel's scheme: device/epilogue.last_split).
    MAINLOOP: device/mainloops.mainloop's; the register-fed one takes REG_MMA blocks of 8 rows
    (BLOCK_M = 8 * REG_MMA, BLOCK_N = BLOCK_K = 64, 2 warps), its tile ACC_M = 8 * max(REG_MMA, 2)
    columns wide, those past BLOCK_M unused; elsewhere ACC_M = BLOCK_M.
    HAS_BIAS: bias (E, NP) in the stored row order; X_SCALED: x_global_scale_ptr (T,), each row's
    global scale (W4A4). MAINLOOP_DOT_SCALED (sm_100, W4A4): x_ptr holds x's e2m1 codes (T, K/2) and
    x_scale_ptr their e4m3 bits (T, K/16)."""
    pid_m = tl.program_id(0) % M_TILES
    pid_n = tl.program_id(0) // M_TILES
    pid_k = tl.program_id(1)
    expert, row0, end, valid = _find_tile(offsets_ptr, E, T, pid_m, BLOCK_M, E_POW2)
    if valid:
        ts = row0 + tl.arange(0, ACC_M)
        t_ok = (tl.arange(0, ACC_M) < BLOCK_M) & (ts < end)
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # stored weight rows of the expert
        e64 = expert.to(tl.int64)
        # the expert's tiles: whole tiles, so its codes start on 2 KiB and its scales on 256 bytes
        expert_tiles = (NP // TILED_N) * tl.cdiv(K, TILED_K)
        w_e = w_ptr + tl.multiple_of(e64 * expert_tiles * (TILED_N * TILED_K // 2), 16)
        s_e = w_scale_ptr + tl.multiple_of(e64 * expert_tiles * (TILED_N * TILED_K // BLOCK), 16)
        m_rows = tl.minimum(end - row0, BLOCK_M)
        x_t = x_ptr + row0.to(tl.int64) * stride_xt
        xs_t = x_scale_ptr + row0.to(tl.int64) * (K // BLOCK)
        t_begin, t_end = split_tiles(pid_k, steps_per_split, tl.cdiv(K, BLOCK_K))
        acc = mainloop(x_t, xs_t, w_e, s_e, m_rows, NP, K, stride_xt, 0, pid_n, t_begin, t_end, MAINLOOP,
                       LAYOUT_TILED, USE_ASM, OPERAND, EVEN, REG_MMA, 0, BLOCK_M, BLOCK_N, BLOCK_K)
        # (the epilogue's: the decode's 2^-7 back)
        UNSCALE: tl.constexpr = 1.0 if MAINLOOP == MAINLOOP_DOT_SCALED else _UNSCALE
        if SPLIT:
            # this split's products, then the tile's last split sums all of them, in split order
            mask = t_ok[None, :]
            place = ts.to(tl.int64)[None, :] * NP + rows[:, None]
            split_stride = tl.cast(T, tl.int64) * NP
            tl.store(partial_ptr + pid_k * split_stride + place, acc, mask=mask)
            if last_split(counter_ptr + tl.program_id(0), tl.num_programs(1)):
                acc = tl.zeros((BLOCK_N, ACC_M), tl.float32)
                for split in range(0, tl.num_programs(1)):
                    acc += tl.load(partial_ptr + split * split_stride + place, mask=mask, other=0.0,
                                   cache_modifier=".cg")
                _epilogue(acc, expert, ts, t_ok, pid_n, NP, N_OUT, w_global_scale_ptr, x_global_scale_ptr,
                          bias_ptr, out_ptr, stride_ot, HAS_BIAS, X_SCALED, GATED, UNSCALE, BLOCK_N)
        else:
            _epilogue(acc, expert, ts, t_ok, pid_n, NP, N_OUT, w_global_scale_ptr, x_global_scale_ptr, bias_ptr,
                      out_ptr, stride_ot, HAS_BIAS, X_SCALED, GATED, UNSCALE, BLOCK_N)


@triton.jit
def _epilogue(acc, expert, ts, t_ok, pid_n, NP, N_OUT, w_global_scale_ptr, x_global_scale_ptr, bias_ptr, out_ptr,
              stride_ot, HAS_BIAS: tl.constexpr, X_SCALED: tl.constexpr, GATED: tl.constexpr,
              UNSCALE: tl.constexpr, BLOCK_N: tl.constexpr):
    """A tile's fp32 products (BLOCK_N stored weight rows from pid_n * BLOCK_N, x rows ts) -> out; UNSCALE:
    what the products are multiplied by besides the global scales (2^7 after the decode's 2^-7).
    GATED: the rows are interleave_halves' (32 gate rows, the same 32 up rows, ...): out columns
    rows // 64 * 32 + rows % 32, silu(gate) * up, each linear rounded to out's dtype first."""
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    g = tl.load(w_global_scale_ptr + expert) * UNSCALE
    y = acc * g
    if X_SCALED:
        y = y * tl.load(x_global_scale_ptr + ts, mask=t_ok, other=0.0)[None, :]
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + expert.to(tl.int64) * NP + rows).to(tl.float32)[:, None]
    OUT: tl.constexpr = out_ptr.dtype.element_ty
    if GATED:
        y = silu_mul_halves(y, tl.full((BLOCK_N,), 1.0, tl.float32), OUT, BLOCK_N, acc.shape[1])
        cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    else:
        cols = rows
    tl.store(out_ptr + ts.to(tl.int64)[None, :] * stride_ot + cols[:, None], round_to(y, OUT).to(OUT),
             mask=(cols < N_OUT)[:, None] & t_ok[None, :])


@triton.jit
def grouped_epilogue_kernel(y_ptr, offsets_ptr, w_global_scale_ptr, x_global_scale_ptr, bias_ptr, out_ptr,
                            T, NP, E, N_OUT, M_TILES, stride_yt, stride_ot, HAS_BIAS: tl.constexpr,
                            X_SCALED: tl.constexpr, GATED: tl.constexpr, E_POW2: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The prefill form's epilogue (_grouped_dequant): y (T, NP) bf16 products of x and the
    experts' e2m1 * block scale, in the stored row order -> out, over the kernel's work list, by
    its _epilogue."""
    pid_m = tl.program_id(0) % M_TILES
    pid_n = tl.program_id(0) // M_TILES
    expert, row0, end, valid = _find_tile(offsets_ptr, E, T, pid_m, BLOCK_M, E_POW2)
    if valid:
        ts = row0 + tl.arange(0, BLOCK_M)
        t_ok = ts < end
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.load(y_ptr + ts.to(tl.int64)[None, :] * stride_yt + rows[:, None],
                      mask=(rows < NP)[:, None] & t_ok[None, :], other=0.0).to(tl.float32)
        _epilogue(acc, expert, ts, t_ok, pid_n, NP, N_OUT, w_global_scale_ptr, x_global_scale_ptr, bias_ptr,
                  out_ptr, stride_ot, HAS_BIAS, X_SCALED, GATED, 1.0, BLOCK_N)


def _stored_bias(bias: torch.Tensor | None, gated: bool) -> torch.Tensor | None:
    """bias (E, N) in the logical row order -> (E, N_pad) in the stored one (tiled.stored_rows)."""
    return None if bias is None else stored_rows(bias[..., None], gated)[..., 0].contiguous()


def _grouped_dequant(x, offsets, w_data, w_scale, w_global_scale, bias, np_, n_out, gated, x_global_scale,
                     out_dtype, launch: plan.GroupedLaunch):
    """The grouped GEMM as every expert dequantized to bf16 (e2m1 * block scale, exact), one
    torch._grouped_mm (bf16 products, rounded to bf16: torch's only output type) and
    grouped_epilogue_kernel (each row's expert's global scale, W4A4: times the row's, bias,
    silu(gate) * up, rounded to the output dtype): each linear is rounded once more than in the
    kernel. The offsets are clamped to [0, T] and made non-decreasing first (torch._grouped_mm
    reads memory by them); rows past the groups are zero."""
    from nvfp4_inductor.kernels.dequantize import dequantize

    t, k = x.shape
    e = w_data.shape[0]
    # the experts' tiles, one after another, are the tiles of one (E * N_pad, K) weight
    w = dequantize(w_data.reshape(-1), w_scale.reshape(-1), None, False, torch.bfloat16,
                   tiled_nk=(e * np_, k)).view(e, np_, k)
    offsets = torch.cummax(offsets.clamp(0, t), 0).values
    y = torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)
    del w
    out = torch.zeros((t, n_out), dtype=out_dtype, device=x.device)
    grouped_epilogue_kernel[(launch.m_tiles * launch.n_tiles,)](
        y, offsets, w_global_scale, x_global_scale if x_global_scale is not None else w_global_scale,
        bias if bias is not None else w_global_scale, out, t, np_, e, n_out, launch.m_tiles, y.stride(0),
        out.stride(0), HAS_BIAS=bias is not None, X_SCALED=x_global_scale is not None, GATED=gated,
        E_POW2=triton.next_power_of_2(e), BLOCK_M=launch.block_m, BLOCK_N=launch.block_n,
        num_warps=launch.num_warps)
    return out


def grouped_launch_for(x, w_data, w_scale, n: int, gated: bool, x_scale=None, splits: int | None = None,
                       dequant: bool | None = None) -> plan.GroupedLaunch:
    """plan.plan_grouped for grouped_linear's operands (x already bf16 unless x_scale is given)."""
    t, k = x.shape[0], x.shape[1] * (2 if x_scale is not None else 1)
    fits = (x_scale is None and x.dtype == torch.bfloat16 and w_data.shape[1] < 2**31
            and plan.mma_operands_aligned(x, w_data, w_scale, tiled=True))
    return plan.plan_grouped(t, w_data.shape[0], expert_rows(n, gated), k, device=x.device,
                             x_codes=x_scale is not None, mma_operands_fit=fits, splits=splits, dequant=dequant)


def grouped_linear(x: torch.Tensor, offsets: torch.Tensor, w_data: torch.Tensor, w_scale: torch.Tensor,
                   w_global_scale: torch.Tensor, bias: torch.Tensor | None, n: int, gated: bool,
                   x_global_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                   x_scale: torch.Tensor | None = None, launch: plan.GroupedLaunch | None = None) -> torch.Tensor:
    """x (T, K) float, offsets (E,) int32, W tiled by tiled.tile_experts ((E, N_pad * K_pad / 2)
    uint8 + (E, N_pad * K_pad / 16) uint8 e4m3 bits) of N logical rows an expert + (E,) fp32,
    bias (E, N) or None -> (T, N) in out_dtype (default x.dtype), or (T, N/2) silu(gate) * up with
    gated. x_global_scale (T,) fp32: x holds W4A4's quantized values (bf16) and this each row's
    global scale. x_scale (T, K/16) uint8 (sm_100, W4A4, with x_global_scale and out_dtype): x
    holds x's e2m1 codes (T, K/2) uint8 and this their e4m3 bits, multiplied by the block-scaled
    MMA. launch: grouped_launch_for's (planned from the operands where None). Arguments checked by
    the caller (ops/grouped.py)."""
    t, k = x.shape[0], x.shape[1] * (2 if x_scale is not None else 1)
    e = w_data.shape[0]
    np_ = expert_rows(n, gated)
    n_out = n // 2 if gated else n
    out_dtype = out_dtype or x.dtype
    if t == 0 or n_out == 0:
        return torch.zeros((t, n_out), dtype=out_dtype, device=x.device)
    if x_scale is None and x.dtype != torch.bfloat16:
        x = x.to(torch.bfloat16)  # W4A16's x, rounded to nearest even
    if x.stride(-1) != 1:
        x = x.contiguous()
    # the kernels index these with unit strides: a strided view (offsets[::2]) would be misread
    offsets, w_global_scale = offsets.contiguous(), w_global_scale.contiguous()
    if x_global_scale is not None:
        x_global_scale = x_global_scale.contiguous()
    if x_scale is not None:
        x_scale = x_scale.contiguous()
    bias = _stored_bias(bias, gated)
    if launch is None:
        launch = grouped_launch_for(x, w_data, w_scale, n, gated, x_scale)
    if not launch.mainloop:
        return _grouped_dequant(x, offsets, w_data, w_scale, w_global_scale, bias, np_, n_out, gated,
                                x_global_scale, out_dtype, launch)
    out = torch.zeros((t, n_out), dtype=out_dtype, device=x.device)  # rows past offsets[E - 1]: zero
    if launch.splits > 1:
        partial = torch.empty((launch.splits, t, np_), dtype=torch.float32, device=x.device)
        counters = launches.split_counters(x.device, launch.m_tiles * launch.n_tiles)
    else:
        partial = counters = out  # (unused)
    extra = {} if launch.num_stages is None else {"num_stages": launch.num_stages}
    grouped_linear_kernel[(launch.m_tiles * launch.n_tiles, launch.splits)](
        x, offsets, w_data, w_scale, w_global_scale,
        x_global_scale if x_global_scale is not None else w_global_scale,  # unused without X_SCALED
        bias if bias is not None else w_global_scale,  # unused without HAS_BIAS
        out, partial, counters, x_scale if x_scale is not None else w_scale,  # unused but for dot_scaled
        t, np_, k, e, n_out, launch.m_tiles, launch.steps_per_split, x.stride(0), out.stride(0),
        MAINLOOP=MAINLOOPS[launch.mainloop], HAS_BIAS=bias is not None, X_SCALED=x_global_scale is not None,
        GATED=gated, USE_ASM=launch.use_asm, OPERAND=tl.bfloat16 if x.is_cuda else tl.float32, SPLIT=launch.splits > 1,
        EVEN=launch.even, E_POW2=triton.next_power_of_2(e), BLOCK_M=launch.block_m,
        BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, REG_MMA=launch.reg_mma, ACC_M=launch.acc_m,
        num_warps=launch.num_warps, **extra,
    )
    return out
