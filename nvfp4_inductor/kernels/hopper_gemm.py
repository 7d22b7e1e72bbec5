"""Hopper (sm_90) W4A16 GEMM in Gluon: y = x @ W^T * g (+ bias), x bf16 (M, K), W NVFP4 in the
layout of nvfp4_inductor.reference.hopper, for M from a few tens of rows to thousands.

Swapped form: the kernel computes y^T = W . x^T. A program owns ROWS weight rows (wgmma's M side,
64 a warpgroup) and BLOCK_T tokens (wgmma's N, 8..256), so a small M wastes no MMA rows.

    acc[r, t] = sum_k  decode(W)[n0 + r, k] * x[t0 + t, k]          (fp32, wgmma)
    y[t0 + t, n0 + r] = acc[r, t] * (g * 2^UNSCALE_LOG2) (+ bias[n0 + r])

Per K-step of BLOCK_K:
1. TMA copies x's (BLOCK_T, BLOCK_K) tile (128-byte swizzle: wgmma's B operand, read transposed),
   the codes' (BLOCK_K / 64, 2 ROWS, 4) int32 box and the scales' (BLOCK_K / 64, 2 ROWS) int16 box
   into one of STAGES shared-memory slots, behind the slot's mbarrier.
2. Each lane loads its code words (16 bytes a 64-wide K chunk) and scale pairs, and decodes them in
   registers straight into wgmma's A-operand layout (reference.hopper: per 4 bf16x2 registers,
   11 shift / mask operations, 2 integer multiply-adds for the scale pairs, 4 mul.bf16x2). The
   decoded values are e2m1 * s * 2^-UNSCALE_LOG2, exact in bf16.
3. wgmma (A from registers, B = x^T from shared memory) is issued asynchronously and waited with
   one group left in flight: the tensor cores multiply step i while the warps decode step i + 1.
   Once step i - 1's group is done its slot is free, and the TMA for step i + STAGES - 1 goes there
   (after a CTA barrier: every warp has read the slot's codes).
Tiles past M, N or K are zero-filled by TMA; the epilogue masks its stores.

Programs are ordered in groups of GROUP_N weight tiles: consecutive programs share x's tile and a
wave covers few weight tiles many times, so at large M each weight tile comes from HBM about once.
"""

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from nvfp4_inductor.kernels.gemm_configs import HopperConfig, hopper_config
from nvfp4_inductor.reference import hopper as layout

# int32 masks, written signed (Gluon constants are int32)
_PAIR_MASK = gl.constexpr(0x81C081C0 - (1 << 32))  # magnitudes at bits 6..8, 22..24; signs 15, 31
_MAG_MASK = gl.constexpr(0x01C001C0)
_SIGN_MASK = gl.constexpr(0x80008000 - (1 << 32))
_SCALE_SPREAD = gl.constexpr(0x00100010)  # S -> S << 4 | S << 20
_SCALE_EXPONENT = gl.constexpr(0x70007000)  # exponent field + 224, both halves
_CHUNK_K = gl.constexpr(layout.CHUNK_K)
_UNSCALE = gl.constexpr(float(2**layout.UNSCALE_LOG2))  # the decode's 2^-20 undone


@gluon.jit
def _mul_bf16x2(a, b):
    """int32 words holding bf16 pairs -> their product, pair by pair (one mul.rn.bf16x2)."""
    return gl.inline_asm_elementwise("mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=gl.int32,
                                     is_pure=True, pack=1)


@gluon.jit
def _bf16_pair(p):
    """int32 bf16x2 words (...) -> bf16 (..., 2): low half, high half."""
    low = (p & 0xFFFF).to(gl.int16).to(gl.bfloat16, bitcast=True)
    high = (p >> 16).to(gl.int16).to(gl.bfloat16, bitcast=True)
    return gl.join(low, high)


@gluon.jit
def _decode_step(codes_smem, scales_smem, a_layout: gl.constexpr, ROWS: gl.constexpr,
                 BLOCK_K: gl.constexpr, num_warps: gl.constexpr):
    """A slot's codes (BLOCK_K/64, 2 ROWS, 4) and scale pairs (BLOCK_K/64, 2 ROWS) -> bf16
    (ROWS, BLOCK_K) in a_layout (wgmma's A operand), e2m1 * s * 2^-UNSCALE_LOG2."""
    KC: gl.constexpr = BLOCK_K // _CHUNK_K
    # (kc, 8 rg + g, q, w): lane 4 g + q, warps along rg, a lane's 4 words of a chunk contiguous
    words_layout: gl.constexpr = gl.BlockedLayout([1, 1, 1, 4], [1, 8, 4, 1], [1, num_warps, 1, 1], [3, 2, 1, 0])
    w = codes_smem.reshape([KC, ROWS // 2, 4, 4]).load(words_layout)
    s = scales_smem.reshape([KC, ROWS // 2, 4]).load(gl.SliceLayout(2, words_layout)).to(gl.int32)
    s = gl.expand_dims(s, 2)  # the 4 lanes q of a row pair read the same scales
    scale_h0 = (s & 0xFF) * _SCALE_SPREAD + _SCALE_EXPONENT
    scale_h1 = ((s >> 8) & 0xFF) * _SCALE_SPREAD + _SCALE_EXPONENT
    scale_h0, _ = gl.broadcast(scale_h0, w)
    scale_h1, _ = gl.broadcast(scale_h1, w)
    p00 = _mul_bf16x2(w & _PAIR_MASK, scale_h0)
    p10 = _mul_bf16x2((w << 6) & _PAIR_MASK, scale_h1)
    p01 = _mul_bf16x2(((w << 3) & _MAG_MASK) | ((w << 5) & _SIGN_MASK), scale_h0)
    p11 = _mul_bf16x2(((w >> 5) & _MAG_MASK) | ((w << 1) & _SIGN_MASK), scale_h1)
    # (kc, rg g, q, w, e, c, h) -> rows (rg, h, g), columns (kc, w, c, q, e)
    v = gl.join(gl.join(_bf16_pair(p00), _bf16_pair(p01)), gl.join(_bf16_pair(p10), _bf16_pair(p11)))
    v = gl.reshape(v, [KC, ROWS // 16, 8, 4, 4, 2, 2, 2])
    v = gl.reshape(gl.permute(v, [1, 7, 2, 0, 4, 6, 3, 5]), [ROWS, BLOCK_K])
    return gl.convert_layout(v, a_layout, assert_trivial=True)


@gluon.jit
def _issue_loads(step, x_desc, codes_desc, scales_desc, x_bufs, codes_bufs, scales_bufs, bars, t0, n0,
                 pred, STAGES: gl.constexpr):
    """TMA copies of K-step `step` into slot step % STAGES, signalled on its barrier (when pred)."""
    slot = step % STAGES
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    KC: gl.constexpr = BLOCK_K // _CHUNK_K
    bar = bars.index(slot)
    nbytes: gl.constexpr = x_desc.block_type.nbytes + codes_desc.block_type.nbytes + scales_desc.block_type.nbytes
    mbarrier.expect(bar, nbytes, pred=pred)
    tma.async_copy_global_to_shared(x_desc, [t0, step * BLOCK_K], bar, x_bufs.index(slot), pred)
    tma.async_copy_global_to_shared(codes_desc, [step * KC, 2 * n0, 0], bar, codes_bufs.index(slot), pred)
    tma.async_copy_global_to_shared(scales_desc, [step * KC, 2 * n0], bar, scales_bufs.index(slot), pred)


@gluon.jit
def _tile_ids(M, N, ROWS: gl.constexpr, BLOCK_T: gl.constexpr, GROUP_N: gl.constexpr):
    """Program id -> (weight tile, token tile): groups of GROUP_N weight tiles, tokens inside."""
    pid = gl.program_id(0)
    tiles_n = gl.cdiv(N, ROWS)
    tiles_t = gl.cdiv(M, BLOCK_T)
    per_group = GROUP_N * tiles_t
    first_n = (pid // per_group) * GROUP_N
    group_size = gl.minimum(tiles_n - first_n, GROUP_N)
    in_group = pid % per_group
    return first_n + in_group % group_size, in_group // group_size


@gluon.jit
def hopper_w4a16_kernel(
    x_desc, codes_desc, scales_desc,  # TMA descriptors: x (M, K) bf16, the layout's codes and scales
    w_global_scale_ptr, bias_ptr, out_ptr,  # fp32 g (one, or one a row), bias (N,), out (M, N)
    M, N, stride_om,
    W_GLOBAL_SCALE_PER_ROW: gl.constexpr, HAS_BIAS: gl.constexpr, STAGES: gl.constexpr,
    GROUP_N: gl.constexpr, num_warps: gl.constexpr,
):
    BLOCK_T: gl.constexpr = x_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    ROWS: gl.constexpr = codes_desc.block_type.shape[1] // 2
    K = x_desc.shape[1]

    pid_n, pid_t = _tile_ids(M, N, ROWS, BLOCK_T, GROUP_N)
    n0 = pid_n * ROWS
    t0 = pid_t * BLOCK_T

    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    codes_bufs = gl.allocate_shared_memory(codes_desc.dtype, [STAGES] + codes_desc.block_type.shape,
                                           codes_desc.layout)
    scales_bufs = gl.allocate_shared_memory(scales_desc.dtype, [STAGES] + scales_desc.block_type.shape,
                                            scales_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()

    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_T, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    acc = gl.zeros([ROWS, BLOCK_T], gl.float32, acc_layout)
    a_prev = gl.zeros([ROWS, BLOCK_K], gl.bfloat16, a_layout)

    # at least one step: with a zero-trip path the accumulator's zeros would reach the final wait
    # outside wgmma, and ptxas serializes every wgmma (C7515)
    steps = gl.maximum(gl.cdiv(K, BLOCK_K), 1)
    for i in gl.static_range(STAGES - 1):
        _issue_loads(i, x_desc, codes_desc, scales_desc, x_bufs, codes_bufs, scales_bufs, bars, t0, n0,
                     i < steps, STAGES)
    for i in range(steps):
        slot = i % STAGES
        mbarrier.wait(bars.index(slot), (i // STAGES) & 1)
        a = _decode_step(codes_bufs.index(slot), scales_bufs.index(slot), a_layout, ROWS, BLOCK_K, num_warps)
        acc = warpgroup_mma(a, x_bufs.index(slot).permute((1, 0)), acc, use_acc=i > 0, is_async=True)
        # step i - 1's MMA is done: its A registers and its slot may be reused
        acc, a_prev = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a_prev))
        a_prev = a
        gl.thread_barrier()
        j = i + STAGES - 1
        _issue_loads(j, x_desc, codes_desc, scales_desc, x_bufs, codes_bufs, scales_bufs, bars, t0, n0,
                     j < steps, STAGES)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))

    # epilogue: each thread 8 consecutive output columns (16-byte stores)
    out_layout: gl.constexpr = gl.BlockedLayout([8, 1], [8, 4], [1, num_warps], [0, 1])
    y = gl.convert_layout(acc, out_layout)
    rows = n0 + gl.arange(0, ROWS, gl.SliceLayout(1, out_layout))
    tokens = t0 + gl.arange(0, BLOCK_T, gl.SliceLayout(0, out_layout))
    row_ok = rows < N
    if W_GLOBAL_SCALE_PER_ROW:
        g = gl.load(w_global_scale_ptr + rows, mask=row_ok, other=0.0)[:, None]
    else:
        g = gl.load(w_global_scale_ptr)
    y = y * (g * _UNSCALE)
    if HAS_BIAS:
        y = y + gl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(gl.float32)[:, None]
    offsets = tokens.to(gl.int64)[None, :] * stride_om + rows[:, None]
    mask = row_ok[:, None] & (tokens < M)[None, :]
    gl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)


def descriptor_layouts(config: HopperConfig):
    """-> the shared-memory layouts of x's, the codes' and the scales' TMA boxes, and the boxes."""
    kc = config.block_k // layout.CHUNK_K
    x_box = [config.block_t, config.block_k]
    codes_box = [kc, 2 * config.rows, 4]
    scales_box = [kc, 2 * config.rows]
    return ((gl.NVMMASharedLayout.get_default_for(x_box, gl.bfloat16), x_box),
            (gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3), codes_box),
            (gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2), scales_box))


def hopper_linear(x, w_codes, w_scales, w_global_scale, bias=None, out_dtype=torch.bfloat16,
                  config: HopperConfig | None = None, n: int | None = None):
    """x (M, K) bf16, W as reference.hopper.pack's (codes, scales) of N rows, g fp32 () or (N,),
    bias (N,) or None -> (M, N) out_dtype: x @ W^T * g + bias."""
    if x.dim() != 2 or x.dtype != torch.bfloat16:
        raise ValueError(f"x must be a 2-D bf16 tensor, got {tuple(x.shape)} {x.dtype}")
    m, k = x.shape
    chunks, rows2 = w_scales.shape
    n = rows2 // 2 if n is None else n
    if w_codes.shape != (chunks, rows2, 4) or w_codes.dtype != torch.int32 or w_scales.dtype != torch.int16:
        raise ValueError("w_codes, w_scales must be reference.hopper.pack's int32 and int16 tensors")
    if k % 16 or not k <= chunks * layout.CHUNK_K < k + layout.CHUNK_K or n > rows2 // 2:
        raise ValueError(f"weights packed for K = {chunks * layout.CHUNK_K}, N <= {rows2 // 2}; x has K = {k}")
    per_row = w_global_scale.dim() == 1
    if per_row and w_global_scale.shape != (n,):
        raise ValueError(f"a per-row global scale must have shape ({n},)")
    config = config or hopper_config(m)
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        x = x.contiguous()
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    (x_layout, x_box), (codes_layout, codes_box), (scales_layout, scales_box) = descriptor_layouts(config)
    x_desc = TensorDescriptor(x, list(x.shape), list(x.stride()), x_box, x_layout)
    codes_desc = TensorDescriptor.from_tensor(w_codes, codes_box, codes_layout)
    scales_desc = TensorDescriptor.from_tensor(w_scales, scales_box, scales_layout)
    g = w_global_scale.to(torch.float32).contiguous()
    grid = (triton.cdiv(n, config.rows) * triton.cdiv(m, config.block_t), )
    hopper_w4a16_kernel[grid](
        x_desc, codes_desc, scales_desc, g, bias if bias is not None else g, out, m, n, out.stride(0),
        W_GLOBAL_SCALE_PER_ROW=per_row, HAS_BIAS=bias is not None, STAGES=config.stages,
        GROUP_N=config.group_n, num_warps=config.num_warps)
    return out
