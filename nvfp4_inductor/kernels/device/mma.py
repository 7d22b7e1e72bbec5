"""Register-fed skinny NVFP4 GEMM for decode on sm_90: y = x @ W^T, x (M <= 32, K) bf16, W NVFP4
in the tiled layout (nvfp4_inductor/reference/tiled.py: 64 x 64 tiles, each tile's 64 rows of 32 bytes
contiguous, its 256 e4m3 scale bytes in the order the lanes below read them; what the backend
makes) or in the row-major interchange layout (what nv.linear takes; see Row-major weights below).

Why not tl.dot: at M <= 16 the GEMM is a weight stream with only a few instructions per weight
to spend (the issue rate over the HBM bandwidth). Through tl.dot (device/mainloops.py) Triton stages
x^T, padded to 16 columns, in shared memory every K-step, and joins the decoded nibbles into its
operand layout with byte permutes: more instructions a weight than the budget, the kernel issue-
and shared-memory-bound well short of the HBM floor (docs/gemm.md). Here every warp issues
mma.sync.m16n8k16 itself (inline PTX) on operands that never leave registers, in a mapping chosen so
that each lane loads exactly the bytes it multiplies.

Lanes and data. All tensors are 1-D of BLOCK = 32 * WARPS elements (WARPS = 2), element i held
by thread i (lane l = i % 32, warp u = i // 32, g = l // 4, q = l % 4). Warp u owns rows
32u .. 32u + 31 of the program's 64-row tile, as two mma row blocks that share each x fragment;
per K-step (one 64 x 64 tile) lane (g, q) holds
    W rows 32u + g + 8j, j = 0..3, k in [16q, 16q + 16): 4 x 8 bytes, one e4m3 scale each
        (coalesced: each 8-byte load of a warp reads 256 contiguous bytes of the tile; the four
        scales one word, word i of the tile's scales: tiled.py orders them so, and a warp's word
        load reads 128 contiguous bytes; four byte loads in the plain order are slower),
    x row g (and g + 8 when M > 8), the same 16 k: 32 bytes (row M - 1 again for rows >= M:
        their products land in output columns nobody stores).
A lane's 32 bytes of x serve 4 weight rows (32 bytes of codes). With a warp per 16 rows they
would serve 2, and x's loads (L1 hits) measurably slow the weight stream (docs/gemm.md).
mma.sync.m16n8k16 (row.col, bf16, fp32 accumulate), A = W (16 rows x 16 k-slots), B = x^T
(16 k-slots x 8 rows of x): lane (g, q) supplies A rows g, g + 8 and B column g at k-slots
2q, 2q + 1, 2q + 8, 2q + 9, and gets D rows g, g + 8, columns 2q, 2q + 1. The k-slot -> k mapping
is free as long as A and B agree; it is chosen for the decode: with 8 codes per 32-bit word
(natural order, nibble i = k offset i), codes i and i + 4 sit 16 bits apart, so one shift/mask
places both into a bf16x2 (`_DECODE_PAIRS_ASM`), and x's matching pair (x[i], x[i + 4]) is one
byte permute of two loaded words. Sub-step j of a K-step multiplies the pairs
    j = 0: (0, 4), (1, 5)   j = 1: (2, 6), (3, 7)   j = 2: (8, 12), (9, 13)   j = 3: (10, 14), (11, 15)
(offsets from 16q; the first pair at k-slots 2q, 2q + 1, the second at 2q + 8, 2q + 9).

Values. Codes become bf16 e2m1 * 2^-126 (bits mag << 6, sign at 15), multiplied by bf16
s * 2^119 (one mul.bf16x2, exact: at most 6 significant bits): e2m1 * s * 2^-7, as in
device/mainloops.py; the epilogue multiplies by 2^7 * g. s * 2^119 comes from the e4m3 bits through
the hardware conversion (cvt.rn.f16x2.e4m3x2, exact, NaN kept) and fp32.

Row-major weights (LAYOUT_ROW_MAJOR .. LAYOUT_GROUPED). The same lanes, values and mma; each lane
keeps a pointer to each of its four rows, and a warp's 8-byte code load reads 8 rows x 32 bytes (8
cache lines, against 2 in the tiled layout). Plain scales read as bytes cost as much again (8 lines
a byte load), so with K % 64 == 0 at M <= 8 (LAYOUT_GROUPED) a lane takes, in tile r of each group
of 4 K-tiles, the 16-k block 4q + r of the group: its 4 scale bytes of the group are one word,
loaded once a group and picked from by a byte permute; its codes of a group are then 32 contiguous
bytes of each row, read as two 16-byte loads (tiles 0 and 2 of the group; the second half of each
held in registers for the next tile). Swizzled scales (LAYOUT_SWIZZLED) need neither: the 8 rows of
a warp's scale load lie in one 128-byte line. Fastest to slowest: tiled, swizzled, plain read as
words, plain read as bytes; the 16-byte code loads hold more registers but are faster
(docs/gemm.md).

More x rows (NB blocks of 8: M <= 8, 16, 32): each block's x words feed an mma per weight row
block, the weights decoded once. Four blocks hold 32 sums and two tiles of x words a lane (142
registers, 7 programs an SM): on tiled weights no faster than the tl.dot kernel at M = 17..32,
so only row-major weights use it there (plan.MMA_MAX_M_TILED; docs/gemm.md).

L1. The tiled weights' loads carry evict_first (L1 and L2): each byte is read once, and left to
L1's default policy they push out x's lines, which a lane reads again every K-tile (32 bytes a
tile, L1 hits when they stay). Not on row-major weights, whose 128-byte lines serve a lane four
K-tiles in a row from L1: there evict_first is markedly slower (docs/gemm.md).

The mainloop returns the (64, BLOCK_M) fp32 tile of mainloops.dot_mainloop's contract, so the
eager split-K kernel and the Inductor template call either (REG_MMA): this one on CUDA for small
M, the tl.dot one for larger M and under the Triton interpreter (which runs no inline PTX).
"""

import triton
import triton.language as tl

from nvfp4_inductor.format import BLOCK_SIZE
from nvfp4_inductor.kernels.device.common import (
    LAYOUT_GROUPED, LAYOUT_ROW_MAJOR, LAYOUT_SWIZZLED, LAYOUT_TILED, SWIZZLE_BYTES, TILED_K, TILED_N,
    swizzled_scale_offset,
)
from nvfp4_inductor.kernels.gemm_configs import MMA_GROUP
from nvfp4_inductor.reference.tiled import TILE_K, TILE_N

_TILE_WORDS: tl.constexpr = tl.constexpr(TILE_N * TILE_K // 8)  # uint32 words of codes a tile
_TILE_SCALE_WORDS: tl.constexpr = tl.constexpr(TILE_N * TILE_K // BLOCK_SIZE // 4)  # a tile's scales (words)
_ROW_WORDS: tl.constexpr = tl.constexpr(TILE_K // 8)  # uint32 words a tile row (8)
WARP_ROWS = 32  # weight rows a warp multiplies: two mma row blocks sharing each x fragment
WARPS = TILE_N // WARP_ROWS  # warps a program (a 64-row tile)
_WARP_ROWS: tl.constexpr = tl.constexpr(WARP_ROWS)
_WARPS: tl.constexpr = tl.constexpr(WARPS)
_BLOCK: tl.constexpr = tl.constexpr(BLOCK_SIZE)  # k of a block scale (16)
GROUP = MMA_GROUP  # LAYOUT_GROUPED: K-tiles whose plain scales a lane reads as one word
_GROUP: tl.constexpr = tl.constexpr(GROUP)
# The tiled weights' loads (each byte read once) are marked first out of L1 (and L2), so that they do
# not push out x's lines, which every K-tile reads again: module docstring, "L1".
TILED_WEIGHT_EVICTION = "evict_first"
_TILED_WEIGHTS: tl.constexpr = tl.constexpr(TILED_WEIGHT_EVICTION)

# $4: 8 codes (natural order), $5: bf16x2 s * 2^119; $0..$3: bf16x2 pairs (i, i + 4), i = 0..3,
# each e2m1 * s * 2^-7: magnitude bits to 6..8 (+16), sign to 15 (+16).
_DECODE_PAIRS_ASM: tl.constexpr = tl.constexpr("""
{
.reg .b32 m, s;
shl.b32 m, $4, 6; and.b32 m, m, 0x01C001C0; shl.b32 s, $4, 12; and.b32 s, s, 0x80008000;
or.b32 m, m, s; mul.rn.bf16x2 $0, m, $5;
shl.b32 m, $4, 2; and.b32 m, m, 0x01C001C0; shl.b32 s, $4, 8; and.b32 s, s, 0x80008000;
or.b32 m, m, s; mul.rn.bf16x2 $1, m, $5;
shr.b32 m, $4, 2; and.b32 m, m, 0x01C001C0; shl.b32 s, $4, 4; and.b32 s, s, 0x80008000;
or.b32 m, m, s; mul.rn.bf16x2 $2, m, $5;
shr.b32 m, $4, 6; and.b32 m, m, 0x01C001C0; and.b32 s, $4, 0x80008000;
or.b32 m, m, s; mul.rn.bf16x2 $3, m, $5;
}
""")

# $2: two e4m3 bytes (row g, row g + 8); $0, $1: bf16x2 (s * 2^119, s * 2^119) of each.
_SCALES_ASM: tl.constexpr = tl.constexpr("""
{
.reg .b32 h; .reg .b16 lo, hi; .reg .f32 a, b;
cvt.rn.f16x2.e4m3x2 h, $2;
mov.b32 {lo, hi}, h;
cvt.f32.f16 a, lo; cvt.f32.f16 b, hi;
mul.f32 a, a, 0f7B000000; mul.f32 b, b, 0f7B000000;
cvt.rn.bf16x2.f32 $0, a, a; cvt.rn.bf16x2.f32 $1, b, b;
}
""")

_MMA_ASM: tl.constexpr = tl.constexpr(
    "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
    "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};")


@triton.jit
def _decode_pairs(word, scale):
    return tl.inline_asm_elementwise(_DECODE_PAIRS_ASM, "=r,=r,=r,=r,r,r", [word, scale],
                                     dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32),
                                     is_pure=True, pack=1)


@triton.jit
def _scales(s_pair):
    return tl.inline_asm_elementwise(_SCALES_ASM, "=r,=r,h", [s_pair.to(tl.uint16)],
                                     dtype=(tl.uint32, tl.uint32), is_pure=True, pack=1)


@triton.jit
def _mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    return tl.inline_asm_elementwise(_MMA_ASM, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
                                     [a0, a1, a2, a3, b0, b1, c0, c1, c2, c3],
                                     dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
                                     is_pure=True, pack=1)


@triton.jit
def _pair_lo(a, b):
    """(low bf16 of a, low bf16 of b)"""
    return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0x5410;", "=r,r,r", [a, b],
                                     dtype=tl.uint32, is_pure=True, pack=1)


@triton.jit
def _pair_hi(a, b):
    """(high bf16 of a, high bf16 of b)"""
    return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0x7632;", "=r,r,r", [a, b],
                                     dtype=tl.uint32, is_pure=True, pack=1)


@triton.jit
def _split4(v):
    """(BLOCK, 4) -> its 4 columns."""
    a, b = tl.split(tl.reshape(v, (v.shape[0], 2, 2)))
    c0, c2 = tl.split(a)
    c1, c3 = tl.split(b)
    return c0, c1, c2, c3


@triton.jit
def _load_words(words, k_ok, WORDS: tl.constexpr, EVEN_K: tl.constexpr):
    """WORDS consecutive uint32 words from each lane's pointer `words` (one 8- or 16-byte load) ->
    (BLOCK, WORDS), zeros where k_ok is false unless EVEN_K."""
    ptrs = words[:, None] + tl.arange(0, WORDS)[None, :]
    if EVEN_K:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=k_ok[:, None], other=0)


@triton.jit
def _load4(words, k_ok, EVEN_K: tl.constexpr):
    """Four consecutive uint32 words from each lane's pointer (a 16-byte load): its 4 columns."""
    return _split4(_load_words(words, k_ok, 4, EVEN_K))


@triton.jit
def _load_x(x_ptr, x_word, k_ok, EVEN_K: tl.constexpr):
    """A lane's 16 bf16 of x (32 bytes from uint32 word x_word) -> 8 words, (x[2p], x[2p + 1]);
    zeros past K (k_ok false) unless EVEN_K."""
    x0, x1, x2, x3 = _load4(x_ptr + x_word, k_ok, EVEN_K)
    x4, x5, x6, x7 = _load4(x_ptr + x_word + 4, k_ok, EVEN_K)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _stream(ptrs):
    """A load of tiled weights (LAYOUT_TILED), each byte read once: marked first out of L1."""
    return tl.load(ptrs, eviction_policy=_TILED_WEIGHTS)


@triton.jit
def _load_weights(ww_ptr, ws_ptr, tile):
    """A lane's codes of tile `tile` (rows g, g + 8, g + 16, g + 24 of its warp's 32: two words
    each) and their four e4m3 scales as two 16-bit pairs: one word (ws_ptr: the lane's scale word
    of tile 0), byte j row g + 8j (the tiled layout's scale order)."""
    words = ww_ptr + tile * _TILE_WORDS
    w0, w1 = tl.split(_stream(words[:, None] + tl.arange(0, 2)[None, :]))
    w2, w3 = tl.split(_stream(words[:, None] + (8 * _ROW_WORDS + tl.arange(0, 2))[None, :]))
    w4, w5 = tl.split(_stream(words[:, None] + (16 * _ROW_WORDS + tl.arange(0, 2))[None, :]))
    w6, w7 = tl.split(_stream(words[:, None] + (24 * _ROW_WORDS + tl.arange(0, 2))[None, :]))
    scales = _stream(ws_ptr + tile * _TILE_SCALE_WORDS)
    return w0, w1, w2, w3, w4, w5, w6, w7, scales & 0xFFFF, scales >> 16


@triton.jit
def load_codes_rm(wp, t, held, k_ok, LAYOUT: tl.constexpr, EVEN_K: tl.constexpr):
    """Row-major W: a lane's codes of K-tile t (LAYOUT_ROW_MAJOR .. LAYOUT_GROUPED; wp its four row
    pointers at K-tile 0)
    -> (8 words: two a row, rows g, g + 8, g + 16, g + 24), held. LAYOUT_GROUPED: a lane's blocks of a
    group are 32 contiguous bytes of each row, read as two 16-byte loads, at the group's tiles 0 and
    2; the second half of each (tiles 1 and 3) is held (8 words) until the next tile. Else 8-byte
    loads every tile, held unused."""
    if LAYOUT == LAYOUT_GROUPED:
        if t % 2 == 0:  # tiles 0 and 2 of a group: blocks r, r + 1
            cw, _, _ = _tile_offsets(t, LAYOUT)
            a0, a1, a2, a3 = _load4(wp[0] + cw, k_ok, EVEN_K)
            b0, b1, b2, b3 = _load4(wp[1] + cw, k_ok, EVEN_K)
            c0, c1, c2, c3 = _load4(wp[2] + cw, k_ok, EVEN_K)
            d0, d1, d2, d3 = _load4(wp[3] + cw, k_ok, EVEN_K)
            w = (a0, a1, b0, b1, c0, c1, d0, d1)
            held = (a2, a3, b2, b3, c2, c3, d2, d3)
        else:
            w = held
    else:
        cw, _, _ = _tile_offsets(t, LAYOUT)
        w0, w1 = tl.split(_load_words(wp[0] + cw, k_ok, 2, EVEN_K))
        w2, w3 = tl.split(_load_words(wp[1] + cw, k_ok, 2, EVEN_K))
        w4, w5 = tl.split(_load_words(wp[2] + cw, k_ok, 2, EVEN_K))
        w6, w7 = tl.split(_load_words(wp[3] + cw, k_ok, 2, EVEN_K))
        w = (w0, w1, w2, w3, w4, w5, w6, w7)
    return w, held


@triton.jit
def _load_rm(ptrs, k_ok, EVEN_K: tl.constexpr):
    """A scale byte or word per lane, as uint32; zero past K unless EVEN_K."""
    if EVEN_K:
        return tl.load(ptrs).to(tl.uint32)
    return tl.load(ptrs, mask=k_ok, other=0).to(tl.uint32)


@triton.jit
def _byte_pair(a, b, r):
    """(byte r of a, byte r of b) in the low 16 bits (r 0..3)."""
    return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, r | ((r + 4) << 4)],
                                     dtype=tl.uint32, is_pure=True, pack=1)


@triton.jit
def _tile_offsets(t, LAYOUT: tl.constexpr):
    """K-tile t -> (code words (row-major W), x words, k) past K-tile 0 of the lane's addresses.
    LAYOUT_GROUPED groups 4 K-tiles (256 k): in tile t of a group lane q multiplies 16-k block
    4q + t % 4 of it, so that its 4 scale bytes of the group are one word; its code words are
    those of the 16-byte pair of blocks the tile's codes are loaded with (load_codes_rm: tiles 0
    and 1 of a group, 2 and 3), on 16 bytes."""
    if LAYOUT == LAYOUT_GROUPED:
        group, r = t // _GROUP, t % _GROUP
        return (group * (_GROUP * _ROW_WORDS) + (r // 2) * (2 * _BLOCK // 8),  # 8 codes a word
                group * (_GROUP * TILED_K // 2) + r * (_BLOCK // 2),  # 2 bf16 a word
                group * (_GROUP * TILED_K))
    return t * _ROW_WORDS, t * (TILED_K // 2), t * TILED_K


@triton.jit
def lane_k(q, LAYOUT: tl.constexpr):
    """The first k of lane slice q in K-tile 0 (LAYOUT_GROUPED: in group 0, blocks 4q .. 4q + 3)."""
    return (_GROUP * _BLOCK if LAYOUT == LAYOUT_GROUPED else _BLOCK) * q


@triton.jit
def row_major_pointers(w_ptr, w_scale_ptr, n0, q, N, K, scale_cols, LAYOUT: tl.constexpr):
    """Row-major W (LAYOUT_ROW_MAJOR .. LAYOUT_GROUPED): a lane's pointers at K-tile 0 -> (four uint32
    code pointers, four
    scale pointers) for its rows n0, n0 + 8, n0 + 16, n0 + 24 (each at most N - 1) and its k-slice
    q; _load_w adds K-tile t's offsets (_tile_offsets). Scale pointers: bytes (LAYOUT_ROW_MAJOR, plain; LAYOUT_SWIZZLED,
    swizzled, scale_cols the padded columns) or uint32 words (3: blocks 4q .. 4q + 3 of group 0)."""
    r0 = tl.minimum(n0, N - 1).to(tl.int64)
    r1 = tl.minimum(n0 + 8, N - 1).to(tl.int64)
    r2 = tl.minimum(n0 + 16, N - 1).to(tl.int64)
    r3 = tl.minimum(n0 + 24, N - 1).to(tl.int64)
    words = w_ptr.to(tl.pointer_type(tl.uint32)) + lane_k(q, LAYOUT) // 8  # 8 codes a word
    row_words = K // 8
    if LAYOUT == LAYOUT_GROUPED:  # K % 64 == 0: rows of whole 32-byte blocks (its 16-byte loads)
        row_words = tl.multiple_of(row_words, 8)
    wp = (words + r0 * row_words, words + r1 * row_words, words + r2 * row_words, words + r3 * row_words)
    if LAYOUT == LAYOUT_ROW_MAJOR:
        sp = (w_scale_ptr + r0 * (K // _BLOCK) + q, w_scale_ptr + r1 * (K // _BLOCK) + q,
              w_scale_ptr + r2 * (K // _BLOCK) + q, w_scale_ptr + r3 * (K // _BLOCK) + q)
    elif LAYOUT == LAYOUT_SWIZZLED:  # a K-tile is one column of 128 x 4 swizzle tiles (TILE_K / 16 == 4)
        sp = (w_scale_ptr + swizzled_scale_offset(r0, q, scale_cols),
              w_scale_ptr + swizzled_scale_offset(r1, q, scale_cols),
              w_scale_ptr + swizzled_scale_offset(r2, q, scale_cols),
              w_scale_ptr + swizzled_scale_offset(r3, q, scale_cols))
    else:
        scale_words = w_scale_ptr.to(tl.pointer_type(tl.uint32)) + q
        scale_row = K // (4 * _BLOCK)  # words: 4 scale bytes a word
        sp = (scale_words + r0 * scale_row, scale_words + r1 * scale_row,
              scale_words + r2 * scale_row, scale_words + r3 * scale_row)
    return wp, sp


@triton.jit
def _load_w(wp, sp, sw, first, t, k_ok, LAYOUT: tl.constexpr, EVEN_K: tl.constexpr):
    """A lane's codes of K-tile t (rows g, g + 8, g + 16, g + 24 of its warp's 32: two words each)
    and their four e4m3 scales as two 16-bit pairs, and sw (LAYOUT_GROUPED: the four rows' scale words
    of the current group, loaded at its first tile, then load_codes_rm's 8 held code words; else
    unused).
    LAYOUT_TILED (tiled): wp, sp lane pointers into the tile row starting at tile `first`. Row-major
    (1: plain scales, 2: swizzled, 3: plain grouped): wp, sp the lane's four row pointers at K-tile
    0. Past K the row-major bytes belong to the next row or lie past the end: masked (zeros) unless
    EVEN_K."""
    if LAYOUT == LAYOUT_TILED:
        w = _load_weights(wp, sp, first + t)
    else:
        codes, held = load_codes_rm(wp, t, sw[4:], k_ok, LAYOUT, EVEN_K)
        words = sw[:4]
        if LAYOUT == LAYOUT_GROUPED:
            r = t % _GROUP
            if r == 0:
                at = t  # a row's scale bytes of a group of 4 tiles are 4 words: word 4 * (t // 4) == t
                words = (_load_rm(sp[0] + at, k_ok, EVEN_K), _load_rm(sp[1] + at, k_ok, EVEN_K),
                         _load_rm(sp[2] + at, k_ok, EVEN_K), _load_rm(sp[3] + at, k_ok, EVEN_K))
            s01 = _byte_pair(words[0], words[1], r)
            s23 = _byte_pair(words[2], words[3], r)
        else:
            step: tl.constexpr = TILED_K // _BLOCK if LAYOUT == LAYOUT_ROW_MAJOR else SWIZZLE_BYTES
            s01 = _load_rm(sp[0] + t * step, k_ok, EVEN_K) | (_load_rm(sp[1] + t * step, k_ok, EVEN_K) << 8)
            s23 = _load_rm(sp[2] + t * step, k_ok, EVEN_K) | (_load_rm(sp[3] + t * step, k_ok, EVEN_K) << 8)
        w = codes + (s01, s23)
        sw = words + held
    return w, sw


@triton.jit
def lane_x_rows(g, kq, M, stride_xm, NB: tl.constexpr):
    """uint32 word offsets of a lane's x rows g + 8h, h < NB (each at most M - 1), at its first k
    (kq) of K-tile 0; _load_xs adds K-tile t's (_tile_offsets)."""
    x_rows = ()
    for h in tl.static_range(NB):
        x_rows = x_rows + ((tl.minimum(g + 8 * h, M - 1).to(tl.int64) * stride_xm + kq) // 2,)
    return x_rows


@triton.jit
def _load_xs(xw_ptr, x_rows, xw, k_ok, NB: tl.constexpr, EVEN_K: tl.constexpr):
    """A lane's x words of its NB rows (x_rows: their word offsets at K-tile 0), xw words further."""
    xs = ()
    for h in tl.static_range(NB):
        xs = xs + (_load_x(xw_ptr, x_rows[h] + xw, k_ok, EVEN_K),)
    return xs


@triton.jit
def _load_tile(wp, sp, sw, xw_ptr, first, t, x_rows, kq, K, LAYOUT: tl.constexpr,
               NB: tl.constexpr, EVEN_K: tl.constexpr):
    """What a lane reads for K-tile t: (weights, scale words, x words of each x-row block)."""
    _, xw, k = _tile_offsets(t, LAYOUT)
    k_ok = k + kq < K
    w, sw = _load_w(wp, sp, sw, first, t, k_ok, LAYOUT, EVEN_K)
    return w, sw, _load_xs(xw_ptr, x_rows, xw, k_ok, NB, EVEN_K)


@triton.jit
def _x_pairs(x):
    """A lane's 8 x words -> the B operands of its 4 mma sub-steps, pairs (o, o + 4): 8 words."""
    return (_pair_lo(x[0], x[2]), _pair_hi(x[0], x[2]), _pair_lo(x[1], x[3]), _pair_hi(x[1], x[3]),
            _pair_lo(x[4], x[6]), _pair_hi(x[4], x[6]), _pair_lo(x[5], x[7]), _pair_hi(x[5], x[7]))


@triton.jit
def _mma_rows(wg0, wg1, wh0, wh1, s_pair, b, c0, c1, c2, c3):
    """One K-tile of rows g and g + 8 (words wg0, wg1 and wh0, wh1, scales s_pair) against the B
    operands b (_x_pairs): 4 mma sub-steps."""
    sg, sh = _scales(s_pair)
    g0, g1, g2, g3 = _decode_pairs(wg0, sg)
    h0, h1, h2, h3 = _decode_pairs(wh0, sh)
    c0, c1, c2, c3 = _mma(g0, h0, g1, h1, b[0], b[1], c0, c1, c2, c3)
    c0, c1, c2, c3 = _mma(g2, h2, g3, h3, b[2], b[3], c0, c1, c2, c3)
    g0, g1, g2, g3 = _decode_pairs(wg1, sg)
    h0, h1, h2, h3 = _decode_pairs(wh1, sh)
    c0, c1, c2, c3 = _mma(g0, h0, g1, h1, b[4], b[5], c0, c1, c2, c3)
    c0, c1, c2, c3 = _mma(g2, h2, g3, h3, b[6], b[7], c0, c1, c2, c3)
    return c0, c1, c2, c3


@triton.jit
def _mma_tile(w, xs, c, NB: tl.constexpr):
    """One K-tile's 8 * NB mma sub-steps on a lane's loaded words (xs: NB x-row blocks' words); c:
    the 8 * NB sums, c[8h + 4 blk + i]: x rows 8h.., weight rows 16 blk.. of the warp's 32. The
    weights' decode is the same for every h (pure inline asm: computed once)."""
    for h in tl.static_range(NB):
        b = _x_pairs(xs[h])
        c0, c1, c2, c3 = _mma_rows(w[0], w[1], w[2], w[3], w[8], b, c[8 * h], c[8 * h + 1], c[8 * h + 2],
                                   c[8 * h + 3])
        c4, c5, c6, c7 = _mma_rows(w[4], w[5], w[6], w[7], w[9], b, c[8 * h + 4], c[8 * h + 5],
                                   c[8 * h + 6], c[8 * h + 7])
        c = c[:8 * h] + (c0, c1, c2, c3, c4, c5, c6, c7) + c[8 * h + 8:]
    return c


@triton.jit
def _join8(c):
    """8 (BLOCK,) tensors -> (BLOCK, 2, 2, 2), c[i] at [i & 1, (i >> 1) & 1, i >> 2]."""
    return tl.join(tl.join(tl.join(c[0], c[1]), tl.join(c[2], c[3])),
                   tl.join(tl.join(c[4], c[5]), tl.join(c[6], c[7])))


@triton.jit
def sums_tile(c, NB: tl.constexpr):
    """A lane's 8 * NB sums (_mma_tile's c) -> the (TILE_N, 8 * max(NB, 2)) fp32 tile of the
    program's 64 weight rows by x rows (columns past 8 * NB zero)."""
    zero = tl.zeros_like(c[0])
    # lane (u, g, q)'s c[i + 4 * blk + 8 * h], i = 2 * r + b, is
    # out[n = 32u + 16 blk + 8r + g, m = 8h + 2q + b]
    if NB == 4:
        acc = tl.join(tl.join(_join8(c[0:8]), _join8(c[8:16])), tl.join(_join8(c[16:24]), _join8(c[24:32])))
        acc = tl.reshape(acc, (_WARPS, 8, 4, 2, 2, 2, 2, 2))  # (u, g, q, b, r, blk, h % 2, h // 2)
        acc = tl.reshape(tl.permute(acc, (0, 5, 4, 1, 7, 6, 2, 3)), (TILED_N, 32))
    else:
        if NB == 1:
            c = c + (zero, zero, zero, zero, zero, zero, zero, zero)
        acc = tl.join(_join8(c[0:8]), _join8(c[8:16]))
        acc = tl.reshape(acc, (_WARPS, 8, 4, 2, 2, 2, 2))  # (u, g, q, b, r, blk, h)
        acc = tl.reshape(tl.permute(acc, (0, 5, 4, 1, 6, 2, 3)), (TILED_N, 16))
    return acc


@triton.jit
def _step(w, xs, sw, c, wp, sp, xw_ptr, first, t, tile_end, x_rows, kq, K, LAYOUT: tl.constexpr,
          NB: tl.constexpr, EVEN_K: tl.constexpr):
    """K-tile t of the mainloop: the next tile's loads (the last tile's again at the end: an L1
    hit, never out of bounds), then this tile's mma on w, xs -> (w, xs of the next tile, sw, c)."""
    t_next = tl.minimum(t + 1, tile_end - 1)
    w1, sw, xs1 = _load_tile(wp, sp, sw, xw_ptr, first, t_next, x_rows, kq, K, LAYOUT, NB, EVEN_K)
    c = _mma_tile(w, xs, c, NB)
    return w1, xs1, sw, c


@triton.jit
def mma_mainloop(x_ptr, w_ptr, w_scale_ptr, M, K, stride_xm, pid_n, tile_begin, tile_end,
                 NB: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr = 0, N=0,
                 scale_cols=0, LAYOUT: tl.constexpr = LAYOUT_TILED):
    """fp32 (TILE_N, BLOCK_M) = 2^-7 * (W . x^T) over the K-tiles [tile_begin, tile_end) of tile row
    pid_n, block scales applied, global scale not: the contract of mainloops.dot_mainloop
    with BLOCK_N = 64, BLOCK_M = 8 * max(NB, 2) (run with WARPS = 2 warps). x bf16 (M <= 8 * NB,
    K), row stride stride_xm (even); NB: 1, 2 or 4 blocks of 8 x rows (an mma each); EVEN_K: K % 64 == 0 (no x
    masks; LAYOUT_GROUPED: K % 256 == 0). Lanes whose x row is >= M read row M - 1: its products land
    in columns nobody stores, and the loads need no mask. Each tile's loads are issued a tile
    ahead (registers double-buffered). PDL (programmatic dependent launch; the caller launches
    with it): 1, wait for the previous kernel before any load; 2, load the first tile's codes and
    scales first (constants no earlier kernel writes), then wait, then read x.
    LAYOUT_TILED: W in the tiled layout, addressed with 32-bit offsets (the launcher checks the size),
    codes on 8-byte and scales on 4-byte boundaries.
    Row-major W (N, K/2), rows on 8-byte boundaries (8-byte code loads; LAYOUT_GROUPED 16-byte ones where
    W starts on 16 bytes, as Triton specializes the pointer), N its rows (rows past N
    read row N - 1 again: products nobody stores), scales: LAYOUT_ROW_MAJOR, plain (N, K/16); LAYOUT_SWIZZLED, swizzled
    (scale_cols: the padded scale columns); LAYOUT_GROUPED, plain read a word per 4 K-tiles (K % 64 == 0, the
    scales 4-byte aligned; tile_begin a multiple of 4 and the tiles counted as 4 * cdiv(K, 256):
    _tile_offsets)."""
    i = tl.arange(0, 32 * _WARPS)
    lane = i % 32
    g = lane // 4
    q = lane % 4
    row = (i // 32) * _WARP_ROWS + g  # the first of the lane's rows in the tile
    tiles_k = tl.cdiv(K, TILED_K)
    xw_ptr = x_ptr.to(tl.pointer_type(tl.uint32))
    kq = lane_k(q, LAYOUT)
    if LAYOUT == LAYOUT_TILED:
        wp = w_ptr.to(tl.pointer_type(tl.uint32)) + row * _ROW_WORDS + 2 * q
        sp = w_scale_ptr.to(tl.pointer_type(tl.uint32)) + i  # word i: rows row + 8j, block q (tiled.py)
    else:
        wp, sp = row_major_pointers(w_ptr, w_scale_ptr, pid_n * TILED_N + row, q, N, K, scale_cols, LAYOUT)
    x_rows = lane_x_rows(g, kq, M, stride_xm, NB)
    zero = tl.zeros([32 * _WARPS], tl.float32)
    c = (zero, zero, zero, zero, zero, zero, zero, zero) * NB
    sw = (zero.to(tl.uint32),) * 12  # LAYOUT_GROUPED: the group's 4 scale words, 8 held code words
    first = pid_n * tiles_k  # + t: the tile index of K-tile t (LAYOUT_TILED)
    if PDL == 1:
        tl.extra.cuda.gdc_wait()
    _, xw, k = _tile_offsets(tile_begin, LAYOUT)
    w, sw = _load_w(wp, sp, sw, first, tile_begin, k + kq < K, LAYOUT, EVEN_K)
    if PDL == 2:
        tl.extra.cuda.gdc_wait()
    xs = _load_xs(xw_ptr, x_rows, xw, k + kq < K, NB, EVEN_K)
    # M <= 8: the loop unrolled twice, which drops the double buffer's register moves. At M = 9..16
    # unrolling holds more registers and is slower: not unrolled there (docs/gemm.md).
    if NB == 1:
        for t in tl.range(tile_begin, tile_end, loop_unroll_factor=2):
            w, xs, sw, c = _step(w, xs, sw, c, wp, sp, xw_ptr, first, t, tile_end, x_rows, kq, K, LAYOUT, NB,
                                 EVEN_K)
    else:
        for t in range(tile_begin, tile_end):
            w, xs, sw, c = _step(w, xs, sw, c, wp, sp, xw_ptr, first, t, tile_end, x_rows, kq, K, LAYOUT, NB,
                                 EVEN_K)
    return sums_tile(c, NB)

