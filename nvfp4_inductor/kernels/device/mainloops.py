"""The GEMM mainloops of the NVFP4 linears and the dispatch among them (`mainloop`): each returns
fp32 (BLOCK_N, BLOCK_M) = 2^-7 * (W . x^T) over a range of K-steps, block scales applied, global
scale not (device/epilogue.py multiplies by 2^7 * g). Called by the split-K kernel
(kernels/gemm_splitk.py), the grouped kernel (kernels/grouped.py) and the Inductor template.

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

Without inline PTX (the Triton interpreter) `_decode_bytes` builds the same values in fp32 with
plain Triton ops and the products run in fp32 (the interpreter has no bf16 dot; fp16 operands would
turn a bf16 x above 65504 into inf and one below 2^-24 into 0), so CPU tests check the indexing
and the numerics.
"""


import triton
import triton.language as tl

from nvfp4_inductor.kernels.device.common import (
    BLOCK, FP8_NAN, LAYOUT_SWIZZLED, LAYOUT_TILED, TILED_K, TILED_N, e2m1_decode, scale_offsets,
    tiled_places_to_rows, tiled_row_at, tiled_scale_offset, tiled_scales_by_place,
)
from nvfp4_inductor.kernels.device.mma import mma_mainloop

# The MAINLOOP meta-parameter (launchers translate the plan's name with MAINLOOPS): tl.dot on
# decoded tiles, the register-fed mma.sync (device/mma.py), wgmma with x's tile first (sm_90), or
# the block-scaled MMA on both operands' codes (sm_100).
MAINLOOP_DOT: tl.constexpr = tl.constexpr(0)
MAINLOOP_MMA: tl.constexpr = tl.constexpr(1)
MAINLOOP_WGMMA: tl.constexpr = tl.constexpr(2)
MAINLOOP_DOT_SCALED: tl.constexpr = tl.constexpr(3)
MAINLOOPS = {"dot": 0, "mma": 1, "wgmma": 2, "dot_scaled": 3}

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
def dot_mainloop(
    x_ptr, w_ptr, w_scale_ptr, M, N, K, stride_xm, w_scale_cols, pid_n, tile_begin,
    tile_end, LAYOUT: tl.constexpr, USE_ASM: tl.constexpr, OPERAND: tl.constexpr, EVEN: tl.constexpr,
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
        if LAYOUT == LAYOUT_TILED:  # tile_weight's layout: each (BLOCK_N, BLOCK_K) tile is one contiguous run
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
            if LAYOUT == LAYOUT_SWIZZLED:
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
    if LAYOUT == LAYOUT_TILED:
        acc = tiled_places_to_rows(acc)
    return acc


@triton.jit
def wgmma_mainloop(x_ptr, w_ptr, w_scale_ptr, M, K, stride_xm, pid_n, step_begin, step_end,
                   USE_ASM: tl.constexpr, OPERAND: tl.constexpr, EVEN: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Serving batch sizes on sm_90 (tiled W, plan.WGMMA_MIN_M..WGMMA_MAX_M rows): fp32 (TILE_N, BLOCK_M) =
    2^-7 * (W . x^T) over the K-steps [step_begin, step_end) of BLOCK_K, block scales applied,
    global scale not (dot_mainloop's contract). x's (BLOCK_M, BLOCK_K) tile is the MMA's first
    operand (BLOCK_M >= 64: wgmma on 4 warps), the decoded weight step its second; a step is
    BLOCK_K / TILE_K whole tiles of the tiled layout, one contiguous run of codes and one of scale
    bytes, loaded in storage order and rearranged in registers (rows by place, as dot_mainloop
    reads them, cost more: docs/gemm.md). EVEN: K % BLOCK_K == 0 (else the last step's missing
    tiles and x's columns past K load as zeros)."""
    R: tl.constexpr = BLOCK_K // TILED_K
    CODES: tl.constexpr = TILED_N * TILED_K // 2  # code bytes a tile
    SCALES: tl.constexpr = TILED_N * TILED_K // BLOCK  # scale bytes a tile
    tiles_k = tl.cdiv(K, TILED_K)
    codes = tl.arange(0, R * CODES)
    scales = tl.arange(0, R * SCALES)
    w_row = w_ptr + pid_n.to(tl.int64) * tiles_k * CODES  # the pid_n-th row of tiles
    s_row = w_scale_ptr + pid_n.to(tl.int64) * tiles_k * SCALES
    ms = tl.arange(0, BLOCK_M)
    m_ok = ms < M
    x_rows = x_ptr + ms.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, TILED_N), tl.float32)
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
        packed = tl.reshape(tl.permute(tl.reshape(packed, (R, TILED_N, TILED_K // 2)), (1, 0, 2)),
                            (TILED_N, BLOCK_K // BLOCK, BLOCK // 2))
        s_bits = tl.reshape(tl.permute(tl.reshape(s_bits, (R, 2, 8, 4, 4)), (1, 4, 2, 0, 3)),
                            (TILED_N, BLOCK_K // BLOCK))
        w = decode_tile(packed, s_bits, USE_ASM, OPERAND, TILED_N, BLOCK_K)
        acc = tl.dot(x.to(OPERAND), tl.trans(w), acc)
    return tl.trans(acc)


@triton.jit
def load_tile_group(w_ptr, w_scale_ptr, N, K, pid_n, t, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The (BLOCK_N, BLOCK_K) weight block (pid_n, t) from the tiled layout, a group of
    (BLOCK_N / TILE_N) x (BLOCK_K / TILE_K) tiles -> packed codes (BLOCK_N, BLOCK_K / 2) and scale
    bits (BLOCK_N, BLOCK_K / 16), zeros past N and K:
        W[row a * TILE_N + r, byte b * TILE_K / 2 + c] = tile (tn0 + a, tk0 + b), row r, byte c."""
    a = tl.arange(0, BLOCK_N // TILED_N)[:, None, None, None]
    r = tl.arange(0, TILED_N)[None, :, None, None]
    b = tl.arange(0, BLOCK_K // TILED_K)[None, None, :, None]
    tn = pid_n * (BLOCK_N // TILED_N) + a
    tk = t * (BLOCK_K // TILED_K) + b
    tile = tn.to(tl.int64) * tl.cdiv(K, TILED_K) + tk  # tile after tile
    ok = (tn < tl.cdiv(N, TILED_N)) & (tk < tl.cdiv(K, TILED_K))
    c = tl.arange(0, TILED_K // 2)[None, None, None, :]
    w = tl.reshape(tl.load(w_ptr + (tile * TILED_N + r) * (TILED_K // 2) + c, mask=ok, other=0),
                   (BLOCK_N, BLOCK_K // 2))
    c = tl.arange(0, TILED_K // BLOCK)[None, None, None, :]
    w_bits = tl.load(w_scale_ptr + tile * (TILED_N * TILED_K // BLOCK) + tiled_scale_offset(r, c), mask=ok,
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
def mainloop(
    x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, M, N, K, stride_xm, w_scale_cols, pid_n, tile_begin, tile_end,
    MAINLOOP: tl.constexpr, LAYOUT: tl.constexpr, USE_ASM: tl.constexpr, OPERAND: tl.constexpr,
    EVEN: tl.constexpr, REG_MMA: tl.constexpr, PDL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """fp32 (BLOCK_N, BLOCK_M) = 2^-7 * (W . x^T) (W . x^T for MAINLOOP_DOT_SCALED) over the K-steps
    [tile_begin, tile_end) of weight tile row pid_n, x's first M rows at x_ptr (x_scale_ptr: x's
    scale bits, MAINLOOP_DOT_SCALED only). EVEN: no masks along K (and, row-major W, along N).
    REG_MMA: blocks of 8 x rows of the register-fed mainloop. PDL (launched with programmatic
    dependent launch): 1, wait for the previous kernel before any load; 2, the register-fed mainloop
    loads the first tile's weights (constants) before that wait."""
    if PDL and MAINLOOP != MAINLOOP_MMA:
        tl.extra.cuda.gdc_wait()
    if MAINLOOP == MAINLOOP_DOT_SCALED:
        acc = dot_scaled_mainloop(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, M, N, K, stride_xm, pid_n,
                                  tile_begin, tile_end, BLOCK_M, BLOCK_N, BLOCK_K)
    elif MAINLOOP == MAINLOOP_WGMMA:
        acc = wgmma_mainloop(x_ptr, w_ptr, w_scale_ptr, M, K, stride_xm, pid_n, tile_begin, tile_end, USE_ASM,
                             OPERAND, EVEN, BLOCK_M, BLOCK_K)
    elif MAINLOOP == MAINLOOP_MMA:
        acc = mma_mainloop(x_ptr, w_ptr, w_scale_ptr, M, K, stride_xm, pid_n, tile_begin, tile_end, REG_MMA,
                           EVEN, PDL, N, w_scale_cols, LAYOUT)
    else:
        acc = dot_mainloop(x_ptr, w_ptr, w_scale_ptr, M, N, K, stride_xm, w_scale_cols, pid_n, tile_begin,
                           tile_end, LAYOUT, USE_ASM, OPERAND, EVEN, BLOCK_M, BLOCK_N, BLOCK_K)
    return acc
