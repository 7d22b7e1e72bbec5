"""The Hopper W4A16 GEMM's weight layout (kernels/hopper_gemm.py): NVFP4 codes and scales rearranged
so that the 32-bit word a thread reads from shared memory decodes into its wgmma A-operand registers
with a few bit operations, and each block scale into a bf16x2 multiplier with two.

wgmma's A fragment (m64k16, bf16, one warp's 16 rows): lane 4g + q holds four bf16x2 registers,
each two K-neighbours of one row: (row g + 8h, k 8c + 2q + e), e = 0, 1 in one register, for
(h, c) = (0, 0), (1, 0), (0, 1), (1, 1). One word holds those 8 codes, so a K-step of 16 is one word
a lane. Weight row n = 16 rg + 8 h + g (rg: the warp's group of 16 rows), k = 64 kc + 16 w + 8 c +
2 q + e (kc: a 64-wide K chunk, w: its 16-wide step):

    codes[kc, 32 rg + 4 g + q, w]   int32, (K_pad / 64, 2 N_pad, 4)
        = sum over (h, c, e) of  index(n, k) << MAG_BIT[h, c, e]  |  sign(n, k) << SIGN_BIT[h, c, e]
    scales[kc, 4 (8 rg + g) + w]    int16, (K_pad / 64, 2 N_pad)
        = S(n = 16 rg + g, ks) | S(n = 16 rg + 8 + g, ks) << 8,   ks = 4 kc + w

zero-padded to N_pad = 64 * ceil(N / 64) rows and K_pad = 64 * ceil(K / 64) (zero codes decode to
zero). A lane's four words of a chunk are 16 contiguous bytes, consecutive lanes' are consecutive:
one conflict-free 16-byte shared-memory load, and one TMA box (kc, rows, 4) a tile.

The bit positions (MAG_BIT: the code's 3-bit magnitude index i, SIGN_BIT: its sign): bf16 bits
i << 6 are exactly e2m1(i) * 2^-126 for all 8 magnitudes (i = 1 is the subnormal 2^-127), with the
sign at bit 15. The pairs sit in the word so that each is one or two shifts and one mask away from
that form, the two values of a register 16 bits apart:

    (h, c) = (0, 0):   w & 0x81C081C0                                 magnitudes 6, 22;  signs 15, 31
             (1, 0):   (w << 6) & 0x81C081C0                                     0, 16;          9, 25
             (0, 1):   (w << 3) & 0x01C001C0 | (w << 5) & 0x80008000               3, 19;         10, 26
             (1, 1):   (w >> 5) & 0x01C001C0 | (w << 1) & 0x80008000              11, 27;         14, 30

(e = 1 is the first position + 16). No placement does better than 11 operations for 4 pairs: the
set {6, 7, 8, 15} tiles no cyclic group of 16 bits, so not every pair can be one shift and one mask.

Block scales as S, an 8-bit e5m3 of the e4m3 value: a positive e4m3 value s, normal or subnormal, is
(1 + f/8) 2^E with E in [-9, 8] and f in 0..7; S = (E + 9) << 3 | f. bf16 bits
(S << 4) | 0x7000 are then exactly s * 2^SCALE_SHIFT (exponent field E + 9 + 224), and one integer
multiply-add, S * 0x00100010 + 0x70007000, gives the bf16x2 pair (s, s) * 2^SCALE_SHIFT. The
product with a code is e2m1 * s * 2^-UNSCALE_LOG2, exact in bf16 (at most 6 significant bits,
2^-30 <= |value| <= 2688 * 2^-20); the kernel's epilogue multiplies by 2^UNSCALE_LOG2 with the
global scale. S = 0xFF (exponent field 255, mantissa non-zero) is bf16 NaN: an e4m3 NaN scale
(0x7F, 0xFF) poisons its block, as the reference does. A zero scale has no e5m3 form: its block's
codes are stored as zeros, with S = SCALE_ZERO (a finite S no e4m3 value uses), and decode to zero
as the reference's 0 * s does; a negative
scale's sign moves to its block's codes. So the layout keeps every dequantized value
(tests/test_reference_hopper.py), and unpack recovers the codes and scale bits exactly for the
weights the quantizer writes (scale sign clear; zero-scale blocks all zero codes).
"""

import torch
from torch import Tensor

from nvfp4_inductor.format import BLOCK_SIZE, E2M1_SIGN_BIT

CHUNK_K = 64  # K values a chunk of codes (4 wgmma K-steps of 16)
ROW_ALIGN = 64  # N_pad: a multiple of one warpgroup's 64 rows
SCALE_EXP_BIAS = 9  # S's exponent field is E + 9 (E >= -9, e4m3's smallest subnormal 2^-9)
SCALE_NAN = 0xFF
SCALE_ZERO = 0xF0  # a finite S no e4m3 value uses (exponent field 254): a zero scale's block
SCALE_SHIFT = 106  # bf16 (S << 4) | 0x7000 = s * 2^106 (exponent field E + 233 = E + 106 + 127)
UNSCALE_LOG2 = 20  # codes carry 2^-126: decoded values are e2m1 * s * 2^(106 - 126)

# (h, c, e) -> bit of the magnitude's lowest bit and of the sign in a code word (module docstring)
MAG_BIT = {(0, 0): 6, (1, 0): 0, (0, 1): 3, (1, 1): 11}
SIGN_BIT = {(0, 0): 15, (1, 0): 9, (0, 1): 10, (1, 1): 14}


def padded_shape(n: int, k: int) -> tuple[int, int]:
    """(N, K) -> (N_pad, K_pad) of the layout."""
    return -(-n // ROW_ALIGN) * ROW_ALIGN, -(-k // CHUNK_K) * CHUNK_K


def _e4m3_to_e5m3_table(device) -> Tensor:
    """(256,) int32: e4m3 bits -> S for |s| (SCALE_ZERO for a zero scale, SCALE_NAN for NaN)."""
    bits = torch.arange(256, dtype=torch.int32, device=device)
    s = bits.to(torch.uint8).view(torch.float8_e4m3fn).float().abs()
    mantissa, exponent = torch.frexp(s)  # s = mantissa * 2^exponent, mantissa in [0.5, 1)
    e = exponent - 1
    f = (mantissa * 16 - 8).to(torch.int32)
    table = ((e + SCALE_EXP_BIAS) << 3) | f
    table = torch.where(s == 0, SCALE_ZERO, table)
    return torch.where(torch.isnan(s), SCALE_NAN, table)


def _e5m3_to_e4m3_table(device) -> Tensor:
    """(256,) int32: S -> the non-negative e4m3 bits it came from (0x7F for SCALE_NAN)."""
    forward = _e4m3_to_e5m3_table(device)[:0x7F]
    table = torch.zeros(256, dtype=torch.int32, device=device)
    table[forward.long()] = torch.arange(0x7F, dtype=torch.int32, device=device)
    table[SCALE_NAN] = 0x7F
    return table


def _pair_places():
    """-> [((h, c), e, magnitude bit, sign bit)] for the 8 codes of a word."""
    return [((h, c), e, MAG_BIT[h, c] + 16 * e, SIGN_BIT[h, c] + 16 * e)
            for (h, c) in MAG_BIT for e in (0, 1)]


def _to_words(codes: Tensor) -> Tensor:
    """(N_pad, K_pad) codes -> (K_pad/64, N_pad/16, 8 g, 4 q, 4 w, 2 h, 2 c, 2 e) int64 codes."""
    n_pad, k_pad = codes.shape
    t = codes.long().view(n_pad // 16, 2, 8, k_pad // CHUNK_K, 4, 2, 4, 2)  # rg h g kc w c q e
    return t.permute(3, 0, 2, 6, 4, 1, 5, 7)


def pack(data: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
    """uint8 (N, K/2) codes + e4m3 (N, K/16) scales (or their uint8 bits) -> (int32 codes
    (K_pad/64, 2 N_pad, 4), int16 scales (K_pad/64, 2 N_pad)), the module docstring's layout."""
    n, k = data.shape[0], data.shape[1] * 2
    n_pad, k_pad = padded_shape(n, k)
    scale_bits = scale.view(torch.uint8).to(torch.int32)
    codes = torch.zeros((n_pad, k_pad), dtype=torch.int32, device=data.device)
    codes[:n, :k] = torch.stack([data & 0xF, data >> 4], -1).reshape(n, k).to(torch.int32)
    bits = torch.zeros((n_pad, k_pad // BLOCK_SIZE), dtype=torch.int32, device=data.device)
    bits[:n, : k // BLOCK_SIZE] = scale_bits
    # a zero scale's block: zero codes; a negative scale's sign: onto its block's codes
    block_bits = bits.repeat_interleave(BLOCK_SIZE, 1)
    codes = torch.where((block_bits & 0x7F) == 0, 0, codes)
    codes = codes ^ torch.where(block_bits > 0x80, E2M1_SIGN_BIT, 0)

    t = _to_words(codes)
    word = torch.zeros(t.shape[:5], dtype=torch.int64, device=data.device)
    for (h, c), e, mag_bit, sign_bit in _pair_places():
        code = t[..., h, c, e]
        word |= ((code & 7) << mag_bit) | ((code >> 3) << sign_bit)
    word = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)
    codes_out = word.reshape(k_pad // CHUNK_K, 2 * n_pad, 4)

    s = _e4m3_to_e5m3_table(data.device)[bits.long()]  # (N_pad, K_pad/16)
    s = s.view(n_pad // 16, 2, 8, k_pad // CHUNK_K, 4).permute(3, 0, 2, 4, 1)  # kc rg g w h
    pair = s[..., 0] | (s[..., 1] << 8)
    pair = torch.where(pair >= 2**15, pair - 2**16, pair).to(torch.int16)
    return codes_out, pair.reshape(k_pad // CHUNK_K, 2 * n_pad)


def unpack(codes: Tensor, scales: Tensor, n: int, k: int) -> tuple[Tensor, Tensor]:
    """The inverse of pack: -> uint8 (N, K/2) codes and uint8 (N, K/16) e4m3 scale bits."""
    chunks, rows = scales.shape
    n_pad, k_pad = rows // 2, chunks * CHUNK_K
    word = codes.long().view(chunks, n_pad // 16, 8, 4, 4) & 0xFFFFFFFF
    t = torch.zeros((*word.shape, 2, 2, 2), dtype=torch.int64, device=codes.device)
    for (h, c), e, mag_bit, sign_bit in _pair_places():
        t[..., h, c, e] = ((word >> mag_bit) & 7) | (((word >> sign_bit) & 1) << 3)
    # (kc, rg, g, q, w, h, c, e) -> (rg, h, g, kc, w, c, q, e)
    values = t.permute(1, 5, 2, 0, 4, 6, 3, 7).reshape(n_pad, k_pad)[:n, :k].to(torch.uint8)
    data = values[:, 0::2] | (values[:, 1::2] << 4)

    pair = scales.long().view(chunks, n_pad // 16, 8, 4) & 0xFFFF
    s = torch.stack([pair & 0xFF, pair >> 8], -1)  # kc rg g w h
    s = s.permute(1, 4, 2, 0, 3).reshape(n_pad, k_pad // BLOCK_SIZE)[:n, : k // BLOCK_SIZE]
    bits = _e5m3_to_e4m3_table(codes.device)[s].to(torch.uint8)
    return data.contiguous(), bits.contiguous()


def decode(codes: Tensor, scales: Tensor) -> Tensor:
    """The kernel's decode in torch, on the bits: (codes, scales) of pack -> fp32 (N_pad, K_pad)
    values e2m1 * s * 2^-UNSCALE_LOG2 (the shifts and masks of the module docstring, then the
    bf16 product, exact)."""
    chunks, rows = scales.shape
    n_pad, k_pad = rows // 2, chunks * CHUNK_K
    w = codes.long().view(chunks, n_pad // 16, 8, 4, 4) & 0xFFFFFFFF
    mag, sign = 0x01C001C0, 0x80008000
    pairs = {(0, 0): w & (mag | sign),
             (1, 0): (w << 6) & (mag | sign),
             (0, 1): ((w << 3) & mag) | ((w << 5) & sign),
             (1, 1): ((w >> 5) & mag) | ((w << 1) & sign)}
    s = scales.long().view(chunks, n_pad // 16, 8, 1, 4) & 0xFFFF
    multiplier = [((s >> (8 * h)) & 0xFF) * 0x00100010 + 0x70007000 for h in (0, 1)]
    t = torch.zeros((*w.shape, 2, 2, 2), dtype=torch.float32, device=codes.device)
    for (h, c), p in pairs.items():
        for e in (0, 1):
            value = _bf16_from_bits((p >> (16 * e)) & 0xFFFF)
            factor = _bf16_from_bits((multiplier[h] >> (16 * e)) & 0xFFFF)
            t[..., h, c, e] = (value * factor).to(torch.bfloat16).float()
    return t.permute(1, 5, 2, 0, 4, 6, 3, 7).reshape(n_pad, k_pad)


def _bf16_from_bits(bits: Tensor) -> Tensor:
    """int64 tensor of 16-bit patterns -> the fp32 values of those bf16s."""
    return (bits.to(torch.int32) << 16).view(torch.float32)
