"""Skinny NVFP4 GEMM for small M (decode) on sm_90 and up: y = x @ W^T, W NVFP4 (N, K/2) + e4m3
scales, x (M <= 64, K) bf16.

At small M the GEMM is a weight stream: every weight byte is read once and used M times, so the
kernel must decode weights at HBM speed, about 8 instructions per weight byte on an H200 (its issue
rate over its HBM bandwidth).

1. Word-level decode (`_decode_words`, inline PTX, pack=4): one instance gets 4 packed bytes in a
   32-bit register. A byte permute spreads two of them 16 bits apart ([b0, 0, b1, 0]); then one
   shift/and per field places each nibble's magnitude at bf16 bits 6..8 and its sign at bit 15:
   bf16 bits (i << 6) are exactly e2m1(i) * 2^-126 for all 8 magnitudes (index 1 is the bf16
   subnormal 2^-127). The outputs are elementwise per byte (low nibble = element 2j, high nibble =
   element 2j + 1): Triton packs 4 registers of its own layout into an instance, not necessarily 4
   consecutive bytes, so nothing may depend on which bytes share an instance.
2. Exact scaling: one mul.bf16x2 by bf16(s * 2^119) gives e2m1 * s * 2^-7, exact (at most 6
   significant bits, 2^-17 <= |value| <= 6 * 448 * 2^-7 = 21). s * 2^119 comes from the e4m3 bits
   cheaply (`_operand_scale`): fp16 bits (e4m3 << 7) are exactly s * 2^-8, normal and subnormal
   alike. The 2^7 goes back in the fp32 epilogue with the global scale.
3. Swapped operands and split K: the decoded weights are the wide operand (BLOCK_N rows, in
   registers), x^T the narrow one (BLOCK_M columns, M padded to 16, read straight from memory by
   the software pipeline); two warps make Triton use mma.sync. K is cut into ranges so that about
   8 programs per SM stream the weight; each writes fp32 partials, and the last of an output
   tile's splits to finish (an atomic counter, `last_split`) sums them and runs the epilogue
   (global scales, bias, output dtype): one kernel a call.
4. Weights in the row-major interchange layout, or (TILED) in nvfp4_inductor.reference.tiled's layout,
   where each (BLOCK_N, BLOCK_K) tile is one contiguous run (row-major is L1-bound: docs/gemm.md).
5. W4A4 runs this kernel on x's quantized values (nvfp4.quantize_values: e2m1 * s_x, exact in
   bf16), both global scales in the epilogue's g; decoding x's codes in every program instead is
   slower (docs/gemm.md).
6. sm_100 (DOT_SCALED, tiled W and NVFP4 x): `dot_scaled_mainloop` hands both packed operands and
   their e4m3 scales to tl.dot_scaled (tcgen05 block-scaled MMA, 128 x 128 weight steps); compiled
   for sm_100 in CI, not run (no Blackwell machine).
The Inductor template (inductor/templates/nvfp4_tiled_gemm.py.jinja) calls the same mainloops.

Without inline PTX (the Triton interpreter) `_decode_bytes` builds the same values in fp32 with
plain Triton ops and the products run in fp32 (the interpreter has no bf16 dot; fp16 operands would
turn a bf16 x above 65504 into inf and one below 2^-24 into 0), so CPU tests check the indexing
and the numerics.
"""

import functools
import threading
from typing import NamedTuple

import torch
import triton
import triton.language as tl

try:
    from triton import knobs  # the launch hooks a direct launch passes on, as Triton's own launches do
except ImportError:
    knobs = None

from nvfp4_inductor import capability
from nvfp4_inductor.format import BLOCK_SIZE
from nvfp4_inductor.kernels import gemm_configs, plan
from nvfp4_inductor.kernels import gemm_mma
from nvfp4_inductor.kernels._common import (
    BLOCK, FP8_NAN, check_swizzled_offsets, e2m1_decode, round_to, scale_offsets, tiled_places_to_rows, tiled_row_at,
    tiled_scale_offset, tiled_scales_by_place,
)
from nvfp4_inductor.kernels.gemm_mma import mma_mainloop
from nvfp4_inductor.reference.tiled import TILE_K, TILE_N

# $4: 4 packed bytes b0..b3; $5, $6: bf16x2 block scales; $0, $1: low nibbles of (b0, b1), (b2, b3);
# $2, $3: their high nibbles (see 1. and 2. above).
_DECODE_ASM: tl.constexpr = tl.constexpr("""
{
.reg .b32 v, m, s;
prmt.b32 v, $4, 0, 0x7170;
shl.b32 m, v, 6; and.b32 m, m, 0x01C001C0; shl.b32 s, v, 12; and.b32 s, s, 0x80008000;
or.b32 m, m, s; mul.rn.bf16x2 $0, m, $5;
shl.b32 m, v, 2; and.b32 m, m, 0x01C001C0; shl.b32 s, v, 8; and.b32 s, s, 0x80008000;
or.b32 m, m, s; mul.rn.bf16x2 $2, m, $5;
prmt.b32 v, $4, 0, 0x7372;
shl.b32 m, v, 6; and.b32 m, m, 0x01C001C0; shl.b32 s, v, 12; and.b32 s, s, 0x80008000;
or.b32 m, m, s; mul.rn.bf16x2 $1, m, $6;
shl.b32 m, v, 2; and.b32 m, m, 0x01C001C0; shl.b32 s, v, 8; and.b32 s, s, 0x80008000;
or.b32 m, m, s; mul.rn.bf16x2 $3, m, $6;
}
""")

_TILE_N: tl.constexpr = tl.constexpr(TILE_N)
_TILE_K: tl.constexpr = tl.constexpr(TILE_K)
_GROUP: tl.constexpr = tl.constexpr(gemm_mma.GROUP)  # K-tiles a grouped scale word covers
_SCALE_BIAS: tl.constexpr = tl.constexpr(2.0**127)  # s * 2^-8 -> s * 2^119; codes carry 2^-126


@triton.jit
def _operand_scale(bits, OPERAND: tl.constexpr):
    """int32 e4m3 bits (0..0xFF) -> the block scale factor of the decode, as OPERAND: bf16
    s * 2^119 (for the word decode, whose codes carry 2^-126) or fp32 s * 2^-7 (the byte decode);
    NaN for 0x7F and 0xFF, bit 7 the sign (as float8_e4m3fn: a checkpoint's scale byte may hold
    them). fp16 bits (magnitude << 7 | sign << 15) are exactly s * 2^-8, normal and subnormal
    e4m3 alike: a few instructions a scale instead of ~15 for a general e4m3 decode."""
    magnitude = bits & 0x7F
    s = ((magnitude << 7) | ((bits & 0x80) << 8)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    if OPERAND == tl.bfloat16:
        s = s * _SCALE_BIAS
    else:
        s = s * 2.0
    return tl.where(magnitude == FP8_NAN, float("nan"), s).to(OPERAND)


@triton.jit
def _decode_words(packed, scale):
    """uint8 packed codes, bf16 s * 2^119 (same shape) -> bf16 (low, high) nibble values
    e2m1 * s * 2^-7, exact (inline PTX, 4 bytes per instance)."""
    return tl.inline_asm_elementwise(
        _DECODE_ASM, "=r,=r,=r,=r,r,r,r", [packed, scale],
        dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4,
    )


@triton.jit
def _decode_bytes(packed, scale):
    """The same values from plain Triton ops, one byte at a time (the interpreter's path):
    packed codes, fp32 s * 2^-7 -> fp32 (low, high) nibble values e2m1 * s * 2^-7, exact."""
    b = packed.to(tl.int32)
    low = e2m1_decode(b & 0xF) * scale
    high = e2m1_decode(b >> 4) * scale
    return low, high


@triton.jit
def decode_tile(packed, s_bits, USE_ASM: tl.constexpr, OPERAND: tl.constexpr, ROWS: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """Packed codes (ROWS, BLOCK_K / 16, 8) + their blocks' e4m3 bits (ROWS, BLOCK_K / 16) ->
    OPERAND (ROWS, BLOCK_K) in natural K order: e2m1 * s * 2^-7, exact."""
    scale = tl.broadcast_to(_operand_scale(s_bits.to(tl.int32), OPERAND)[:, :, None],
                            (ROWS, BLOCK_K // BLOCK, BLOCK // 2))
    if USE_ASM:
        low, high = _decode_words(packed, scale)
    else:
        low, high = _decode_bytes(packed, scale)
    return tl.reshape(tl.join(low, high), (ROWS, BLOCK_K))


@triton.jit
def splitk_mainloop(
    x_ptr, w_ptr, w_scale_ptr, M, N, K, stride_xm, w_scale_cols, pid_n, tile_begin,
    tile_end, SWIZZLED: tl.constexpr, USE_ASM: tl.constexpr, OPERAND: tl.constexpr,
    EVEN: tl.constexpr, TILED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """fp32 (BLOCK_N, BLOCK_M) = 2^-7 * (W . x^T) over the K-tiles [tile_begin, tile_end), block
    scales applied, global scale not (the epilogue multiplies by 2^7 * g). x is read as OPERAND."""
    cols_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = cols_n < N
    ms = tl.arange(0, BLOCK_M)
    m_ok = ms < M
    x_rows = x_ptr + ms.to(tl.int64)[None, :] * stride_xm
    k_pad = tl.cdiv(K, BLOCK_K) * BLOCK_K
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    for t in range(tile_begin, tile_end):
        k0 = t * BLOCK_K
        # Packed codes as (BLOCK_N, blocks, 8 bytes), one e4m3 scale per block broadcast over its
        # bytes; the decoded (low, high) nibbles are joined and viewed as the 2-D (BLOCK_N, BLOCK_K)
        # tile in natural K order.
        block_cols = t * (BLOCK_K // BLOCK) + tl.arange(0, BLOCK_K // BLOCK)
        if TILED:  # tile_weight's layout: each (BLOCK_N, BLOCK_K) tile is one contiguous run
            tile = pid_n.to(tl.int64) * (k_pad // BLOCK_K) + t
            # The tile's rows taken in the order of its scales (tiled_row_at), so that the scales
            # load whole and only swap within 16-byte groups, inside a thread; acc's rows go back
            # to tile order once, after the loop. (Permuting the scales to tile order every K-step,
            # or gathering them byte by byte, is slower: docs/decisions.md.)
            rows = tiled_row_at(tl.arange(0, BLOCK_N))
            packed = tl.load(w_ptr + tile * (BLOCK_N * BLOCK_K // 2) + rows[:, None] * (BLOCK_K // 2)
                             + tl.arange(0, BLOCK_K // 2)[None, :])
            packed = tl.reshape(packed, (BLOCK_N, BLOCK_K // BLOCK, BLOCK // 2))
            s_bits = tiled_scales_by_place(tl.load(w_scale_ptr + tile * (BLOCK_N * BLOCK_K // BLOCK)
                                                   + tl.arange(0, BLOCK_N * BLOCK_K // BLOCK)))
        else:
            if SWIZZLED:
                s_ptrs = w_scale_ptr + scale_offsets(cols_n[:, None], block_cols[None, :], K,
                                                     w_scale_cols, True)
            else:
                # Row stride passed as an argument (JIT-specialized when divisible by 16), so the
                # BLOCK_K / 16 scales of a row are one aligned vector load the software pipeline
                # prefetches; byte loads were not pipelined and stalled every iteration.
                s_ptrs = w_scale_ptr + cols_n.to(tl.int64)[:, None] * w_scale_cols + block_cols[None, :]
            byte3 = (block_cols * (BLOCK // 2))[None, :, None] + tl.arange(0, BLOCK // 2)[None, None, :]
            w_ptrs = w_ptr + cols_n.to(tl.int64)[:, None, None] * (K // 2) + byte3
            if EVEN:  # N % BLOCK_N == 0 and K % BLOCK_K == 0: no masks (~1 instruction a byte)
                s_bits = tl.load(s_ptrs)
                packed = tl.load(w_ptrs)
            else:
                s_bits = tl.load(s_ptrs, mask=n_ok[:, None] & (block_cols < K // BLOCK)[None, :],
                                 other=0)
                packed = tl.load(w_ptrs, mask=n_ok[:, None, None] & (byte3 < K // 2), other=0)
        w = decode_tile(packed, s_bits, USE_ASM, OPERAND, BLOCK_N, BLOCK_K)
        ks = k0 + tl.arange(0, BLOCK_K)
        if EVEN:
            x = tl.load(x_rows + ks[:, None], mask=m_ok[None, :], other=0.0)
        else:
            x = tl.load(x_rows + ks[:, None], mask=(ks < K)[:, None] & m_ok[None, :], other=0.0)
        acc = tl.dot(w, x.to(OPERAND), acc)
    if TILED:
        acc = tiled_places_to_rows(acc)
    return acc


@triton.jit
def wgmma_mainloop(x_ptr, w_ptr, w_scale_ptr, M, K, stride_xm, pid_n, step_begin, step_end,
                   USE_ASM: tl.constexpr, OPERAND: tl.constexpr, EVEN: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Serving batch sizes on sm_90 (tiled W, plan.WGMMA_MIN_M..WGMMA_MAX_M rows): fp32 (TILE_N, BLOCK_M) =
    2^-7 * (W . x^T) over the K-steps [step_begin, step_end) of BLOCK_K, block scales applied,
    global scale not (splitk_mainloop's contract). x's (BLOCK_M, BLOCK_K) tile is the MMA's first
    operand (BLOCK_M >= 64: wgmma on 4 warps), the decoded weight step its second; a step is
    BLOCK_K / TILE_K whole tiles of the tiled layout, one contiguous run of codes and one of scale
    bytes, loaded in storage order and rearranged in registers (rows by place, as splitk_mainloop
    reads them, cost more: docs/gemm.md). EVEN: K % BLOCK_K == 0 (else the last step's missing
    tiles and x's columns past K load as zeros)."""
    R: tl.constexpr = BLOCK_K // _TILE_K
    CODES: tl.constexpr = _TILE_N * _TILE_K // 2  # code bytes a tile
    SCALES: tl.constexpr = _TILE_N * _TILE_K // BLOCK  # scale bytes a tile
    tiles_k = tl.cdiv(K, _TILE_K)
    codes = tl.arange(0, R * CODES)
    scales = tl.arange(0, R * SCALES)
    w_row = w_ptr + pid_n.to(tl.int64) * tiles_k * CODES  # the pid_n-th row of tiles
    s_row = w_scale_ptr + pid_n.to(tl.int64) * tiles_k * SCALES
    ms = tl.arange(0, BLOCK_M)
    m_ok = ms < M
    x_rows = x_ptr + ms.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, _TILE_N), tl.float32)
    for t in range(step_begin, step_end):
        ks = t * BLOCK_K + tl.arange(0, BLOCK_K)
        if EVEN:
            packed = tl.load(w_row + t * (R * CODES) + codes)
            s_bits = tl.load(s_row + t * (R * SCALES) + scales)
            x = tl.load(x_rows + ks[None, :], mask=m_ok[:, None], other=0.0)
        else:  # past the row's last tile lies the next row of tiles: masked
            packed = tl.load(w_row + t * (R * CODES) + codes, mask=t * R + codes // CODES < tiles_k, other=0)
            s_bits = tl.load(s_row + t * (R * SCALES) + scales, mask=t * R + scales // SCALES < tiles_k,
                             other=0)
            x = tl.load(x_rows + ks[None, :], mask=m_ok[:, None] & (ks < K)[None, :], other=0.0)
        # codes (tile b, row r, byte c) -> (r, block 4b + c // 8, c % 8); scale byte
        # 128u + 16g + 4c + j of tile b (tiled.scale_index: row 32u + 8j + g, block c) -> (row, 4b + c)
        packed = tl.reshape(tl.permute(tl.reshape(packed, (R, _TILE_N, _TILE_K // 2)), (1, 0, 2)),
                            (_TILE_N, BLOCK_K // BLOCK, BLOCK // 2))
        s_bits = tl.reshape(tl.permute(tl.reshape(s_bits, (R, 2, 8, 4, 4)), (1, 4, 2, 0, 3)),
                            (_TILE_N, BLOCK_K // BLOCK))
        w = decode_tile(packed, s_bits, USE_ASM, OPERAND, _TILE_N, BLOCK_K)
        acc = tl.dot(x.to(OPERAND), tl.trans(w), acc)
    return tl.trans(acc)


@triton.jit
def load_tile_group(w_ptr, w_scale_ptr, N, K, pid_n, t, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The (BLOCK_N, BLOCK_K) weight block (pid_n, t) from the tiled layout, a group of
    (BLOCK_N / TILE_N) x (BLOCK_K / TILE_K) tiles -> packed codes (BLOCK_N, BLOCK_K / 2) and scale
    bits (BLOCK_N, BLOCK_K / 16), zeros past N and K:
        W[row a * TILE_N + r, byte b * TILE_K / 2 + c] = tile (tn0 + a, tk0 + b), row r, byte c."""
    a = tl.arange(0, BLOCK_N // _TILE_N)[:, None, None, None]
    r = tl.arange(0, _TILE_N)[None, :, None, None]
    b = tl.arange(0, BLOCK_K // _TILE_K)[None, None, :, None]
    tn = pid_n * (BLOCK_N // _TILE_N) + a
    tk = t * (BLOCK_K // _TILE_K) + b
    tile = tn.to(tl.int64) * tl.cdiv(K, _TILE_K) + tk  # tile after tile
    ok = (tn < tl.cdiv(N, _TILE_N)) & (tk < tl.cdiv(K, _TILE_K))
    c = tl.arange(0, _TILE_K // 2)[None, None, None, :]
    w = tl.reshape(tl.load(w_ptr + (tile * _TILE_N + r) * (_TILE_K // 2) + c, mask=ok, other=0),
                   (BLOCK_N, BLOCK_K // 2))
    c = tl.arange(0, _TILE_K // BLOCK)[None, None, None, :]
    w_bits = tl.load(w_scale_ptr + tile * (_TILE_N * _TILE_K // BLOCK) + tiled_scale_offset(r, c), mask=ok,
                     other=0)
    return w, tl.reshape(w_bits, (BLOCK_N, BLOCK_K // BLOCK))


@triton.jit
def dot_scaled_mainloop(
    x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, M, N, K, stride_xm, pid_n, tile_begin, tile_end,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """sm_100: fp32 (BLOCK_N, BLOCK_M) = W . x^T over the K-steps [tile_begin, tile_end) of
    BLOCK_K, both operands NVFP4 (x: codes (M, K/2), row stride stride_xm bytes, + plain scale
    bits (M, K/16)), block scales applied by the tensor core: tl.dot_scaled -> tcgen05.mma
    kind::mxf4nvf4.block_scale, which needs 128 x 128 weight steps (BLOCK_M >= 16). W is in the
    tiled layout, read a group of tiles per step (load_tile_group)."""
    ms = tl.arange(0, BLOCK_M)
    m_ok = ms < M
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    for t in range(tile_begin, tile_end):
        w, w_bits = load_tile_group(w_ptr, w_scale_ptr, N, K, pid_n, t, BLOCK_N, BLOCK_K)
        x_bytes = t * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
        x_t = tl.load(x_ptr + ms.to(tl.int64)[None, :] * stride_xm + x_bytes[:, None],
                      mask=m_ok[None, :] & (x_bytes < K // 2)[:, None], other=0)
        x_cols = t * (BLOCK_K // BLOCK) + tl.arange(0, BLOCK_K // BLOCK)
        x_bits = tl.load(x_scale_ptr + ms.to(tl.int64)[:, None] * (K // BLOCK) + x_cols[None, :],
                         mask=m_ok[:, None] & (x_cols < K // BLOCK)[None, :], other=0)
        acc = tl.dot_scaled(w, w_bits.to(tl.float8e4nv, bitcast=True), "e2m1",
                            x_t, x_bits.to(tl.float8e4nv, bitcast=True), "e2m1", acc)
    return acc


@triton.jit
def _epilogue(acc, ms, cols_n, M, N, w_global_scale_ptr, bias_ptr, out_ptr, stride_om,
              W_GLOBAL_SCALE_PER_ROW: tl.constexpr, HAS_BIAS: tl.constexpr, UNSCALE: tl.constexpr):
    """acc (BLOCK_N, BLOCK_M) fp32 sums of e2m1 * s * 2^-7 * x (x decoded from NVFP4: one more
    2^-7) -> out[m, n] = acc * UNSCALE * g + bias, UNSCALE = 2^7 (2^14)."""
    n_ok = cols_n < N
    if W_GLOBAL_SCALE_PER_ROW:
        g = tl.load(w_global_scale_ptr + cols_n, mask=n_ok, other=0.0)[:, None]
    else:
        g = tl.load(w_global_scale_ptr)
    y = acc * UNSCALE * g
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + cols_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    mask = n_ok[:, None] & (ms < M)[None, :]
    tl.store(out_ptr + ms.to(tl.int64)[None, :] * stride_om + cols_n[:, None],
             y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def last_split(counter_ptr, num_splits):
    """Called by each of an output tile's num_splits programs once its partials are stored: True in
    the last to arrive, which resets the tile's counter (zero again for the next launch) and may
    then read every split's partials. The barrier puts all the program's stores before its
    release; the acquire puts the other programs' stores before the last one's reads."""
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    last = arrived == num_splits - 1
    tl.store(counter_ptr, 0, mask=last)
    return last


@triton.jit
def silu_mul_halves(acc, g, OUT_DTYPE: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    """(BLOCK_N, ROWS) fp32 products of weight rows interleaved by 32 (gate rows, the same up rows,
    ...: tiled.interleave_halves) and their global scales (BLOCK_N,) -> (BLOCK_N / 2, ROWS) fp32
    silu(gate) * up as eager torch computes a gated MLP: each linear rounded to OUT_DTYPE, silu in
    fp32 rounded to it, the product (rounded by the caller's store)."""
    y = round_to(acc * g[:, None], OUT_DTYPE)
    y = tl.permute(tl.reshape(y, (BLOCK_N // 64, 2, 32, ROWS)), (0, 2, 3, 1))
    gate, up = tl.split(y)
    gate = tl.reshape(gate, (BLOCK_N // 2, ROWS))
    up = tl.reshape(up, (BLOCK_N // 2, ROWS))
    return round_to(gate / (1.0 + tl.exp(-gate)), OUT_DTYPE) * up


@triton.jit
def sum_splits(partial_ptr, num_splits, M, N, cols_n, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
               SPLITS: tl.constexpr):
    """(BLOCK_N, ROWS) fp32 = the sum over the splits of partials (num_splits, M, N) at columns
    cols_n, rows >= M zero, in split order. SPLITS partials a round, one memory round trip for up to
    SPLITS splits (gemm_configs.split_sum_tile); read through L2 (.cg: another SM wrote them). Each
    partial is loaded in acc's layout: a (SPLITS, BLOCK_N, ROWS) load summed over its first axis
    took shuffles across lanes."""
    ms = tl.arange(0, ROWS)
    mask = (cols_n < N)[:, None] & (ms < M)[None, :]
    tile = partial_ptr + ms[None, :].to(tl.int64) * N + cols_n[:, None]
    split_stride = tl.cast(M, tl.int64) * N
    acc = tl.zeros((BLOCK_N, ROWS), tl.float32)
    for s0 in range(0, num_splits, SPLITS):
        # SPLITS loads in acc's own layout, issued together: no sum across threads
        for j in tl.static_range(SPLITS):
            acc += tl.load(tile + (s0 + j) * split_stride, mask=mask & (s0 + j < num_splits), other=0.0,
                           cache_modifier=".cg")
    return acc


@triton.jit
def load_rows(h_ptr, rows, stride_hm, K, ROWS: tl.constexpr, SPAN: tl.constexpr):
    """fp32 (ROWS, SPAN): h's first `rows` rows whole (SPAN >= K; row stride stride_hm, unit
    column stride), zeros past them: one load, whose use the caller puts after its other loads
    (a deferred RMSNorm's input, nvfp4.linear_tiled's norm_h, in the template's last split)."""
    ms = tl.arange(0, ROWS)
    ks = tl.arange(0, SPAN)
    return tl.load(h_ptr + ms[:, None].to(tl.int64) * stride_hm + ks[None, :],
                   mask=(ms < rows)[:, None] & (ks < K)[None, :], other=0.0).to(tl.float32)


@triton.jit
def rms_factor(h_rows, K, eps):
    """(ROWS,) fp32 rsqrt(mean(h^2) + eps) of load_rows' rows of K columns (reference.rms_scale)."""
    return tl.math.rsqrt(tl.sum(h_rows * h_rows, axis=1) / K + eps)


@triton.jit
def split_tiles(pid_k, tiles_per_split, tiles):
    """The K-tiles [begin, end) of split pid_k: tiles_per_split each, the last split the rest."""
    tile_begin = pid_k * tiles_per_split
    return tile_begin, tl.minimum(tile_begin + tiles_per_split, tiles)


@triton.jit
def _splitk_kernel(
    # pointers
    x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, w_global_scale_ptr, bias_ptr, out_ptr, partial_ptr, counter_ptr,
    # sizes
    M, N, K, w_scale_cols, tiles_per_split,
    # strides
    stride_xm, stride_om,
    # meta-parameters
    SWIZZLED: tl.constexpr, W_GLOBAL_SCALE_PER_ROW: tl.constexpr, HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr, USE_ASM: tl.constexpr, OPERAND: tl.constexpr, EVEN: tl.constexpr,
    TILED: tl.constexpr, DOT_SCALED: tl.constexpr, REG_MMA: tl.constexpr, UNSCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SUM_ROWS: tl.constexpr, SUM_SPLITS: tl.constexpr, GROUPED: tl.constexpr = False,
    PDL: tl.constexpr = False, WGMMA: tl.constexpr = False,
):
    pid_k = tl.program_id(1)
    if WGMMA:  # blocks of rows first: a weight tile's programs run together (one read from HBM)
        pid_n = tl.program_id(2)
        m0 = tl.program_id(0) * BLOCK_M
    else:  # all rows in one program
        pid_n = tl.program_id(0)
        m0 = 0
    if GROUPED:  # row-major W with plain scales, K % 64 == 0: K-tiles counted by whole groups
        tiles = tl.cdiv(K, _GROUP * BLOCK_K) * _GROUP
    else:
        tiles = tl.cdiv(K, BLOCK_K)
    tile_begin, tile_end = split_tiles(pid_k, tiles_per_split, tiles)
    if PDL and REG_MMA == 0:
        tl.extra.cuda.gdc_wait()
    if DOT_SCALED:  # sm_100, W tiled and x NVFP4: the tensor core applies the block scales
        acc = dot_scaled_mainloop(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, M, N, K, stride_xm, pid_n,
                                  tile_begin, tile_end, BLOCK_M, BLOCK_N, BLOCK_K)
    elif WGMMA:  # sm_90, tiled W, serving batch sizes: x's tile as wgmma's first operand
        acc = wgmma_mainloop(x_ptr + m0.to(tl.int64) * stride_xm, w_ptr, w_scale_ptr, M - m0, K, stride_xm,
                             pid_n, tile_begin, tile_end, USE_ASM, OPERAND, EVEN, BLOCK_M, BLOCK_K)
    elif REG_MMA > 0:  # sm_90+, M <= 8 * REG_MMA <= 32: mma.sync on registers (gemm_mma.py)
        acc = mma_mainloop(x_ptr, w_ptr, w_scale_ptr, M, K, stride_xm, pid_n, tile_begin, tile_end,
                           REG_MMA, EVEN, 1 if PDL else 0, N, w_scale_cols,
                           0 if TILED else (2 if SWIZZLED else (3 if GROUPED else 1)))
    else:
        acc = splitk_mainloop(x_ptr, w_ptr, w_scale_ptr, M, N, K, stride_xm, w_scale_cols, pid_n,
                              tile_begin, tile_end, SWIZZLED, USE_ASM, OPERAND, EVEN, TILED,
                              BLOCK_M, BLOCK_N, BLOCK_K)
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
            _epilogue(total, tl.arange(0, SUM_ROWS), cols_n, M, N, w_global_scale_ptr, bias_ptr, out_ptr,
                      stride_om, W_GLOBAL_SCALE_PER_ROW, HAS_BIAS, UNSCALE)
    else:
        _epilogue(acc, ms, cols_n, M, N, w_global_scale_ptr, bias_ptr, out_ptr, stride_om,
                  W_GLOBAL_SCALE_PER_ROW, HAS_BIAS, UNSCALE)


# Split-K tile counters, zero between launches (the last split of a tile resets its counter). Eager
# launches share a buffer per (device, stream): on one stream they run in order, on two they could
# overlap. A launch captured in a CUDA graph keeps its counters for every replay, on whatever stream
# and beside whatever other graph, so it gets a slice of its own from a reserve zeroed before any
# capture (or, with none left or none made yet, before any eager call on the device, a zeroed tensor
# of its own: a fill node in the graph).
_counters: dict = {}
_retired: list = []  # eager buffers outgrown: kept, as kernels on their stream may still use them
_reserve: dict = {}  # device -> [zeroed int32 buffer, first slice not handed out]
_reserve_lock = threading.Lock()  # two threads may capture at once
# A device's reserve for captured launches: 4 MiB, 2340 launches of 448 tiles (N = 28672).
RESERVED_COUNTERS = 1 << 20
# Launched with programmatic dependent launch on sm_90+: every program waits for the previous kernel
# (griddepcontrol.wait) before any global load or store, so only the launch and the programs' set-up
# overlap that kernel's tail (releasing the next launch after the mainloop measured slower at M = 16:
# docs/decisions.md).


def _zeros_outside_graph_pools(numel: int, device) -> torch.Tensor:
    """torch.zeros(numel) int32 on device; on CUDA made by another thread and finished before it
    returns: a CUDA-graph tree's warm-up routes its own thread's allocations (torch 2.8 and
    later; its stream's before) to the graph's memory pool, which may hold only what the call
    returns ("Detected 1 tensor(s) in the cudagraph pool not tracked as outputs"). Called outside
    captures only, once a buffer."""
    if device.type != "cuda":
        return torch.zeros(numel, dtype=torch.int32, device=device)
    made = []

    def make():
        try:
            with torch.cuda.device(device):
                made.append(torch.zeros(numel, dtype=torch.int32, device=device))
                torch.cuda.current_stream(device).synchronize()
        except BaseException as error:  # re-raised in the caller's thread
            made.append(error)

    thread = threading.Thread(target=make)
    thread.start()
    thread.join()
    if isinstance(made[0], BaseException):
        raise made[0]
    return made[0]


def _capturing(device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def split_counters(device, tiles: int) -> torch.Tensor:
    """A zeroed int32 counter for each of `tiles` output tiles, left zeroed by the launch: the
    stream's shared buffer for an eager launch, a slice of its own for a launch being captured in a
    CUDA graph (see _counters above)."""
    if _capturing(device):
        reserve = _reserve.get(device)
        span = -(-tiles // 32) * 32  # slices on 128-byte boundaries: the JIT specializes on alignment
        with _reserve_lock:
            start = None if reserve is None or reserve[1] + span > reserve[0].numel() else reserve[1]
            if start is not None:
                reserve[1] = start + span
        if start is None:
            return torch.zeros(tiles, dtype=torch.int32, device=device)  # filled at every replay
        return reserve[0][start:start + tiles]
    if device not in _reserve:
        _reserve[device] = [_zeros_outside_graph_pools(RESERVED_COUNTERS, device), 0]
    stream = _current_stream(device.index) if device.type == "cuda" else 0
    key = (device, stream)
    counters = _counters.get(key)
    if counters is None or counters.numel() < tiles:
        if counters is not None:
            _retired.append(counters)  # made on another stream: its memory is not freed in order
        counters = _zeros_outside_graph_pools(max(tiles, 1024), device)
        _counters[key] = counters
    return counters


def mma_operands_fit(x, w_data, w_scale, tiled: bool) -> bool:
    """x's rows start on 4-byte boundaries (even row stride); W's codes on 8 bytes (row-major: every
    row), tiled scales on 4: the register-fed mainloop's word loads."""
    if tiled:
        w_ok = w_data.data_ptr() % 8 == 0 and w_scale.data_ptr() % 4 == 0
    else:
        w_ok = w_data.data_ptr() % 8 == 0 and w_data.stride(0) % 8 == 0
    return w_ok and x.stride(0) % 2 == 0 and x.data_ptr() % 4 == 0


# Direct launches of compiled split-K kernels, by set-up and the arguments' dtypes and alignments.
_launches: dict = {}
_KERNEL_DEFAULTS = {"GROUPED": False, "PDL": False, "WGMMA": False}


def _direct_launch_runs(compiled) -> bool:
    """Whether this Triton's compiled kernel launches as gemm_splitk calls it (as its own
    CompiledKernel.__getitem__ launcher does); otherwise every launch goes through the JIT function."""
    return knobs is not None and all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata",
                                                                    "launch_metadata"))


def _hook(hook):
    """A launch hook, or None for none (Triton 3.6 keeps its hooks in a chain that may be empty:
    then the launch metadata the hooks would read is not built either)."""
    calls = getattr(hook, "calls", None)
    return None if hook is None or (isinstance(calls, list) and not calls) else hook


class _Setup(NamedTuple):
    grid: tuple[int, int, int]  # (N tiles, K splits, 1); wgmma: (blocks of M rows, K splits, N tiles)
    tiles: int  # output tiles along N (the split sum's counters)
    splits: int
    tiles_per_split: int
    dot_scaled: bool
    meta: dict  # the kernel's meta-parameters and launch options, but for the per-call two

    def __hash__(self):
        return id(self)  # (one object per set-up: _launch_setup caches it)


@functools.lru_cache(maxsize=4096)
def _launch_setup(m: int, n: int, k: int, tiled: bool, swizzled: bool, x_format: str, mainloop, fits: bool,
                  codes_fit: bool, scale_cols_pad: int, scale_word_aligned: bool, device) -> _Setup:
    """Everything about a launch that its sizes, layout and alignments decide (gemm_splitk's
    arguments): the mainloop, the tile configuration, the split of K and the meta-parameters.
    Cached: an eager decode step asks the same question for every layer, at every step, and
    working it out costs more host time than the GEMM takes on the GPU."""
    code_bytes = 0 if codes_fit else plan.MMA_MAX_CODE_BYTES
    if mainloop is None:
        mainloop = plan.splitk_mainloop(m, tiled=tiled, x_format=x_format, device=device,
                                        mma_operands_fit=fits, code_bytes=code_bytes)
    elif mainloop == "mma" and not plan.mma_runs(m, tiled=tiled, device=device, mma_operands_fit=fits,
                                                 code_bytes=code_bytes):
        raise ValueError(f"the register-fed mainloop needs inline PTX (CUDA), at most {plan.MMA_MAX_M} rows "
                         f"of x, x rows at even element offsets, weight rows on 8-byte boundaries (tiled "
                         f"weights: codes on 8 bytes, scales on 4) and fewer than {plan.MMA_MAX_CODE_BYTES} "
                         f"tiled code bytes (int32 word offsets)")
    elif mainloop not in ("mma", "dot", "dot_scaled", "wgmma") or (mainloop == "dot_scaled") != (x_format == "nvfp4"):
        raise ValueError(f"mainloop {mainloop!r} does not multiply an x of format {x_format!r}")
    elif mainloop == "wgmma" and not tiled:
        raise ValueError("the wgmma mainloop reads tiled weights")
    reg_mma = mainloop == "mma"
    dot_scaled = mainloop == "dot_scaled"
    wgmma = mainloop == "wgmma"
    use_asm = device.type == "cuda"
    # row-major W, plain scales, K % 64 == 0, M <= 8: the register-fed mainloop reads a scale word
    # per 4 K-tiles (splits of whole groups of 4); measured slower at M = 16 (docs/decisions.md).
    grouped = bool(reg_mma and not tiled and not swizzled and m <= 8 and k % (4 * BLOCK_SIZE) == 0
                   and scale_word_aligned)
    num_sms = capability.sm_count(device)
    min_steps = None if reg_mma else gemm_configs.MIN_STEPS_PER_SPLIT  # (reg_mma: its own rule)
    if wgmma:
        config = gemm_configs.wgmma_config(m, n, k, num_sms)
    elif dot_scaled:
        config = gemm_configs.dot_scaled_splitk_config(m, n, k, num_sms, min_steps)
    else:
        config = gemm_configs.splitk_config(m, n, k, num_sms, tiled=tiled, min_steps=min_steps,
                                            reg_mma=reg_mma, grouped=grouped)
    block_m, block_n, block_k, splits, warps, stages = config
    reg_block_m = 8 * max(2, gemm_configs.reg_mma_blocks(m))
    if reg_mma and (block_m, block_n, block_k, warps) != (reg_block_m, TILE_N, TILE_K, gemm_mma.WARPS):
        raise ValueError(f"the register-fed mainloop runs {reg_block_m} x {TILE_N} x {TILE_K} tiles on "
                         f"{gemm_mma.WARPS} warps at M = {m}; got {config}")
    tile_group = ((2 * TILE_N, 2 * TILE_K) if dot_scaled else (TILE_N, gemm_configs.WGMMA_CONFIG[1]) if wgmma
                  else (TILE_N, TILE_K))
    if tiled and (block_n, block_k) != tile_group:
        raise ValueError(f"tiled weights need BLOCK_N, BLOCK_K = {tile_group}; got {block_n}, {block_k}")
    if grouped:
        splits, groups_per_split = gemm_configs.split_ranges(k, gemm_mma.GROUP * block_k, splits)
        tiles_per_split = gemm_mma.GROUP * groups_per_split
    else:
        splits, tiles_per_split = gemm_configs.split_ranges(k, block_k, splits)
    sum_rows, sum_splits = gemm_configs.split_sum_tile(m, splits, block_n, warps)
    pdl = use_asm and capability.sm90_or_later(device)
    meta = dict(
        SWIZZLED=swizzled, SPLIT=splits > 1, USE_ASM=use_asm,
        OPERAND=tl.bfloat16 if use_asm else tl.float32,
        EVEN=n % block_n == 0 and k % ((gemm_mma.GROUP if grouped else 1) * block_k) == 0,
        TILED=tiled, DOT_SCALED=dot_scaled,
        REG_MMA=gemm_configs.reg_mma_blocks(m) if reg_mma else 0,
        UNSCALE=1.0 if dot_scaled else 2.0**7, GROUPED=grouped,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SUM_ROWS=sum_rows, SUM_SPLITS=sum_splits,
        PDL=pdl, launch_pdl=pdl, WGMMA=wgmma,
        num_warps=warps, num_stages=stages,
    )
    m_blocks, tiles = triton.cdiv(m, block_m), triton.cdiv(n, block_n)
    if m_blocks > 1 and not (wgmma and splits == 1):
        raise ValueError(f"only the wgmma mainloop without split K takes blocks of rows: {m} rows, "
                         f"BLOCK_M = {block_m}, {splits} splits")
    grid = (m_blocks, splits, tiles) if wgmma else (tiles, splits, 1)
    return _Setup(grid, tiles, splits, tiles_per_split, dot_scaled, meta)


def _setup_for(x, w_data, w_scale, swizzled, tiled_n, x_format, mainloop):
    """-> (the cached _Setup of this launch, m, n, k, scale_cols_pad): gemm_splitk's arguments."""
    m, k = x.shape[0], x.shape[1] * (2 if x_format == "nvfp4" else 1)
    n = w_data.shape[0] if tiled_n is None else tiled_n
    tiled = tiled_n is not None
    fits = mma_operands_fit(x, w_data, w_scale, tiled)
    scale_cols_pad = w_scale.shape[1] if swizzled else k // BLOCK_SIZE
    setup = _launch_setup(m, n, k, tiled, swizzled, x_format, mainloop, fits, w_data.numel() < plan.MMA_MAX_CODE_BYTES,
                          scale_cols_pad, w_scale.data_ptr() % 4 == 0, x.device)
    return setup, m, n, k, scale_cols_pad


def _launch_key(setup, x, flags, args):
    """The key of a direct launch: the set-up and what Triton specializes the kernel on (the
    arguments' dtypes and 16-byte alignments, x's row stride and the two flags)."""
    return (setup, x.device.index, x.stride(0), *flags.values(),
            *((t.dtype, t.data_ptr() % 16 == 0) for t in args[:9] if t is not None))


def gemm_splitk(x, w_data, w_scale, w_global_scale, bias, out_dtype, swizzled, tiled_n=None, x_scale=None,
                mainloop=None):
    """x (M, K) (bf16 on the GPU: the word decode multiplies in bf16; under the interpreter in fp32),
    M <= 64 (plan.WGMMA_MAX_M with the wgmma mainloop); W NVFP4 (N, K/2) + uint8 scale bits + g
    (() or (N,)) -> (M, N) out_dtype.
    tiled_n: W is in the tiled layout of nvfp4_inductor.reference.tiled, with N = tiled_n rows. x_scale
    (sm_100, tiled W only): x is NVFP4 itself, codes (M, K/2) + these plain scale bits (M, K/16),
    for the block-scaled MMA; w_global_scale must then hold both global scales (W's times x's).
    Elsewhere W4A4 passes x's quantized values. mainloop: "mma", "dot", "dot_scaled" or "wgmma" (tiled W)
    (plan.splitk_mainloop's choice where None; a given one is checked against what it needs)."""
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
    setup, m, n, k, scale_cols_pad = _setup_for(x, w_data, w_scale, swizzled, tiled_n, x_format, mainloop)
    max_m = plan.WGMMA_MAX_M if setup.meta["WGMMA"] else plan.SPLITK_MAX_M_TILED
    if m > max_m:
        raise ValueError(f"the split-K NVFP4 GEMM takes at most {max_m} rows with this mainloop; got {m}")
    if setup.splits > 1:
        partial = torch.empty((setup.splits, m, n), dtype=torch.float32, device=x.device)
        counters = split_counters(x.device, setup.tiles)
    else:
        partial = counters = out
    args = (x, x_scale if setup.dot_scaled else x, w_data, w_scale, w_global_scale,
            bias if bias is not None else w_global_scale, out, partial, counters,
            m, n, k, scale_cols_pad, setup.tiles_per_split, x.stride(0), out.stride(0))
    flags = dict(W_GLOBAL_SCALE_PER_ROW=w_global_scale.dim() > 0, HAS_BIAS=bias is not None)
    if not x.is_cuda:
        _splitk_kernel[setup.grid](*args, **flags, **setup.meta)
        return out
    # The compiled kernel for this set-up and these arguments' dtypes and alignments (what Triton
    # specializes a kernel on), launched without Triton's per-call argument binding.
    key = _launch_key(setup, x, flags, args)
    launch = _launches.get(key)
    if launch is None:
        compiled = _splitk_kernel[setup.grid](*args, **flags, **setup.meta)
        if _direct_launch_runs(compiled):
            meta = {**flags, **setup.meta}
            _launches[key] = (compiled, tuple(meta.get(name, _KERNEL_DEFAULTS.get(name))
                                              for name in _splitk_kernel.arg_names[len(args):]))
        return out
    compiled, constexprs = launch
    _run(compiled, setup.grid, _current_stream(x.device.index), args + constexprs)
    return out


def _run(compiled, grid, stream, args):
    """Launch a compiled kernel as Triton's own launcher does, with its launch hooks (if any)."""
    enter, leave = _hook(knobs.runtime.launch_enter_hook), _hook(knobs.runtime.launch_exit_hook)
    metadata = None if enter is None else compiled.launch_metadata(grid, stream, *args)
    compiled.run(*grid, stream, compiled.function, compiled.packed_metadata, metadata, enter, leave, *args)


class BoundLaunch:
    """gemm_splitk bound to one W (tiled, with its global scale and bias; x a bf16 operand) and one
    form of x (shape, row stride, dtype, device, alignment): the set-up, the compiled kernel and
    every argument but x and the output decided once, the split partials and tile counters taken
    from buffers its stream keeps (stream order, and the kernel's wait for the previous one under
    programmatic dependent launch, keep launches on a stream from overlapping), so that a call
    costs one allocation and the launch. A call returns None where it cannot launch so (another
    current device, a CUDA graph being captured): then call gemm_splitk."""

    __slots__ = ("compiled", "grid", "device", "out_shape", "out_dtype", "partial_numel", "tiles", "weights",
                 "tail")

    def __call__(self, x):
        device = self.device
        if torch._C._cuda_getDevice() != device.index or torch._C._cuda_isCurrentStreamCapturing():
            return None
        stream = _current_stream(device.index)
        out = torch.empty(self.out_shape, dtype=self.out_dtype, device=device)
        if self.partial_numel:
            work = _stream_work.get((device.index, stream))
            if work is None or work[0].numel() < self.partial_numel or work[1].numel() < self.tiles:
                work = _grow_stream_work(device, stream, self.partial_numel, self.tiles)
            args = (x, x, *self.weights, out, work[0], work[1], *self.tail)
        else:
            args = (x, x, *self.weights, out, out, out, *self.tail)
        _run(self.compiled, self.grid, stream, args)
        return out


# (device index, stream) -> (fp32 split partials, tile counters) of BoundLaunch calls on it;
# outgrown partials are freed in stream order (made on that stream).
_stream_work: dict = {}


def _current_stream(index: int):
    return triton.runtime.driver.active.get_current_stream(index)


def _grow_stream_work(device, stream, partial_numel: int, tiles: int):
    work = _stream_work.get((device.index, stream))
    if work is None or work[0].numel() < partial_numel:
        partial = torch.empty(max(partial_numel, 1 << 16), dtype=torch.float32, device=device)
    else:
        partial = work[0]
    _stream_work[device.index, stream] = work = (partial, split_counters(device, tiles))
    return work


def bind_splitk(x, w_data, w_scale, w_global_scale, bias, out_dtype, tiled_n: int, out_shape) -> BoundLaunch | None:
    """A BoundLaunch of gemm_splitk(x, ..., tiled_n=tiled_n) for xs like x (CUDA, (M, K) bf16, unit
    K stride; W4A16 on tiled W, w_global_scale and bias contiguous), whose output is returned in
    out_shape (M * N elements); None if gemm_splitk has not launched it directly yet, or will not."""
    if not (x.is_cuda and x.dim() == 2 and x.dtype == torch.bfloat16 and x.stride(1) == 1
            and w_global_scale.is_contiguous() and (bias is None or bias.is_contiguous())):
        return None
    m, n = x.shape[0], tiled_n
    if not 0 < m <= plan.WGMMA_MAX_M or n == 0:
        return None
    setup, m, n, k, scale_cols_pad = _setup_for(x, w_data, w_scale, False, tiled_n, "bf16", None)
    if setup.dot_scaled:
        return None
    # the key's other tensors as gemm_splitk makes them (what it reads: dtypes, alignments)
    out = torch.empty((1,), dtype=out_dtype, device=x.device)
    partial, counters = ((torch.empty((1,), dtype=dtype, device=x.device) for dtype in (torch.float32, torch.int32))
                         if setup.splits > 1 else (out, out))
    weights = (w_data, w_scale, w_global_scale, bias if bias is not None else w_global_scale)
    flags = dict(W_GLOBAL_SCALE_PER_ROW=w_global_scale.dim() > 0, HAS_BIAS=bias is not None)
    launch = _launches.get(_launch_key(setup, x, flags, (x, x, *weights, out, partial, counters)))
    if launch is None:
        return None
    bound = BoundLaunch()
    bound.compiled, constexprs = launch
    bound.grid, bound.device, bound.out_shape, bound.out_dtype = setup.grid, x.device, tuple(out_shape), out_dtype
    bound.partial_numel = setup.splits * m * n if setup.splits > 1 else 0
    bound.tiles, bound.weights = setup.tiles, weights
    bound.tail = (m, n, k, scale_cols_pad, setup.tiles_per_split, x.stride(0), n, *constexprs)
    return bound
