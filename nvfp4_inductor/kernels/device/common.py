"""Triton helpers shared by every NVFP4 kernel: the format's rounding and layouts, bit-exact
with `nvfp4_inductor.reference` (the README's numerics contract and layouts).

Conversions are written with fp32 and integer bit operations: they cost a few instructions, round
exactly as the reference on any target, and also run right under the Triton interpreter (whose
fp32 -> float8e4nv cast was measured to mis-round, e.g. 126.5 -> 96). On the GPU (HW) the e4m3
ones take the hardware's conversions instead (below).

E4M3 (bias 7, 3 mantissa bits), from fp32 bits b (bias 127, 23 mantissa bits):
    normal (t >= 2^-6):  e4m3 = (b + 0x7FFFF + bit20(b) - (120 << 23)) >> 20   (RNE to 3 bits,
                         exponent rebiased by 127 - 7 = 120; a carry out of the mantissa bumps
                         the exponent, as it should)
    subnormal (t < 2^-6): e4m3 = rne(t * 2^9), an integer 0..8 (8 = 0x08 is 2^-6, the first normal)
E2M1 magnitude index of a = min(|y|, 6): min(rne(2a), rne(a) + 2, rne(a / 2) + 4). The values
    0, 0.5, 1, 1.5, 2, 3, 4, 6 are 0.5 apart up to 2, 1 apart up to 4, 2 apart up to 6, so
    f(a) = min(2a, a + 2, a / 2 + 4) maps them to their indices 0..7 and is linear between
    them: the nearest value is the nearest integer to f(a), a tie a tie, and an even index an
    even mantissa. rne is monotonic, so rne(f(a)) is the min of the three pieces rounded.
    rne(v) for 0 <= v < 2^22 is bits(v + 2^23) - bits(2^23): the fp32 add rounds to an integer,
    ties to even (a contracted fma(t, 2^k, 2^23) rounds the same, t * 2^k being exact), and
    rne(a) + 2 is one add of 2^23 + 2. Checked against a bit-level rounding on every fp32 in
    [0, 6].
With HW (sm_90 and later, not the interpreter) the e4m3 conversions are the hardware's
(cvt.rn.satfinite.e4m3x2.f32, cvt.rn.f16x2.e4m3x2, through Triton's float8e4nv casts): the same
numbers as the bit formulas, fewer instructions (tests/kernels/test_quantize.py checks both on every tie).
"""

import triton
import triton.language as tl

from nvfp4_inductor.format import (
    BLOCK_SIZE,
    E2M1_MAX,
    E4M3_MAX,
    E4M3_NAN_BITS,
    GLOBAL_SCALE_DIVISOR,
    SWIZZLE_ROW_GROUP,
    SWIZZLE_TILE_COLS,
    SWIZZLE_TILE_ROWS,
    TINY_GLOBAL_SCALE,
    TINY_SCALE_FACTOR,
)
from nvfp4_inductor.reference.tiled import TILE_K, TILE_N

BLOCK: tl.constexpr = tl.constexpr(BLOCK_SIZE)
FP4_MAX: tl.constexpr = tl.constexpr(E2M1_MAX)
FP8_MAX: tl.constexpr = tl.constexpr(E4M3_MAX)
FP8_NAN: tl.constexpr = tl.constexpr(E4M3_NAN_BITS)
G_DIVISOR: tl.constexpr = tl.constexpr(GLOBAL_SCALE_DIVISOR)
SWIZZLE_ROWS: tl.constexpr = tl.constexpr(SWIZZLE_TILE_ROWS)
SWIZZLE_COLS: tl.constexpr = tl.constexpr(SWIZZLE_TILE_COLS)
ROW_GROUP: tl.constexpr = tl.constexpr(SWIZZLE_ROW_GROUP)
SWIZZLE_BYTES: tl.constexpr = tl.constexpr(SWIZZLE_TILE_ROWS * SWIZZLE_TILE_COLS)
# the tiled weight layout's tile (reference/tiled.py): TILED_N rows by TILED_K values
TILED_N: tl.constexpr = tl.constexpr(TILE_N)
TILED_K: tl.constexpr = tl.constexpr(TILE_K)
_TINY_G: tl.constexpr = tl.constexpr(TINY_GLOBAL_SCALE)
_TINY_FACTOR: tl.constexpr = tl.constexpr(TINY_SCALE_FACTOR)
FP4_MAX_TINY: tl.constexpr = tl.constexpr(E2M1_MAX / TINY_SCALE_FACTOR)  # 6 in units of 1 / k

_E4M3_MIN_NORMAL: tl.constexpr = tl.constexpr(2.0**-6)
_E4M3_SUBNORMAL_STEPS: tl.constexpr = tl.constexpr(2.0**9)  # 1 / smallest subnormal
_RNE_MAGIC: tl.constexpr = tl.constexpr(2.0**23)
_RNE_MAGIC_BITS: tl.constexpr = tl.constexpr(0x4B000000)  # bits of 2^23
_RNE_MAGIC_PLUS_2: tl.constexpr = tl.constexpr(2.0**23 + 2)
_RNE_MAGIC_PLUS_4: tl.constexpr = tl.constexpr(2.0**23 + 4)


@triton.jit
def _rne_int(v):
    """fp32 0 <= v < 2^22 -> int32 round-half-even(v)."""
    return (v + _RNE_MAGIC).to(tl.int32, bitcast=True) - _RNE_MAGIC_BITS


@triton.jit
def finite_abs(x):
    """|x| as fp32, with NaN and +-Inf replaced by 0 (for the dynamic amax)."""
    a = tl.abs(x.to(tl.float32))
    return tl.where(a < float("inf"), a, 0.0)


@triton.jit
def _max_s16x2(a, b):
    """Combine function: max of each signed 16-bit half of two int32 words (sm_90)."""
    return tl.inline_asm_elementwise("max.s16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32,
                                     is_pure=True, pack=1)


@triton.jit
def finite_amax_words(words, DTYPE: tl.constexpr, USE_ASM: tl.constexpr):
    """Max of finite |x| (fp32 scalar; 0 if none) over a tile of pair words (load_pair_words).
    16-bit types on the bits: |x| bits plus a bias that lifts exactly the Inf / NaN magnitudes
    (bf16 >= 0x7F80, fp16 >= 0x7C00) to 0x8000 and above, a negative int16, so a signed max of the
    halves skips them: 3 instructions a word with USE_ASM (max.s16x2, sm_90), where the fp32 path
    takes about 4 an element. Finite magnitudes order as their bits; halves never carry."""
    if DTYPE == tl.float32:
        even, odd = split_pair_words(words, DTYPE)
        amax = tl.max(tl.maximum(finite_abs(even), finite_abs(odd)))
    else:
        bias: tl.constexpr = 0x0080 if DTYPE == tl.bfloat16 else 0x0400
        a = (words & 0x7FFF7FFF) + (bias | (bias << 16))
        if USE_ASM:  # 4 words a thread's 16-byte load: their halves' max in place, then one int32
            a = tl.reduce(tl.reshape(a, (a.numel // 4, 4)), 1, _max_s16x2)
        bits = tl.maximum(tl.max(tl.maximum(a >> 16, (a << 16) >> 16)) - bias, 0)
        if DTYPE == tl.bfloat16:
            amax = (bits << 16).to(tl.float32, bitcast=True)
        else:
            amax = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return amax


@triton.jit
def global_scale_from_amax(amax):
    """amax (fp32) -> g = amax / 2688, and 1 where that is 0."""
    g = tl.math.div_rn(amax, tl.full(amax.shape, G_DIVISOR, tl.float32))
    return tl.where(g == 0.0, 1.0, g)


@triton.jit
def e4m3_rne_bits(t, HW: tl.constexpr = False):
    """fp32 in [0, 448] (or NaN) -> int32 e4m3 bits, round-to-nearest-even; NaN -> 0x7F."""
    if HW:
        return t.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
    b = t.to(tl.int32, bitcast=True)
    normal = (b + (0x7FFFF + ((b >> 20) & 1)) - (120 << 23)) >> 20
    subnormal = _rne_int(t * _E4M3_SUBNORMAL_STEPS)
    bits = tl.where(t < _E4M3_MIN_NORMAL, subnormal, normal)
    return tl.where(t == t, bits, FP8_NAN)


@triton.jit
def e4m3_bits_to_f32(bits, HW: tl.constexpr = False):
    """int32 e4m3 bits (0..0xFF, as a uint8 scale byte read) -> fp32 value, as float8_e4m3fn:
    0x7F and 0xFF NaN, bit 7 the sign. (Scales this package writes are 0..0x7F; a checkpoint's may
    hold 0xFF, the NaN torch writes on x86, or a sign: read as the reference reads them.)"""
    if HW:
        return bits.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    magnitude = bits & 0x7F
    exponent = magnitude >> 3
    mantissa = bits & 7
    normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    subnormal = mantissa.to(tl.float32) * (1.0 / _E4M3_SUBNORMAL_STEPS)
    value = tl.where(exponent == 0, subnormal, normal)
    value = tl.where(magnitude == FP8_NAN, float("nan"), value)
    return tl.where(bits >= 0x80, -value, value)


@triton.jit
def block_scale_bits(block_amax, block_ok, g, HW: tl.constexpr = False):
    """Block amax, "block and g usable" mask, g -> int32 e4m3 bits of min(amax / (g * 6), 448)."""
    t = tl.math.div_rn(block_amax, g * FP4_MAX)
    bits = e4m3_rne_bits(tl.minimum(t, FP8_MAX), HW)
    return tl.where(block_ok, bits, FP8_NAN)


@triton.jit
def reciprocal_operands(g):
    """fp32 g -> (k, g * k), k = 2^64 where g < 2^-100, else 1: the element step is
    y = (x * k) * (1 / (s * (g * k))) (reference.reciprocal_operands)."""
    k = tl.where(g < _TINY_G, _TINY_FACTOR, 1.0)
    return k, g * k


@triton.jit
def e2m1_index_bits(y, cap=FP4_MAX, unit=1.0):
    """fp32 y -> int32 whose low 3 bits are the E2M1 magnitude index of |y| * unit (nearest, ties
    to even, saturating at 6), as bits(2^23 + index): 3 FFMA / FADD and 3 min, branch-free (the
    module docstring's formula). Higher bits are not cleared. cap: 6 / unit, or 0 (a block's),
    which gives index 0 for every y, NaN too (min returns the operand that is not NaN). unit, a
    power of two (1 unless reciprocal_operands' k), scales the formula's multipliers: every
    product stays exact, so the index is that of the value y * unit, with no extra multiply."""
    a = tl.minimum(tl.abs(y), cap)
    r = tl.minimum(tl.minimum(a * (2.0 * unit) + _RNE_MAGIC, a * unit + _RNE_MAGIC_PLUS_2),
                   a * (0.5 * unit) + _RNE_MAGIC_PLUS_4)
    return r.to(tl.int32, bitcast=True)


@triton.jit
def e2m1_pack_pair(y_even, y_odd, sign_bits, cap, sign_mask, unit=1.0):
    """Scaled values of elements (2i, 2i + 1) and their sign bits at bits 3 and 7 (higher bits
    ignored) -> int32 whose low byte is the packed pair: even code in the low nibble, odd code in
    the high nibble (code = sign << 3 | index; the indices' 2^23 bits stay above the low byte).
    cap, sign_mask: 6 / unit and 0x88, or 0 and 0 for a block stored as all +0 (zero and NaN
    blocks): per block, so the masking costs no instruction per element. unit: e2m1_index_bits'."""
    index = (e2m1_index_bits(y_odd, cap, unit) << 4) + e2m1_index_bits(y_even, cap, unit)
    return index | (sign_bits & sign_mask)


@triton.jit
def pair_sign_bits(words, DTYPE: tl.constexpr):
    """Pair words -> int32 with the even element's sign at bit 3 and the odd one's at bit 7
    (garbage above bit 7). For 16-bit types one multiply-high moves both sign bits (15 and 31)
    into place at once: (s * (2^20 + 2^8)) >> 32 sends bit 15 to 3 and bit 31 to 7."""
    if DTYPE == tl.float32:
        signs = (((words >> 28) & 0x8) | ((words >> 56) & 0x80)).to(tl.int32)
    else:
        s = (words & -2147450880).to(tl.uint32, bitcast=True)  # 0x80008000: the two sign bits
        signs = tl.umulhi(s, 0x00100100).to(tl.int32, bitcast=True)
    return signs


@triton.jit
def max_propagate_nan(a, b):
    """Combine function for tl.reduce: max that keeps a NaN (tl.max may drop it)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def e2m1_decode(codes):
    """int32 E2M1 codes (0..15) -> fp32 values (code 8 is -0.0)."""
    index = codes & 7
    # index >= 2: 2^(e - 1) * (1 + m / 2) with e = index >> 1, m = index & 1; index 1: 0.5; 0: 0.
    normal = (((index >> 1) + 126) << 23) | ((index & 1) << 22)
    bits = tl.where(index >= 2, normal, tl.where(index == 1, 0x3F000000, 0))
    return (bits | ((codes & 8) << 28)).to(tl.float32, bitcast=True)


# swizzled_scale_offset computes int32 offsets: the launchers refuse larger swizzled scale matrices.
SWIZZLED_MAX_BYTES = 2**31


def check_swizzled_offsets(name: str, rows_pad: int, cols_pad: int) -> None:
    """A swizzled (rows_pad, cols_pad) scale matrix the kernels address with int32 offsets."""
    if rows_pad * cols_pad > SWIZZLED_MAX_BYTES:
        raise ValueError(f"{name}: swizzled scales of {rows_pad} x {cols_pad} bytes exceed the kernels' "
                         f"32-bit offsets ({SWIZZLED_MAX_BYTES} bytes); use plain scales (swizzle=False) "
                         f"at this size")


@triton.jit
def swizzled_scale_offset(row, col, cols_pad):
    """Row and column of the padded (rows_pad, cols_pad) scale matrix -> byte offset (the swizzled
    layout)."""
    tile = (row // SWIZZLE_ROWS) * (cols_pad // SWIZZLE_COLS) + col // SWIZZLE_COLS
    inner = ((row % ROW_GROUP) * (SWIZZLE_ROWS // ROW_GROUP * SWIZZLE_COLS)
             + (row % SWIZZLE_ROWS) // ROW_GROUP * SWIZZLE_COLS)
    return tile * SWIZZLE_BYTES + inner + col % SWIZZLE_COLS


@triton.jit
def tiled_scale_offset(r, c):
    """Tile row r, block c -> the byte of its scale in a tile of nvfp4_inductor.reference.tiled's layout
    (tiled.scale_index: the register-fed GEMM's word a thread)."""
    return 128 * (r // 32) + 16 * (r % 8) + 4 * c + (r % 32) // 8


@triton.jit
def tiled_row_at(p):
    """A tile's rows in the order of its scales: place p = 32u + 4g + j holds tile row
    32u + 8j + g (tiled.scale_index stores the scales of rows (u, g, j) block-interleaved)."""
    return (p // 32) * 32 + (p % 4) * 8 + (p % 32) // 4


@triton.jit
def tiled_scales_by_place(s_bits):
    """A tile's 256 scale bytes as stored (one contiguous load) -> (64, 4) [place, block], places
    as tiled_row_at: each group of 16 bytes (4 places x 4 blocks) transposed."""
    return tl.reshape(tl.permute(tl.reshape(s_bits, (16, 4, 4)), (0, 2, 1)), (64, 4))


@triton.jit
def tiled_places_to_rows(acc):
    """(64, C) with rows by place (tiled_row_at) -> rows in tile order."""
    return tl.reshape(tl.permute(tl.reshape(acc, (2, 8, 4, acc.shape[1])), (0, 2, 1, 3)), (64, acc.shape[1]))


@triton.jit
def scale_offsets(rows, block_cols, K, scale_cols_pad, SWIZZLED: tl.constexpr):
    """Rows and block columns (broadcastable tensors) -> byte offsets of their e4m3 scales, in the
    plain (rows, K/16) layout or the swizzled one."""
    if SWIZZLED:
        offsets = swizzled_scale_offset(rows, block_cols, scale_cols_pad)
    else:
        offsets = rows.to(tl.int64) * (K // BLOCK) + block_cols
    return offsets


@triton.jit
def load_pair_words(x_ptr, pair_offsets, mask):
    """Load elements (2i, 2i + 1) of a bf16 / fp16 / fp32 tensor as one 32- / 64-bit word per
    pair (pair_offsets count pairs; x must be aligned to a pair). Kept raw until split_pair_words,
    so a prefetched tile costs half the registers of its fp32 values."""
    if x_ptr.dtype.element_ty == tl.float32:
        words = tl.load(x_ptr.to(tl.pointer_type(tl.int64)) + pair_offsets, mask=mask, other=0)
    else:
        words = tl.load(x_ptr.to(tl.pointer_type(tl.int32)) + pair_offsets, mask=mask, other=0)
    return words


@triton.jit
def split_pair_words(w, DTYPE: tl.constexpr):
    """Pair words of a DTYPE tensor -> (even, odd) fp32. Working on pairs keeps nibble packing a
    per-thread operation (no reshape, no shared-memory round trip); bf16 -> fp32 is one op each."""
    if DTYPE == tl.float32:
        even = (w & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)
        odd = (w >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    elif DTYPE == tl.bfloat16:  # bf16 is the top half of an fp32
        even = (w << 16).to(tl.float32, bitcast=True)
        odd = (w & -65536).to(tl.float32, bitcast=True)
    else:
        even = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        odd = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return even, odd


@triton.jit
def store_pairs(out_ptr, pair_offsets, even, odd, mask):
    """Store fp32 tensors (even, odd) as elements (2i, 2i + 1) of a bf16 / fp16 / fp32 tensor, one
    32- / 64-bit word per pair (the counterpart of load_pair_words; rounds to nearest even)."""
    if out_ptr.dtype.element_ty == tl.float32:
        low = even.to(tl.int32, bitcast=True).to(tl.uint32, bitcast=True).to(tl.int64)
        high = odd.to(tl.int32, bitcast=True).to(tl.int64)
        tl.store(out_ptr.to(tl.pointer_type(tl.int64)) + pair_offsets, low | (high << 32), mask=mask)
    else:
        tl.store(out_ptr.to(tl.pointer_type(tl.int32)) + pair_offsets,
                 half_pair_words(even, odd, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def half_pair_words(even, odd, DTYPE: tl.constexpr):
    """fp32 tensors (even, odd) rounded to bf16 / fp16 DTYPE -> int32 pair words, the even element
    in the low half (load_pair_words' form)."""
    low = even.to(DTYPE).to(tl.int16, bitcast=True).to(tl.uint16, bitcast=True).to(tl.int32)
    high = odd.to(DTYPE).to(tl.int16, bitcast=True).to(tl.int32)
    return low | (high << 16)


@triton.jit
def round_to(y, DTYPE: tl.constexpr):
    """fp32 -> fp32 rounded to nearest even in bf16 / fp16 DTYPE. bf16 on the bits: the Triton
    interpreter's fp32 -> bf16 cast truncates (1.8666 -> 1.8594), so CI would test other numbers."""
    if DTYPE == tl.bfloat16:
        b = y.to(tl.int32, bitcast=True)
        r = ((b + (0x7FFF + ((b >> 16) & 1))) & -65536).to(tl.float32, bitcast=True)
        return tl.where(y == y, r, y)
    return y.to(DTYPE).to(tl.float32)


# The weight's layout, the LAYOUT meta-parameter of the GEMM mainloops (launchers translate the
# plan's name with LAYOUTS): the tiled layout (nvfp4_inductor/reference/tiled.py), or row-major
# (N, K/2) codes with plain (N, K/16) scales, with swizzled scales, or with plain scales read a word
# per 4 K-tiles (the register-fed mainloop's grouped k-mapping, K % 64 == 0: device/mma.py).
LAYOUT_TILED: tl.constexpr = tl.constexpr(0)
LAYOUT_ROW_MAJOR: tl.constexpr = tl.constexpr(1)
LAYOUT_SWIZZLED: tl.constexpr = tl.constexpr(2)
LAYOUT_GROUPED: tl.constexpr = tl.constexpr(3)
LAYOUTS = {"tiled": 0, "row_major": 1, "swizzled": 2, "grouped": 3}
