"""Fused NVFP4 quantize: global amax -> global scale -> e4m3 block scales -> packed E2M1 codes,
scales written plain or straight into the swizzled 128x4-tile layout (padding zeroed).

x is viewed as (M, K) rows (last dim contiguous, any even row stride). Outputs:
    data  (M, K/2) uint8         data[m, j] = code[m, 2j] | code[m, 2j + 1] << 4
    scale (M, K/16) uint8 bits, or swizzled (ceil(M/128)*128, ceil(K/64)*4) with padding 0
    g     () or (M,) fp32        written by the kernel itself (no extra copy launch)
or, with VALUES (quantize_values), instead of data and scale:
    values (M, K) bf16           e2m1(code) * block scale, the quantized x without its global
                                 scale (exact in bf16: at most 6 significant bits, 2^-10..2688),
                                 decoded from the codes by the skinny GEMM's word decode

Global scale modes (GLOBAL):
    G_STATIC      one given g (per tensor)                                     1 launch
    G_STATIC_ROW  given g per row, or per-row g just computed by _row_g_kernel
    G_FUSED       dynamic per tensor, decode-sized x (padded to powers of two, at most
                  FUSED_AMAX_MAX_TILE elements): every program reduces all of x in one load
                  (it is in L2)                                                1 launch
    G_PARTIALS    dynamic per tensor: amax_partials_kernel writes <= MAX_PARTIALS maxima, each
                  quantize program reduces those (4 KB, from L2)              2 launches
Nothing is read back to the host: capturable in a CUDA graph, no sync.

With NORM (rms_norm_quantize_values, G_FUSED only) x is h, and the kernel quantizes the values of
an RMSNorm of h instead (reference.rms_norm: per row rsqrt(mean(h^2) + eps), the weight before or
after the rounding to h's dtype): every program normalizes all of h for the amax, as G_FUSED
reduces x, then its own tile. One launch instead of a norm kernel and a quantize kernel.

The quantize tile is (BLOCK_M rows, BLOCK_K / 16 blocks, 8 element pairs): one thread owns whole
blocks, so block reductions and nibble packing never leave its registers. It is memory-bound only
if the element path is short: an H200 issues about 40 instructions per element at its copy
bandwidth for bf16 -> NVFP4 (2.56 bytes per element), so the encode works on bits (see device/common.py).
"""

import torch
import triton
import triton.language as tl

from nvfp4_inductor import capability
from nvfp4_inductor.format import BLOCK_SIZE
from nvfp4_inductor.kernels.device.common import (
    BLOCK,
    FP4_MAX,
    FP4_MAX_TINY,
    FP8_NAN,
    SWIZZLE_ROWS,
    block_scale_bits,
    check_swizzled_offsets,
    e2m1_pack_pair,
    e4m3_bits_to_f32,
    finite_abs,
    finite_amax_words,
    global_scale_from_amax,
    half_pair_words,
    round_to,
    load_pair_words,
    pair_sign_bits,
    reciprocal_operands,
    split_pair_words,
    max_propagate_nan,
    scale_offsets,
    swizzled_scale_offset,
)
from nvfp4_inductor.kernels.device.mainloops import decode_tile
from nvfp4_inductor.reference import rms_norm, swizzled_shape

G_STATIC: tl.constexpr = tl.constexpr(0)
G_STATIC_ROW: tl.constexpr = tl.constexpr(1)
G_FUSED: tl.constexpr = tl.constexpr(2)
G_PARTIALS: tl.constexpr = tl.constexpr(3)

# NORM: what x is normalized by first (reference.rms_norm)
NORM_NONE: tl.constexpr = tl.constexpr(0)
NORM_RMS: tl.constexpr = tl.constexpr(1)  # no weight
NORM_RMS_WEIGHT: tl.constexpr = tl.constexpr(2)  # (h * r * w).to(dtype)
NORM_RMS_WEIGHT_AFTER_CAST: tl.constexpr = tl.constexpr(3)  # w * (h * r).to(dtype), rounded again
# The smallest fp32 magnitudes that round to Inf in bf16 (0x7F7F8000) and fp16
_BF16_INF_FROM: tl.constexpr = tl.constexpr(3.39617752923046e38)
_FP16_INF_FROM: tl.constexpr = tl.constexpr(65520.0)

# Quantize tiles (BLOCK_M, BLOCK_K, num_warps). BLOCK_K is a multiple of 64 so that one column of
# K-tiles covers whole swizzled scale column groups (4 blocks of 16); BLOCK_M divides 128.
# Large x: 2 blocks per thread; (16, 256, 4) was the best of the tiles swept on 16384x8192 bf16
# (benchmarks/bench_quantize.py; docs/decisions.md).
# Decode-sized x: one block per thread, one row per tile, so no thread works on masked-off rows
# (a 32-row tile at M = 1 took several times an empty kernel's time: docs/decisions.md).
LARGE_TILE = (16, 256, 4)
SMALL_M = 16
# A dynamic per-tensor amax over x padded to at most this many elements (next powers of two of M
# and K) is reduced inside the quantize kernel by every program, in one load (one launch instead of
# two); larger x takes the partial-amax pass: above this size every program's read of all of x
# costs more than the second launch (docs/decisions.md).
FUSED_AMAX_MAX_TILE = 16384
MAX_PARTIALS = 1024  # partial maxima read by every quantize program: 4 KB
MAX_GRID_Y = 65535  # CUDA's limit on a grid's second and third dimensions
AMAX_TILE = (16, 512)  # (rows, columns) per step of the partial-amax kernels, 4 warps
# The quantize and partial-amax kernels launch with programmatic dependent launch on sm_90+ (see
# _quantize_kernel).


# The norm's tile (rms_norm_quantize_values, rows <= SMALL_M): every program first normalizes all of
# h with 4 warps, then quantizes BLOCK_K columns. 512 was the fastest of 512-2048 at 1 x 4096
# (docs/decisions.md).
NORM_BLOCK_K = 512


def _tile(m: int, k: int) -> tuple[int, int, int]:
    if m > SMALL_M:
        return LARGE_TILE
    block_m = triton.next_power_of_2(max(m, 1))
    block_k = max(64, min(triton.next_power_of_2(k), 2048 // block_m))  # <= 128 blocks a tile
    num_warps = max(1, min(4, block_m * block_k // (BLOCK_SIZE * 32)))
    return block_m, block_k, num_warps


@triton.jit
def _tile_abs(x_ptr, row0, col0, M, K, stride_xm, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """|x| of the tile at (row0, col0) as fp32, non-finite and out-of-bounds elements as 0."""
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = col0 + tl.arange(0, BLOCK_K)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
    return finite_abs(x)


@triton.jit
def amax_partials_kernel(x_ptr, partials_ptr, M, K, stride_xm, num_programs,
                          BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    """Program p: max of finite |x| over tiles p, p + P, p + 2P, ... (grid-stride). The running
    max stays a tile (one max per element, no cross-warp reduction inside the loop). PDL: as the
    quantize kernel (which follows it)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    tiles_k = tl.cdiv(K, BLOCK_K)
    num_tiles = tl.cdiv(M, BLOCK_M) * tiles_k
    acc = tl.zeros((BLOCK_M, BLOCK_K), tl.float32)
    for t in range(tl.program_id(0), num_tiles, num_programs):
        acc = tl.maximum(acc, _tile_abs(x_ptr, (t // tiles_k) * BLOCK_M, (t % tiles_k) * BLOCK_K,
                                        M, K, stride_xm, BLOCK_M, BLOCK_K))
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(partials_ptr + tl.program_id(0), tl.max(tl.max(acc, axis=1), axis=0))


@triton.jit
def _row_g_kernel(x_ptr, g_ptr, M, K, stride_xm, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Per-row dynamic global scale: g[m] from the max of finite |x[m, :]|."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_K), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        acc = tl.maximum(acc, _tile_abs(x_ptr, tl.program_id(0) * BLOCK_M, k0, M, K, stride_xm,
                                        BLOCK_M, BLOCK_K))
    tl.store(g_ptr + rows, global_scale_from_amax(tl.max(acc, axis=1)), mask=rows < M)


@triton.jit
def _rms_normalized(h, rstd, w, NORM: tl.constexpr, DTYPE: tl.constexpr):
    """fp32 h, its rows' rsqrt(mean(h^2) + eps) and the fp32 weight, broadcastable -> the norm's
    output as fp32 values exact in DTYPE (reference.rms_norm's roundings)."""
    y = h * rstd
    if NORM == NORM_RMS_WEIGHT:
        y = y * w
    y = round_to(y, DTYPE)
    if NORM == NORM_RMS_WEIGHT_AFTER_CAST:
        y = round_to(w * y, DTYPE)
    return y


@triton.jit
def _rms_norm_g(h_ptr, w_ptr, eps, M, K, stride_hm, NORM: tl.constexpr, DTYPE: tl.constexpr,
                FUSED_M: tl.constexpr, FUSED_K: tl.constexpr):
    """All of h (at most FUSED_M x FUSED_K, from L2) -> (rstd per row (FUSED_M,), the global scale
    of the normalized h: g from the max of its finite |values|). Rounding is monotonic, so that max
    is the rounding of the largest |value| that rounds to a finite one: one rounding, not one per
    element (the weight after the cast still needs the inner one)."""
    rows = tl.arange(0, FUSED_M)
    cols = tl.arange(0, FUSED_K)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    h = tl.load(h_ptr + rows.to(tl.int64)[:, None] * stride_hm + cols[None, :], mask=mask,
                other=0.0).to(tl.float32)
    w = 1.0
    if NORM != NORM_RMS:  # loaded in h's 2-D layout (every row the same): no layout conversion
        w = tl.load(w_ptr + 0 * rows[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    # Inductor's mean and rsqrt (the interpreter's are numpy's 1 / sqrt, as the CPU reference).
    # One row: a scalar, which every layout broadcasts without a shared-memory round trip.
    if FUSED_M == 1:
        rstd = tl.math.rsqrt(tl.sum(tl.sum(h * h, axis=1), axis=0) / K + eps)
        v = h * rstd
    else:
        rstd = tl.math.rsqrt(tl.sum(h * h, axis=1) / K + eps)
        v = h * rstd[:, None]
    if NORM == NORM_RMS_WEIGHT:
        v = v * w
    elif NORM == NORM_RMS_WEIGHT_AFTER_CAST:
        v = w * round_to(v, DTYPE)
    # |v| at or above the overflow threshold rounds to Inf in DTYPE (NaN fails the test too)
    a = tl.abs(v)
    a = tl.where(a < (_BF16_INF_FROM if DTYPE == tl.bfloat16 else _FP16_INF_FROM), a, 0.0)
    amax = round_to(tl.max(tl.max(a, axis=1), axis=0), DTYPE)
    return rstd, global_scale_from_amax(amax)


@triton.jit
def _tile_weight_pairs(w_ptr, tile_k, K, NORM: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    """The norm's weight at column tile tile_k's (even, odd) columns as fp32 (BLOCK_M, BLOCK_K / 2),
    loaded as pair words in the layout of the tile's own (1 without a weight)."""
    w_even = 1.0
    w_odd = 1.0
    if NORM != NORM_RMS:
        words = _load_pair_tile(w_ptr, 0, tile_k, BLOCK_M, K, 0, BLOCK_M, BLOCK_K)
        w_even, w_odd = split_pair_words(words, w_ptr.dtype.element_ty)
    return w_even, w_odd


@triton.jit
def _rms_normalized_words(words, rstd, w_even, w_odd, NORM: tl.constexpr, DTYPE: tl.constexpr,
                          ONE_ROW: tl.constexpr):
    """A loaded tile of h's pair words (all rows: one row of tiles) -> the pair words of its
    normalized values. rstd: a scalar with ONE_ROW, else per row."""
    even, odd = split_pair_words(words, DTYPE)
    if not ONE_ROW:
        rstd = rstd[:, None]
    even = _rms_normalized(even, rstd, w_even, NORM, DTYPE)
    odd = _rms_normalized(odd, rstd, w_odd, NORM, DTYPE)
    return half_pair_words(even, odd, DTYPE)


@triton.jit
def _load_pair_tile(x_ptr, tile_m, tile_k, M, K, stride_xm_pairs,
                    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Tile (tile_m, tile_k) as raw pair words, (BLOCK_M, BLOCK_K / 2), a layout that coalesces
    along K. A tile past the end loads nothing."""
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair_cols = tile_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    mask = (rows < M)[:, None] & (pair_cols < K // 2)[None, :]
    return load_pair_words(x_ptr, rows.to(tl.int64)[:, None] * stride_xm_pairs + pair_cols[None, :],
                           mask)


@triton.jit
def quantize_pairs(words, g, DTYPE: tl.constexpr, USE_ASM: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    """A tile's pair words (BLOCK_M, BLOCK_K / 2) and g (scalar or (BLOCK_M, 1)) -> (int32
    (BLOCK_M, BLOCK_K / 16, 8) whose low bytes are the packed code pairs, int32 e4m3 bits
    (BLOCK_M, BLOCK_K / 16)): the reference's element step. The pairs are viewed as (BLOCK_M,
    BLOCK_K / 16 blocks, 8 pairs) so that one thread owns whole blocks. (Measured in the sm_90 PTX:
    a (.., 16) tile reshaped and split into pairs cost three shared-memory round trips; a tile
    loaded as 3-D did not coalesce.)"""
    even, odd = split_pair_words(words, DTYPE)
    even = tl.reshape(even, (BLOCK_M, BLOCK_K // BLOCK, BLOCK // 2))
    odd = tl.reshape(odd, (BLOCK_M, BLOCK_K // BLOCK, BLOCK // 2))
    # Block scales. The NaN-keeping max makes block_amax non-finite exactly when the block holds a
    # NaN or an Inf, so one max per element also does the finiteness check.
    block_amax = tl.reduce(tl.maximum(tl.abs(even), tl.abs(odd), propagate_nan=tl.PropagateNan.ALL),
                           2, max_propagate_nan)
    g = g + tl.zeros_like(block_amax)  # g per block, (BLOCK_M, BLOCK_K / 16); exact, NaN stays
    block_ok = (block_amax < float("inf")) & (g > 0.0) & (g < float("inf"))  # NaN: False
    bits = block_scale_bits(block_amax, block_ok, g, USE_ASM)
    usable = (bits != 0) & (bits != FP8_NAN)
    k, g_k = reciprocal_operands(g)
    scale_g = tl.where(usable, e4m3_bits_to_f32(bits, USE_ASM) * g_k, 1.0)
    recip = tl.math.div_rn(tl.full(scale_g.shape, 1.0, tl.float32), scale_g)[:, :, None]
    # The reference's y = (x k) r is encoded as x r in units of 1 / k (exact: no multiply per element).
    cap = tl.where(usable, tl.where(k == 1.0, FP4_MAX, FP4_MAX_TINY), 0.0)[:, :, None]

    # Codes (zero and NaN blocks: all +0), two per byte, the even element in the low nibble.
    signs = tl.reshape(pair_sign_bits(words, DTYPE), (BLOCK_M, BLOCK_K // BLOCK, BLOCK // 2))
    packed = e2m1_pack_pair(even * recip, odd * recip, signs, cap, tl.where(usable, 0x88, 0)[:, :, None],
                            k[:, :, None])
    return packed, bits


@triton.jit
def _quantize_tile(
    words, g, tile_m, tile_k, data_ptr, scale_ptr, M, K, scale_rows_pad, scale_cols_pad,
    DTYPE: tl.constexpr, SWIZZLE: tl.constexpr, VALUES: tl.constexpr, USE_ASM: tl.constexpr,
    OPERAND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Quantize one loaded tile of pair words with global scale g (scalar or (BLOCK_M, 1)); store
    codes and scales."""
    packed, bits = quantize_pairs(words, g, DTYPE, USE_ASM, BLOCK_M, BLOCK_K)
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    rows64 = rows.to(tl.int64)[:, None]
    if VALUES:  # the codes decoded with their block scale (NaN for a NaN block) by the GEMM's decode
        values = decode_tile(packed.to(tl.uint8), bits, USE_ASM, OPERAND, BLOCK_M, BLOCK_K)
        cols = tile_k * BLOCK_K + tl.arange(0, BLOCK_K)
        tl.store(data_ptr + rows64 * K + cols[None, :], (values * 128.0).to(tl.bfloat16),  # 2^-7 undone
                 mask=row_ok[:, None] & (cols < K)[None, :])
    else:
        packed = tl.reshape(packed.to(tl.uint8), (BLOCK_M, BLOCK_K // 2))
        pair_cols = tile_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
        tl.store(data_ptr + rows64 * (K // 2) + pair_cols[None, :], packed,
                 mask=row_ok[:, None] & (pair_cols < K // 2)[None, :])

        # Scales: padding blocks (rows >= M or columns >= K/16) hold 0, never NaN.
        block_cols = tile_k * (BLOCK_K // BLOCK) + tl.arange(0, BLOCK_K // BLOCK)
        real = row_ok[:, None] & (block_cols < K // BLOCK)[None, :]
        bits = tl.where(real, bits, 0).to(tl.uint8)
        if SWIZZLE:  # the padding inside the stored tiles is written too
            mask = (rows < scale_rows_pad)[:, None] & (block_cols < scale_cols_pad)[None, :]
        else:
            mask = real
        offsets = scale_offsets(rows[:, None], block_cols[None, :], K, scale_cols_pad, SWIZZLE)
        tl.store(scale_ptr + offsets, bits, mask=mask)


@triton.jit
def _quantize_kernel(
    # pointers (w_ptr: the norm's weight)
    x_ptr, data_ptr, scale_ptr, g_in_ptr, g_out_ptr, partials_ptr, w_ptr,
    # sizes
    M, K, num_partials, scale_rows_pad, scale_cols_pad,
    # strides (the quantize tile reads x by element pairs)
    stride_xm, stride_xm_pairs,
    # the norm's epsilon
    eps,
    # meta-parameters
    GLOBAL: tl.constexpr, WRITE_G: tl.constexpr, SWIZZLE: tl.constexpr, VALUES: tl.constexpr,
    USE_ASM: tl.constexpr, OPERAND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    FUSED_M: tl.constexpr, FUSED_K: tl.constexpr, PARTIALS_BLOCK: tl.constexpr,
    NORM: tl.constexpr = NORM_NONE, PDL: tl.constexpr = False,
):
    """Program (k, m, m_hi) quantizes tile (row tile m + m_hi * grid rows, column tile k): a grid
    with the tile's coordinates, not a flat tile index, which cost each thread an integer division
    (the kernel is issue-bound). (A persistent variant that keeps the next one or two tiles'
    loads in flight is no faster: the SMs' issue rate, not memory latency, is the limit, and its
    register moves cost more; docs/decisions.md.)

    PDL (launched with programmatic dependent launch, sm_90): the program waits for the previous
    kernel before it reads or writes anything, and lets the next kernel launch once its loads are
    issued (that kernel waits for this one's completion before it reads what this one writes)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    tile_k = tl.program_id(0)
    tile_m = tl.program_id(1) + tl.program_id(2) * tl.num_programs(1)
    dynamic: tl.constexpr = GLOBAL == G_FUSED or GLOBAL == G_PARTIALS
    if dynamic:
        # The tile's own loads first, issued with the amax's: after the amax's cross-warp
        # reduction they would be a second wait for memory. A static g keeps its order (loads
        # moved before the g load measured slower; docs/decisions.md).
        words = _load_pair_tile(x_ptr, tile_m, tile_k, M, K, stride_xm_pairs, BLOCK_M, BLOCK_K)
    if GLOBAL == G_STATIC:
        g = tl.load(g_in_ptr)
    elif GLOBAL == G_STATIC_ROW:
        rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
        g = tl.load(g_in_ptr + rows, mask=rows < M, other=1.0)[:, None]
    elif GLOBAL == G_FUSED and NORM != NORM_NONE:
        w_even, w_odd = _tile_weight_pairs(w_ptr, tile_k, K, NORM, BLOCK_M, BLOCK_K)  # with the tile's loads
        rstd, g = _rms_norm_g(x_ptr, w_ptr, eps, M, K, stride_xm, NORM, x_ptr.dtype.element_ty,
                              FUSED_M, FUSED_K)
        words = _rms_normalized_words(words, rstd, w_even, w_odd, NORM, x_ptr.dtype.element_ty,
                                      FUSED_M == 1)
    elif GLOBAL == G_FUSED:
        all_words = _load_pair_tile(x_ptr, 0, 0, M, K, stride_xm_pairs, FUSED_M, FUSED_K)
        g = global_scale_from_amax(finite_amax_words(all_words, x_ptr.dtype.element_ty, USE_ASM))
    else:
        offs = tl.arange(0, PARTIALS_BLOCK)
        partials = tl.load(partials_ptr + offs, mask=offs < num_partials, other=0.0)
        g = global_scale_from_amax(tl.max(partials, axis=0))
    if WRITE_G:
        if GLOBAL == G_STATIC_ROW:
            if tile_k == 0:
                tl.store(g_out_ptr + rows[:, None], g, mask=(rows < M)[:, None])
        elif (tile_m == 0) & (tile_k == 0):
            tl.store(g_out_ptr, g)

    if not dynamic:
        words = _load_pair_tile(x_ptr, tile_m, tile_k, M, K, stride_xm_pairs, BLOCK_M, BLOCK_K)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    _quantize_tile(words, g, tile_m, tile_k, data_ptr, scale_ptr, M, K, scale_rows_pad,
                   scale_cols_pad, x_ptr.dtype.element_ty, SWIZZLE, VALUES, USE_ASM, OPERAND, BLOCK_M,
                   BLOCK_K)
    if SWIZZLE:
        # The last row of tiles also zeroes the swizzled padding rows [M, rows_pad) of its block
        # columns (< 128 rows): no programs are launched for rows that hold no data, which at
        # M = 1 would be 64x the real work.
        # Four columns of one row are 4 contiguous bytes there: zeroed as one 32-bit word.
        if tile_m == tl.cdiv(M, BLOCK_M) - 1:
            pad_rows = M + tl.arange(0, SWIZZLE_ROWS)
            col_groups = tile_k * (BLOCK_K // BLOCK // 4) + tl.arange(0, BLOCK_K // BLOCK // 4)
            offsets = swizzled_scale_offset(pad_rows[:, None], col_groups[None, :] * 4, scale_cols_pad)
            mask = (pad_rows < scale_rows_pad)[:, None] & (col_groups * 4 < scale_cols_pad)[None, :]
            tl.store(scale_ptr.to(tl.pointer_type(tl.int32)) + offsets // 4,
                     tl.zeros((SWIZZLE_ROWS, BLOCK_K // BLOCK // 4), tl.int32), mask=mask)


def _pair_aligned(t: torch.Tensor) -> torch.Tensor:
    """t as the kernels read it, by aligned element pairs: last dim contiguous, rows (2-D) an even
    number of elements apart, starting on a pair; otherwise a copy (clone: .contiguous() would
    return a contiguous t that starts off a pair as it is)."""
    if (t.stride(-1) != 1 or (t.dim() > 1 and t.stride(0) % 2)
            or t.data_ptr() % (2 * t.element_size())):
        t = t.clone(memory_format=torch.contiguous_format)
    return t


def fits_fused_amax(m: int, k: int) -> bool:
    return triton.next_power_of_2(max(m, 1)) * triton.next_power_of_2(k) <= FUSED_AMAX_MAX_TILE


def rms_norm_quantize_values(h: torch.Tensor, weight: torch.Tensor | None, eps: float,
                             weight_after_cast: bool):
    """-> (values bf16, g fp32 ()) of reference.rms_norm(h, ...) quantized (nvfp4::
    rms_norm_quantize_values). Decode-sized h (the fused-amax bound) in one launch; larger h,
    where every program normalizing all of h would cost more than it saves, as the norm in torch
    ops and quantize_values' kernels."""
    k = h.shape[-1]
    if not fits_fused_amax(h.numel() // k, k):
        values, _, g = quantize(rms_norm(h, weight, eps, weight_after_cast), None, False, False,
                                values=True)
        return values, g
    if weight is None:
        norm = NORM_RMS
    else:
        norm = NORM_RMS_WEIGHT_AFTER_CAST if weight_after_cast else NORM_RMS_WEIGHT
        weight = _pair_aligned(weight)
    values, _, g = quantize(h, None, False, False, values=True, norm=(norm, weight, eps))
    return values, g


def quantize(x: torch.Tensor, global_scale: torch.Tensor | None, per_row: bool, swizzle: bool,
             values: bool = False, norm: tuple = (NORM_NONE, None, 0.0)):
    """(..., K) float -> (data uint8 (..., K/2), scale bits uint8, g fp32 () or (...,)); with
    values, (values bf16 (..., K), None, g) instead: e2m1 * block scale (see the module docstring).
    norm: (NORM mode, weight or None, eps): x is h of an RMSNorm whose output is quantized (values
    with a dynamic per-tensor scale, decode-sized x only; rms_norm_quantize_values).

    Arguments are checked by the op; x may have any strides (copied only if its last dim is not
    contiguous, its rows cannot be addressed with one stride, or they do not start on a pair).
    """
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = _pair_aligned(x.reshape(-1, k))
    m = x2.shape[0]
    cols = k // BLOCK_SIZE
    if values:
        data = torch.empty((*lead, k), dtype=torch.bfloat16, device=x.device)
    else:
        data = torch.empty((*lead, k // 2), dtype=torch.uint8, device=x.device)
    if swizzle:
        rows_pad, cols_pad = swizzled_shape(m, cols)
        check_swizzled_offsets("x", rows_pad, cols_pad)
        scale = torch.empty((rows_pad, cols_pad), dtype=torch.uint8, device=x.device)
    else:
        rows_pad, cols_pad = m, cols
        scale = torch.empty((*lead, 0 if values else cols), dtype=torch.uint8, device=x.device)
    g_out = torch.empty(lead if per_row else (), dtype=torch.float32, device=x.device)
    partials = g_out  # placeholder pointer where unused
    num_partials = 1
    write_g = True
    amax_m, amax_k = AMAX_TILE
    sm90 = capability.sm90_or_later(x.device)
    pdl = sm90
    if global_scale is not None:  # per row: read as a contiguous list of the rows' scales
        mode, g_in = (G_STATIC_ROW if per_row else G_STATIC), global_scale.contiguous()
    elif per_row:
        mode, g_in, write_g = G_STATIC_ROW, g_out, False
        if m:
            _row_g_kernel[(triton.cdiv(m, amax_m),)](
                x2, g_out, m, k, x2.stride(0), BLOCK_M=amax_m, BLOCK_K=amax_k)
    elif fits_fused_amax(m, k):
        mode, g_in = G_FUSED, g_out
    else:
        mode, g_in = G_PARTIALS, g_out
        num_partials = min(triton.cdiv(m, amax_m) * triton.cdiv(k, amax_k), MAX_PARTIALS)
        partials = torch.empty(num_partials, dtype=torch.float32, device=x.device)
        amax_partials_kernel[(num_partials,)](
            x2, partials, m, k, x2.stride(0), num_partials, BLOCK_M=amax_m, BLOCK_K=amax_k,
            PDL=pdl, launch_pdl=pdl)
    norm_mode, norm_weight, eps = norm
    block_m, block_k, num_warps = _tile(m, k)
    if norm_mode != NORM_NONE:
        block_k, num_warps = min(block_k, NORM_BLOCK_K), 4
    # the norm needs every row of x in each tile (its rows' rsqrt) and the fused amax
    assert norm_mode == NORM_NONE or (values and mode == G_FUSED and block_m >= m), (norm_mode, mode)
    tiles_k = triton.cdiv(cols_pad * BLOCK_SIZE, block_k)
    tiles_m = triton.cdiv(m, block_m)  # swizzled padding rows: see the kernel
    if tiles_m * tiles_k == 0 and per_row:  # no rows, no scale to write
        return data, scale, g_out
    # No tile: one program still writes a per-tensor g. Row tiles beyond the grid's second
    # dimension (65535) go to its third.
    tiles_m = max(tiles_m, 1)
    grid = (max(tiles_k, 1), min(tiles_m, MAX_GRID_Y), triton.cdiv(tiles_m, MAX_GRID_Y))
    _quantize_kernel[grid](
        x2, data, scale, g_in, g_out, partials, x2 if norm_weight is None else norm_weight,
        m, k, num_partials, rows_pad, cols_pad,
        x2.stride(0), x2.stride(0) // 2, eps,
        GLOBAL=mode, WRITE_G=write_g, SWIZZLE=swizzle, VALUES=values,
        # inline PTX (values: the skinny GEMM's word decode; the fused amax's max.s16x2); the
        # interpreter runs none (it decodes in fp16, exact)
        USE_ASM=sm90, OPERAND=tl.bfloat16 if x.is_cuda else tl.float16,
        BLOCK_M=block_m, BLOCK_K=block_k,
        FUSED_M=triton.next_power_of_2(max(m, 1)), FUSED_K=triton.next_power_of_2(k),
        PARTIALS_BLOCK=triton.next_power_of_2(num_partials), NORM=norm_mode, num_warps=num_warps,
        # inside a compiled graph with PDL (the backend's CUDA graphs) the previous kernel's tail
        # and this launch overlap, and the next (the GEMM template) loads its weights meanwhile
        PDL=pdl, launch_pdl=pdl,
    )
    return data, None if values else scale, g_out
