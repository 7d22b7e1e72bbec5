"""Fused NVFP4 quantize: global amax -> global scale -> e4m3 block scales -> packed E2M1 codes,
scales written plain or straight into the swizzled 128x4-tile layout (padding zeroed).

x is viewed as (M, K) rows (last dim contiguous, any row stride). Outputs:
    data  (M, K/2) uint8         data[m, j] = code[m, 2j] | code[m, 2j + 1] << 4
    scale (M, K/16) uint8 bits, or swizzled (ceil(M/128)*128, ceil(K/64)*4) with padding 0
    g     () or (M,) fp32        written by the kernel itself (no extra copy launch)

Global scale modes (GLOBAL):
    G_STATIC      one given g (per tensor)                                   1 launch
    G_STATIC_ROW  given g per row, or per-row g just computed by _row_g_kernel
    G_FUSED       dynamic per tensor, small x: every program reduces all of x 1 launch
    G_PARTIALS    dynamic per tensor: _amax_partials_kernel writes <= MAX_PARTIALS maxima, each
                  quantize program reduces those (4 KB, from L2)            2 launches
Nothing is read back to the host: capturable in a CUDA graph, no sync.
"""

import torch
import triton
import triton.language as tl

from ..format import BLOCK_SIZE
from ..reference import swizzled_shape
from ._common import (
    BLOCK,
    block_scale_bits,
    e2m1_encode,
    e4m3_bits_to_f32,
    finite_abs,
    global_scale_from_amax,
    load_pairs,
    swizzled_scale_offset,
)

G_STATIC: tl.constexpr = tl.constexpr(0)
G_STATIC_ROW: tl.constexpr = tl.constexpr(1)
G_FUSED: tl.constexpr = tl.constexpr(2)
G_PARTIALS: tl.constexpr = tl.constexpr(3)

# Tiles: BLOCK_K is a multiple of 64 so that one column of K-tiles covers a whole swizzled scale
# column group (4 blocks of 16), BLOCK_M divides 128 (one swizzled row tile).
BLOCK_M = 32
BLOCK_K = 128
NUM_WARPS = 4
# Dynamic per-tensor amax of at most this many elements is reduced inside the quantize kernel by
# every program (one launch; the re-reads hit L2); above it, a separate partial-amax pass.
FUSED_AMAX_MAX_NUMEL = 1 << 16
MAX_PARTIALS = 1024  # partial maxima read by every quantize program: 4 KB
AMAX_BLOCK_M = 8
AMAX_BLOCK_K = 512


@triton.jit
def _row_amax(x_ptr, rows, row_ok, K, stride_xm, BLOCK_K: tl.constexpr):
    """Max of finite |x| over each of the rows (any count, a vector) -> fp32 vector."""
    acc = tl.zeros((rows.shape[0], BLOCK_K), tl.float32)
    row_off = rows.to(tl.int64)[:, None] * stride_xm
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        mask = row_ok[:, None] & (cols < K)[None, :]
        x = tl.load(x_ptr + row_off + cols[None, :], mask=mask, other=0.0)
        acc = tl.maximum(acc, finite_abs(x))
    return tl.max(acc, axis=1)


@triton.jit
def _rows_amax(x_ptr, row_begin, row_end, K, stride_xm, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Max of finite |x| over rows [row_begin, row_end) -> fp32 scalar."""
    acc = tl.zeros((BLOCK_M,), tl.float32)
    for r0 in range(row_begin, row_end, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M)
        acc = tl.maximum(acc, _row_amax(x_ptr, rows, rows < row_end, K, stride_xm, BLOCK_K))
    return tl.max(acc, axis=0)


@triton.jit
def _amax_partials_kernel(x_ptr, partials_ptr, M, K, rows_per_program, stride_xm,
                          BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    row_begin = tl.program_id(0) * rows_per_program
    row_end = tl.minimum(row_begin + rows_per_program, M)
    amax = _rows_amax(x_ptr, row_begin, row_end, K, stride_xm, BLOCK_M, BLOCK_K)
    tl.store(partials_ptr + tl.program_id(0), amax)


@triton.jit
def _row_g_kernel(x_ptr, g_ptr, M, K, stride_xm, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    amax = _row_amax(x_ptr, rows, row_ok, K, stride_xm, BLOCK_K)
    tl.store(g_ptr + rows, global_scale_from_amax(amax), mask=row_ok)


@triton.jit
def _quantize_kernel(
    # pointers
    x_ptr, data_ptr, scale_ptr, g_in_ptr, g_out_ptr, partials_ptr,
    # sizes
    M, K, num_partials, scale_rows_pad, scale_cols_pad,
    # strides (the quantize tile reads x by element pairs)
    stride_xm, stride_xm_pairs,
    # meta-parameters
    GLOBAL: tl.constexpr, WRITE_G: tl.constexpr, SWIZZLE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PARTIALS_BLOCK: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    # x as element pairs, (BLOCK_M, BLOCK_K / 16 blocks, 8 pairs) for the even and the odd
    # elements: block reductions and nibble packing then stay inside a thread. (Measured in the
    # sm_90 PTX: a (.., 16) tile reshaped and split into pairs cost three shared-memory round trips.)
    # Loaded as a 2-D (BLOCK_M, BLOCK_K / 2) tile, whose layout coalesces along K, then viewed
    # as blocks.
    block_cols = pid_k * (BLOCK_K // BLOCK) + tl.arange(0, BLOCK_K // BLOCK)
    pair_cols = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    pair_mask = row_ok[:, None] & (pair_cols < K // 2)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    even, odd = load_pairs(x_ptr, rows64 * stride_xm_pairs + pair_cols[None, :], pair_mask)
    even = tl.reshape(even, (BLOCK_M, BLOCK_K // BLOCK, BLOCK // 2))
    odd = tl.reshape(odd, (BLOCK_M, BLOCK_K // BLOCK, BLOCK // 2))

    # Global scale, as a (BLOCK_M, 1) column (per row) or a scalar.
    if GLOBAL == G_STATIC:
        g = tl.load(g_in_ptr)
    elif GLOBAL == G_STATIC_ROW:
        g = tl.load(g_in_ptr + rows, mask=row_ok, other=1.0)[:, None]
    elif GLOBAL == G_FUSED:
        g = global_scale_from_amax(_rows_amax(x_ptr, 0, M, K, stride_xm, BLOCK_M, BLOCK_K))
    else:
        offs = tl.arange(0, PARTIALS_BLOCK)
        partials = tl.load(partials_ptr + offs, mask=offs < num_partials, other=0.0)
        g = global_scale_from_amax(tl.max(partials, axis=0))
    if WRITE_G:
        if GLOBAL == G_STATIC_ROW:
            if pid_k == 0:
                tl.store(g_out_ptr + rows[:, None], g, mask=row_ok[:, None])
        elif (pid_m == 0) & (pid_k == 0):
            tl.store(g_out_ptr, g)

    # Block scales.
    a_even, a_odd = tl.abs(even), tl.abs(odd)
    block_amax = tl.max(tl.maximum(a_even, a_odd), axis=2)
    finite = ((a_even < float("inf")) & (a_odd < float("inf"))).to(tl.int32)  # NaN < inf: False
    block_finite = tl.min(finite, axis=2) == 1
    g = g + tl.zeros_like(block_amax)  # g per block, (BLOCK_M, BLOCK_K / 16); exact, NaN stays
    g_ok = (g > 0.0) & (g < float("inf"))
    bits = block_scale_bits(block_amax, block_finite & g_ok, g)
    scale = e4m3_bits_to_f32(bits)
    usable = (bits != 0) & (bits != 0x7F)
    recip = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), tl.where(usable, scale * g, 1.0))

    # Codes (zero and NaN blocks: all +0), two per byte, the even element in the low nibble.
    recip = recip[:, :, None]
    code_even = e2m1_encode(even * recip, even.to(tl.int32, bitcast=True))
    code_odd = e2m1_encode(odd * recip, odd.to(tl.int32, bitcast=True))
    packed = tl.where(usable[:, :, None], code_even | (code_odd << 4), 0).to(tl.uint8)
    packed = tl.reshape(packed, (BLOCK_M, BLOCK_K // 2))
    tl.store(data_ptr + rows64 * (K // 2) + pair_cols[None, :], packed, mask=pair_mask)

    # Scales: padding blocks (rows >= M or columns >= K/16) hold 0, never NaN.
    real = row_ok[:, None] & (block_cols < K // BLOCK)[None, :]
    bits = tl.where(real, bits, 0).to(tl.uint8)
    if SWIZZLE:
        offsets = swizzled_scale_offset(rows[:, None], block_cols[None, :], scale_cols_pad)
        in_pad = (rows < scale_rows_pad)[:, None] & (block_cols < scale_cols_pad)[None, :]
        tl.store(scale_ptr + offsets, bits, mask=in_pad)
    else:
        tl.store(scale_ptr + rows.to(tl.int64)[:, None] * (K // BLOCK) + block_cols[None, :], bits,
                 mask=real)


def quantize(x: torch.Tensor, global_scale: torch.Tensor | None, per_row: bool, swizzle: bool):
    """(..., K) float -> (data uint8 (..., K/2), scale bits uint8, g fp32 () or (...,)).

    Arguments are checked by the op; x may have any strides (copied only if its last dim is not
    contiguous, its rows cannot be addressed with one stride, or they do not start on a pair).
    """
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    pair_bytes = 2 * x2.element_size()
    if x2.stride(-1) != 1 or x2.stride(0) % 2 or x2.data_ptr() % pair_bytes:
        x2 = x2.contiguous()  # the kernel reads aligned element pairs
    m = x2.shape[0]
    cols = k // BLOCK_SIZE
    data = torch.empty((*lead, k // 2), dtype=torch.uint8, device=x.device)
    if swizzle:
        rows_pad, cols_pad = swizzled_shape(m, cols)
        scale = torch.empty((rows_pad, cols_pad), dtype=torch.uint8, device=x.device)
    else:
        rows_pad, cols_pad = m, cols
        scale = torch.empty((*lead, cols), dtype=torch.uint8, device=x.device)
    g_out = torch.empty(lead if per_row else (), dtype=torch.float32, device=x.device)
    partials = g_out  # placeholder pointer where unused
    num_partials = 1
    write_g = True
    if global_scale is not None:
        mode, g_in = (G_STATIC_ROW if per_row else G_STATIC), global_scale
    elif per_row:
        mode, g_in, write_g = G_STATIC_ROW, g_out, False
        if m:
            _row_g_kernel[(triton.cdiv(m, AMAX_BLOCK_M),)](
                x2, g_out, m, k, x2.stride(0), BLOCK_M=AMAX_BLOCK_M, BLOCK_K=AMAX_BLOCK_K)
    elif m * k <= FUSED_AMAX_MAX_NUMEL:
        mode, g_in = G_FUSED, g_out
    else:
        mode, g_in = G_PARTIALS, g_out
        num_partials = min(triton.cdiv(m, AMAX_BLOCK_M), MAX_PARTIALS)
        rows_per_program = triton.cdiv(triton.cdiv(m, num_partials), AMAX_BLOCK_M) * AMAX_BLOCK_M
        num_partials = triton.cdiv(m, rows_per_program)
        partials = torch.empty(num_partials, dtype=torch.float32, device=x.device)
        _amax_partials_kernel[(num_partials,)](
            x2, partials, m, k, rows_per_program, x2.stride(0),
            BLOCK_M=AMAX_BLOCK_M, BLOCK_K=AMAX_BLOCK_K)
    grid = (triton.cdiv(rows_pad, BLOCK_M), triton.cdiv(cols_pad * BLOCK_SIZE, BLOCK_K))
    if grid[0] == 0:  # no rows: only a per-tensor g is left to write
        if not per_row:
            grid = (1, 1)
        else:
            return data, scale, g_out
    _quantize_kernel[grid](
        x2, data, scale, g_in, g_out, partials,
        m, k, num_partials, rows_pad, cols_pad,
        x2.stride(0), x2.stride(0) // 2,
        GLOBAL=mode, WRITE_G=write_g, SWIZZLE=swizzle,
        BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, PARTIALS_BLOCK=triton.next_power_of_2(num_partials),
        num_warps=NUM_WARPS,
    )
    return data, scale, g_out
