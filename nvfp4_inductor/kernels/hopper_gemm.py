"""Hopper (sm_90) W4A16 GEMM in Gluon: y = x @ W^T * g (+ bias), x bf16 (M, K), W NVFP4 in the
layout of nvfp4_inductor.reference.hopper, or (TILED) in the tiled layout the backend and the
split-K kernels read (reference/tiled.py), for M from a few tens of rows to thousands.

Swapped form: the kernel computes y^T = W . x^T. A program owns ROWS weight rows (wgmma's M side,
64 a warpgroup) and BLOCK_T tokens (wgmma's N, 8..256), so a small M wastes no MMA rows.

    acc[r, t] = sum_k  decode(W)[n0 + r, k] * x[t0 + t, k]          (fp32, wgmma)
    y[t0 + t, n0 + r] = acc[r, t] * (g * 2^UNSCALE_LOG2) (+ bias[n0 + r])

decode(W) = e2m1 * s * 2^-UNSCALE_LOG2, exact in bf16 (reference.hopper: per 4 bf16x2 words,
11 shift / mask operations, 2 integer multiply-adds for the scale pairs, 4 mul.bf16x2).

Warp-specialized: three partitions of one program run concurrently and hand K-steps of BLOCK_K to
each other through shared memory, behind mbarriers.
  load   (worker, 1 warp, LOAD_REGS registers a thread): per K-step, TMA copies of x's
         (BLOCK_T, BLOCK_K) tile (128-byte swizzle: wgmma's B operand, read transposed), the codes'
         (BLOCK_K / 64, 2 ROWS, 4) int32 box and the scales' (BLOCK_K / 64, 2 ROWS) int16 box into
         slot i % STAGES of a ring.
  decode (worker, ROWS / 16 warps, DECODE_REGS registers): reads a slot's codes and scales (one
         16-byte load a lane a 64-wide chunk), decodes them in registers in wgmma's A-fragment
         layout (the layout's purpose: no shuffles) and stores the bf16 (ROWS, BLOCK_K) tile into
         slot i % A_STAGES of a second ring of 128-byte-swizzled tiles.
  mma    (default, num_warps = ROWS / 16, one warpgroup per 64 rows): wgmma with A = the decoded
         tile and B = x^T, both from shared memory, issued asynchronously and waited with one
         group left in flight, so the tensor cores multiply step i while the decoder works on
         the next steps and the loader on steps up to i + STAGES - 1.
TILED: the loader copies (ROWS / 64 tiles, BLOCK_K, 32 bytes) of codes and the tiles' scale
words; the decoder reads a 16-k block (two words, one scale) a thread, decodes codes i and i + 4 of
a word into one bf16x2 at a time (e2m1 * 2^-126 by shift and mask, times the scale's bf16x2
s * 2^119: device/mma.py's values), and stores its 16 values of a row, in order, to the A tile;
the epilogue undoes 2^-7 instead of 2^-20.
REGISTER_A (tiled weights only): no decode partition and no A ring. The mma partition's warps
read the code and scale bytes each thread multiplies straight into wgmma's A-fragment layout (byte
q of each word of its two rows: a byte's two codes are k and k + 1 of the fragment's pair), decode
step i into registers while step i - 1's wgmma runs, and issue wgmma with A from registers. A
step's A registers are a dependency of the next wait (warpgroup_mma_wait's deps), so they stay
live until that wgmma has retired: without it, the next step's decode may reuse them under an
in-flight wgmma (an earlier register-A form, without the dependency, gave wrong results). The
loader releases a slot after mma's wgmma of that step retired (load_empty count 1).

mbarrier protocol (phases alternate; a waiter of round r = i // ring-size waits for parity r & 1,
a producer for the slot's previous round, parity (r & 1) ^ 1, which a fresh barrier passes):
  load_ready[s]  count 1 + TMA bytes: step i's x, codes and scales are in slot s = i % STAGES.
                 Waited by decode (codes, scales) and by mma (x).
  load_empty[s]  count 2: decode has read step i's codes and scales into registers, and mma's
                 wgmma of step i has finished reading x. The loader refills slot s with step
                 i + STAGES only after both.
  a_ready[a]     count 1: the decoded tile of step i is in A slot a = i % A_STAGES.
  a_empty[a]     count 1: mma's wgmma of step i has finished reading A slot a; decode writes step
                 i + A_STAGES there only after it.
Invariants that make this safe:
  - mma releases step i - 1's x slot and A slot right after warpgroup_mma_wait(1) in step i: at
    most one wgmma group (step i) is in flight, so step i - 1's has retired. Step steps - 1's
    slots are never released; nothing waits for them.
  - every arrive from a multi-warp partition follows a partition-wide bar.sync (the compiler puts
    it there, the arrive being one thread's; tests/helpers/compile_hopper.py checks the PTX), so
    all its warps have finished their shared-memory reads, writes or wgmma waits first. Before an arrive that hands shared memory
    to the async proxy (TMA writes, wgmma reads), decode also fences (fence.proxy.async).
  - no barrier can run a full phase ahead of a waiter: a slot is refilled only after both of its
    consumers arrived for the previous step there, so the parity a consumer waits for is never
    ambiguous.
  - at least one K-step (steps >= 1): the accumulator then always comes out of a wgmma, and
    ptxas keeps the wgmma asynchronous (a zero-trip path makes it serialize them, C7515).
Tiles past M, N or K are zero-filled by TMA (the layout pads N to 64 rows and K to 64); the
epilogue, on the mma partition's warps after the warp-specialized region, masks its stores.

SPLIT: a tile's K-steps are shared by `splits` consecutive programs; each stores its partial tile
(fp32) to a workspace, and the last to arrive at the tile's counter (a barrier, then one acq_rel
atomic; it zeroes the counter again) sums the partials in split order and runs the epilogue.
Programs are ordered in groups of GROUP_N weight tiles: consecutive programs share x's tile and a
wave covers few weight tiles many times, so at large M each weight tile comes from HBM about once.
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from nvfp4_inductor.kernels.device.common import TILED_K, TILED_N
from nvfp4_inductor.kernels import plan
from nvfp4_inductor.kernels.gemm_configs import HopperConfig
from nvfp4_inductor.kernels.launch import split_counters
from nvfp4_inductor.reference import hopper as layout
from nvfp4_inductor.reference.tiled import TILE_K, TILE_N, tiled_shapes

# int32 masks, written signed (Gluon constants are int32)
_PAIR_MASK = gl.constexpr(0x81C081C0 - (1 << 32))  # magnitudes at bits 6..8, 22..24; signs 15, 31
_MAG_MASK = gl.constexpr(0x01C001C0)
_SIGN_MASK = gl.constexpr(0x80008000 - (1 << 32))
_SCALE_SPREAD = gl.constexpr(0x00100010)  # S -> S << 4 | S << 20
_SCALE_EXPONENT = gl.constexpr(0x70007000)  # exponent field + 224, both halves
_CHUNK_K = gl.constexpr(layout.CHUNK_K)
_UNSCALE = gl.constexpr(float(2**layout.UNSCALE_LOG2))  # the decode's 2^-20 undone
# the tiled layout's decode (the split-K kernels' values, device/mma.py): e2m1 * 2^-126 times
# s * 2^119 is e2m1 * s * 2^-7, undone in the epilogue
_TILED_SCALE_UP = gl.constexpr(float(2**119))
_TILED_UNSCALE = gl.constexpr(float(2**7))


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
                 BLOCK_K: gl.constexpr, WARPS: gl.constexpr):
    """A slot's codes (BLOCK_K/64, 2 ROWS, 4) and scale pairs (BLOCK_K/64, 2 ROWS) -> bf16
    (ROWS, BLOCK_K) in a_layout (wgmma's A-fragment layout over WARPS = ROWS / 16 warps),
    e2m1 * s * 2^-UNSCALE_LOG2."""
    KC: gl.constexpr = BLOCK_K // _CHUNK_K
    # (kc, 8 rg + g, q, w): lane 4 g + q, warps along rg, a lane's 4 words of a chunk contiguous
    words_layout: gl.constexpr = gl.BlockedLayout([1, 1, 1, 4], [1, 8, 4, 1], [1, WARPS, 1, 1], [3, 2, 1, 0])
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
def _tiled_pair(w, mult, left: gl.constexpr, sign_left: gl.constexpr):
    """Codes i and i + 4 of each word (natural order: nibble i is k offset i) -> their bf16x2,
    e2m1 * 2^-126 each (magnitude to bits 6..8, sign to 15; +16), times mult. A negative shift
    is a right shift (arithmetic: the sign bits it brings in fall outside the masks)."""
    if left >= 0:
        mag = (w << left) & _MAG_MASK
    else:
        mag = (w >> -left) & _MAG_MASK
    if sign_left > 0:
        sign = (w << sign_left) & _SIGN_MASK
    else:
        sign = w & _SIGN_MASK
    return _mul_bf16x2(mag | sign, mult)


@gluon.jit
def _decode_tiled_step(codes_smem, scales_smem, ROWS: gl.constexpr, BLOCK_K: gl.constexpr,
                       WARPS: gl.constexpr):
    """A slot of the tiled layout (reference/tiled.py): codes (ROWS / 64, BLOCK_K, 8) int32 (weight
    tile, K-tile * 64 + row, word) and scale words (ROWS / 64, BLOCK_K) (weight tile, K-tile * 64 +
    word) -> bf16 (ROWS, BLOCK_K), e2m1 * s * 2^-7, a thread 16 consecutive k of a row."""
    R64: gl.constexpr = ROWS // TILED_N
    KT: gl.constexpr = BLOCK_K // TILED_K
    # (weight tile, K-tile, row, 16-k block c, word of the block): a thread a block's two words
    words_layout: gl.constexpr = gl.BlockedLayout([1, 1, 1, 1, 2], [1, 1, 8, 4, 1], [1, 1, WARPS, 1, 1],
                                                  [4, 3, 2, 1, 0])
    w = codes_smem.reshape([R64, KT, TILED_N, 4, 2]).load(words_layout)
    # a tile's scale word 32 a + 4 g + c holds byte j of row 32 a + 8 j + g, block c
    scale_layout: gl.constexpr = gl.BlockedLayout([1, 1, 1, 1, 1], [1, 1, 2, 4, 4], [1, 1, 1, WARPS, 1],
                                                  [4, 3, 2, 1, 0])
    sw = scales_smem.reshape([R64, KT, 2, 8, 4]).load(scale_layout)
    # join(join(a, b), join(c, d))[..., y, x] is (a, b, c, d)[2 x + y]: bytes j = 2 y + x
    sb = gl.join(gl.join(sw & 0xFF, (sw >> 16) & 0xFF), gl.join((sw >> 8) & 0xFF, (sw >> 24) & 0xFF))
    sb = gl.reshape(sb, [R64, KT, 2, 8, 4, 4])  # (a, g, c, j)
    sb = gl.reshape(gl.permute(sb, [0, 1, 2, 5, 3, 4]), [R64, KT, TILED_N, 4])  # (row 32 a + 8 j + g, c)
    sb = gl.convert_layout(sb, gl.SliceLayout(4, words_layout))
    # e4m3 bits -> bf16x2 (s, s) * 2^119 (exact; NaN stays NaN, a negative scale negative)
    s = (sb.to(gl.uint8).to(gl.float8e4nv, bitcast=True).to(gl.float32) * _TILED_SCALE_UP).to(gl.bfloat16)
    s = s.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    mult, _ = gl.broadcast(gl.expand_dims(s | (s << 16), 4), w)
    # pairs (i, i + 4), i = 0..3 (joined so that i = 2 y + x) -> (row, c, word, e, y, x):
    # k = 16 c + 8 word + 4 e + i, in order
    v = gl.join(gl.join(_bf16_pair(_tiled_pair(w, mult, 6, 12)), _bf16_pair(_tiled_pair(w, mult, -2, 4))),
                gl.join(_bf16_pair(_tiled_pair(w, mult, 2, 8)), _bf16_pair(_tiled_pair(w, mult, -6, 0))))
    v = gl.reshape(v, [R64, KT, TILED_N, TILED_K])
    return gl.reshape(gl.permute(v, [0, 2, 1, 3]), [ROWS, BLOCK_K])


@gluon.constexpr_function
def _basis(dim: int, value: int) -> list[int]:
    """A 6-D linear-layout basis vector: `value` along `dim`."""
    return [value if d == dim else 0 for d in range(6)]


@gluon.constexpr_function
def _regs_layout(R64, KT):
    """(weight tile, K-tile, row, 16-k block c, word h of the block, byte q of the word) -> the
    threads of wgmma's A fragment over ROWS / 16 warps: lane 4 g + q holds rows g and g + 8 of
    its warp's 16 at k = 16 c + 8 h + 2 q (+ 1, the byte's two codes), registers in the
    fragment's order (row + 8, k + 8, the next 16-k blocks, the next K-tile)."""
    regs = [_basis(2, 8), _basis(4, 1), _basis(3, 1), _basis(3, 2)] + ([_basis(1, 1)] if KT == 2 else [])
    lanes = [_basis(5, 1), _basis(5, 2), _basis(2, 1), _basis(2, 2), _basis(2, 4)]
    warps = [_basis(2, 16), _basis(2, 32)] + ([_basis(0, 1)] if R64 == 2 else [])
    return gl.DistributedLinearLayout(regs, lanes, warps, [], [R64, KT, TILED_N, 4, 2, 4])


@gluon.constexpr_function
def _regs_scale_layout(R64, KT):
    """The tiled layout's scale bytes viewed as (weight tile, K-tile, a, j, g, c) (row 32 a + 8 j +
    g, block c: reference/tiled.scale_index) -> the threads of _regs_layout that multiply them."""
    regs = [_basis(3, 1), _basis(5, 1), _basis(5, 2)] + ([_basis(1, 1)] if KT == 2 else [])
    lanes = [[0] * 6, [0] * 6, _basis(4, 1), _basis(4, 2), _basis(4, 4)]
    warps = [_basis(3, 2), _basis(2, 1)] + ([_basis(0, 1)] if R64 == 2 else [])
    return gl.DistributedLinearLayout(regs, lanes, warps, [], [R64, KT, 2, 4, 8, 4])


@gluon.jit
def _decode_tiled_regs(codes_smem, scales_smem, a_layout: gl.constexpr, ROWS: gl.constexpr,
                       BLOCK_K: gl.constexpr):
    """A slot of the tiled layout (as _decode_tiled_step reads it) -> bf16 (ROWS, BLOCK_K) in
    a_layout, wgmma's A-fragment registers, e2m1 * s * 2^-7: each thread loads the code bytes and
    scale bytes it multiplies (byte q of each word of its two rows) and decodes a byte's two codes
    (k and k + 1) into one bf16x2."""
    R64: gl.constexpr = ROWS // TILED_N
    KT: gl.constexpr = BLOCK_K // TILED_K
    layout: gl.constexpr = _regs_layout(R64, KT)
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [5, 4, 3, 2, 1, 0])
    b = codes_smem._reinterpret(gl.uint8, [R64, KT, TILED_N, 4, 2, 4], flat).load(layout).to(gl.int32)
    sb = scales_smem._reinterpret(gl.uint8, [R64, KT, 2, 8, 4, 4], flat).permute((0, 1, 2, 5, 3, 4))
    sb = sb.load(_regs_scale_layout(R64, KT))
    sb = gl.reshape(sb, [R64, KT, TILED_N, 4])
    sb = gl.convert_layout(sb, gl.SliceLayout(4, gl.SliceLayout(5, layout)), assert_trivial=True)
    s = (sb.to(gl.float8e4nv, bitcast=True).to(gl.float32) * _TILED_SCALE_UP).to(gl.bfloat16)
    s = s.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    mult = gl.expand_dims(gl.expand_dims(s | (s << 16), 4), 5)
    mult, _ = gl.broadcast(mult, b)
    # the byte's low code to bits 0..3, its high one to 16..19; magnitudes to bf16 bits 6..8 and
    # 22..24, signs to 15 and 31: e2m1 * 2^-126 each
    d = b | (b << 12)
    p = _mul_bf16x2(((d << 6) & _MAG_MASK) | ((d << 12) & _SIGN_MASK), mult)
    v = _bf16_pair(p)  # (weight tile, K-tile, row, c, h, q, e): k = 64 K-tile + 16 c + 8 h + 2 q + e
    v = gl.reshape(gl.permute(v, [0, 2, 1, 3, 4, 5, 6]), [ROWS, BLOCK_K])
    return gl.convert_layout(v, a_layout, assert_trivial=True)


@gluon.jit
def _tile_ids(M, N, ROWS: gl.constexpr, BLOCK_T: gl.constexpr, GROUP_N: gl.constexpr, splits):
    """Program id -> (weight tile, token tile): groups of GROUP_N weight tiles, tokens inside, each
    tile's `splits` programs consecutive."""
    pid = gl.program_id(0) // splits
    tiles_n = gl.cdiv(N, ROWS)
    tiles_t = gl.cdiv(M, BLOCK_T)
    per_group = GROUP_N * tiles_t
    first_n = (pid // per_group) * GROUP_N
    group_size = gl.minimum(tiles_n - first_n, GROUP_N)
    in_group = pid % per_group
    return first_n + in_group % group_size, in_group // group_size


@gluon.jit
def _load_partition(x_desc, codes_desc, scales_desc, x_bufs, codes_bufs, scales_bufs, load_ready, load_empty,
                    t0, n0, first, steps, STAGES: gl.constexpr, TILED: gl.constexpr):
    """TMA of K-steps first .. first + steps - 1 into slot i % STAGES, once its previous contents
    are released."""
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    KC: gl.constexpr = BLOCK_K // _CHUNK_K
    nbytes: gl.constexpr = x_desc.block_type.nbytes + codes_desc.block_type.nbytes + scales_desc.block_type.nbytes
    for i in range(steps):
        slot = i % STAGES
        mbarrier.wait(load_empty.index(slot), ((i // STAGES) & 1) ^ 1)
        bar = load_ready.index(slot)
        mbarrier.expect(bar, nbytes)
        step = first + i
        tma.async_copy_global_to_shared(x_desc, [t0, step * BLOCK_K], bar, x_bufs.index(slot))
        if TILED:  # (weight tile, K-tile * 64 + row, word), (weight tile, K-tile * 64 + scale word)
            tma.async_copy_global_to_shared(codes_desc, [n0 // TILED_N, step * BLOCK_K, 0], bar,
                                            codes_bufs.index(slot))
            tma.async_copy_global_to_shared(scales_desc, [n0 // TILED_N, step * BLOCK_K], bar,
                                            scales_bufs.index(slot))
        else:
            tma.async_copy_global_to_shared(codes_desc, [step * KC, 2 * n0, 0], bar, codes_bufs.index(slot))
            tma.async_copy_global_to_shared(scales_desc, [step * KC, 2 * n0], bar, scales_bufs.index(slot))


@gluon.jit
def _decode_partition(codes_bufs, scales_bufs, a_bufs, load_ready, load_empty, a_ready, a_empty, steps,
                      STAGES: gl.constexpr, A_STAGES: gl.constexpr, DECODE_WARPS: gl.constexpr,
                      TILED: gl.constexpr):
    """Codes + scales of slot i % STAGES -> the bf16 W tile in A slot i % A_STAGES."""
    ROWS: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    # wgmma's A-fragment layout over this partition's warps (16 rows a warp); the stores below
    # write it into the swizzled tile the mma partition's wgmma reads
    frag_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[DECODE_WARPS, 1],
                                                          instr_shape=[16, 64, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=frag_layout, k_width=2)
    for i in range(steps):
        slot = i % STAGES
        mbarrier.wait(load_ready.index(slot), (i // STAGES) & 1)
        if TILED:
            a = _decode_tiled_step(codes_bufs.index(slot), scales_bufs.index(slot), ROWS, BLOCK_K, DECODE_WARPS)
        else:
            a = _decode_step(codes_bufs.index(slot), scales_bufs.index(slot), a_layout, ROWS, BLOCK_K,
                             DECODE_WARPS)
        # the codes and scales are in registers: release them to the next TMA (async proxy)
        fence_async_shared()
        mbarrier.arrive(load_empty.index(slot), count=1)
        a_slot = i % A_STAGES
        mbarrier.wait(a_empty.index(a_slot), ((i // A_STAGES) & 1) ^ 1)
        a_bufs.index(a_slot).store(a)
        fence_async_shared()  # generic-proxy stores, then wgmma's (async proxy) reads
        mbarrier.arrive(a_ready.index(a_slot), count=1)


@gluon.jit
def _mma_partition(x_bufs, a_bufs, load_ready, load_empty, a_ready, a_empty, steps,
                   STAGES: gl.constexpr, A_STAGES: gl.constexpr, acc_layout: gl.constexpr):
    """acc = sum over K-steps of wgmma(A slot, x slot^T), one group in flight; -> (acc, )."""
    ROWS: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_T: gl.constexpr = x_bufs.type.shape[1]
    acc = gl.zeros([ROWS, BLOCK_T], gl.float32, acc_layout)
    for i in range(steps):
        slot = i % STAGES
        a_slot = i % A_STAGES
        mbarrier.wait(load_ready.index(slot), (i // STAGES) & 1)
        mbarrier.wait(a_ready.index(a_slot), (i // A_STAGES) & 1)
        acc = warpgroup_mma(a_bufs.index(a_slot), x_bufs.index(slot).permute((1, 0)), acc, use_acc=i > 0,
                            is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        # step i - 1's wgmma has retired: its x slot and its A slot are free
        prev = gl.maximum(i - 1, 0)
        mbarrier.arrive(load_empty.index(prev % STAGES), count=1, pred=i > 0)
        mbarrier.arrive(a_empty.index(prev % A_STAGES), count=1, pred=i > 0)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    return (acc, )  # the default partition's results: a tuple


@gluon.jit
def _mma_decode_partition(x_bufs, codes_bufs, scales_bufs, load_ready, load_empty, steps, STAGES: gl.constexpr,
                          acc_layout: gl.constexpr):
    """Register A (tiled layout): the warps that issue wgmma decode step i into A registers while
    step i - 1's wgmma runs; acc = sum over K-steps of wgmma(A, x slot^T), one group in flight.
    A step's registers stay live (a dependency of the next wait) until its wgmma has retired."""
    ROWS: gl.constexpr = codes_bufs.type.shape[1] * TILED_N
    BLOCK_T: gl.constexpr = x_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = x_bufs.type.shape[2]
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    acc = gl.zeros([ROWS, BLOCK_T], gl.float32, acc_layout)
    mbarrier.wait(load_ready.index(0), 0)
    a_prev = _decode_tiled_regs(codes_bufs.index(0), scales_bufs.index(0), a_layout, ROWS, BLOCK_K)
    acc = warpgroup_mma(a_prev, x_bufs.index(0).permute((1, 0)), acc, use_acc=False, is_async=True)
    acc, a_prev = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a_prev))  # (the accumulator as a tensor)
    for i in range(1, steps):
        slot = i % STAGES
        mbarrier.wait(load_ready.index(slot), (i // STAGES) & 1)
        a = _decode_tiled_regs(codes_bufs.index(slot), scales_bufs.index(slot), a_layout, ROWS, BLOCK_K)
        acc = warpgroup_mma(a, x_bufs.index(slot).permute((1, 0)), acc, is_async=True)
        acc, a_prev = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a_prev))
        # step i - 1's wgmma has retired: its slot (x, codes, scales) is free
        mbarrier.arrive(load_empty.index((i - 1) % STAGES), count=1)
        a_prev = a
    acc, a_prev = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a_prev))
    return (acc, )


@gluon.jit
def hopper_w4a16_kernel(
    x_desc, codes_desc, scales_desc,  # TMA descriptors: x (M, K) bf16, the layout's codes and scales
    w_global_scale_ptr, bias_ptr, out_ptr,  # fp32 g (one, or one a row), bias (N,), out (M, N)
    partial_ptr, counter_ptr,  # SPLIT: fp32 (tiles, splits, ROWS, BLOCK_T) partial sums, int32 zeros a tile
    M, N, stride_om, splits, steps_per_split,
    TILED: gl.constexpr, SPLIT: gl.constexpr, W_GLOBAL_SCALE_PER_ROW: gl.constexpr, HAS_BIAS: gl.constexpr,
    STAGES: gl.constexpr,
    GROUP_N: gl.constexpr, num_warps: gl.constexpr,
    A_STAGES: gl.constexpr, DECODE_WARPS: gl.constexpr, LOAD_REGS: gl.constexpr, DECODE_REGS: gl.constexpr,
    REGISTER_A: gl.constexpr,
):
    BLOCK_T: gl.constexpr = x_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    ROWS: gl.constexpr = codes_desc.block_type.shape[0] * TILED_N if TILED else codes_desc.block_type.shape[1] // 2
    K = x_desc.shape[1]

    # SPLIT: a tile's splits are consecutive programs, each K-steps [first, first + steps)
    pid_n, pid_t = _tile_ids(M, N, ROWS, BLOCK_T, GROUP_N, splits)
    tile = pid_n * gl.cdiv(M, BLOCK_T) + pid_t
    pid_s = gl.program_id(0) % splits
    n0 = pid_n * ROWS
    t0 = pid_t * BLOCK_T

    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    codes_bufs = gl.allocate_shared_memory(codes_desc.dtype, [STAGES] + codes_desc.block_type.shape,
                                           codes_desc.layout)
    scales_bufs = gl.allocate_shared_memory(scales_desc.dtype, [STAGES] + scales_desc.block_type.shape,
                                            scales_desc.layout)
    load_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    load_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(load_ready.index(i), count=1)
        mbarrier.init(load_empty.index(i), count=1 if REGISTER_A else 2)  # (decode and) mma
    if not REGISTER_A:
        a_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, BLOCK_K], gl.bfloat16)
        a_bufs = gl.allocate_shared_memory(gl.bfloat16, [A_STAGES, ROWS, BLOCK_K], a_smem_layout)
        a_ready = gl.allocate_shared_memory(gl.int64, [A_STAGES, 1], mbarrier.MBarrierLayout())
        a_empty = gl.allocate_shared_memory(gl.int64, [A_STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(A_STAGES):
            mbarrier.init(a_ready.index(i), count=1)
            mbarrier.init(a_empty.index(i), count=1)
    fence_async_shared()

    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_T, 16])
    # at least one step: with a zero-trip path the accumulator's zeros would reach the final wait
    # outside wgmma, and ptxas serializes every wgmma (C7515)
    first = pid_s * steps_per_split
    steps = gl.maximum(gl.minimum(steps_per_split, gl.cdiv(K, BLOCK_K) - first), 1)
    if REGISTER_A:
        results = gl.warp_specialize([
            (_mma_decode_partition, (x_bufs, codes_bufs, scales_bufs, load_ready, load_empty, steps, STAGES,
                                     acc_layout)),
            (_load_partition, (x_desc, codes_desc, scales_desc, x_bufs, codes_bufs, scales_bufs, load_ready,
                               load_empty, t0, n0, first, steps, STAGES, TILED)),
        ], [1], [LOAD_REGS])
    else:
        results = gl.warp_specialize([
            (_mma_partition, (x_bufs, a_bufs, load_ready, load_empty, a_ready, a_empty, steps, STAGES, A_STAGES,
                              acc_layout)),
            (_load_partition, (x_desc, codes_desc, scales_desc, x_bufs, codes_bufs, scales_bufs, load_ready,
                               load_empty, t0, n0, first, steps, STAGES, TILED)),
            (_decode_partition, (codes_bufs, scales_bufs, a_bufs, load_ready, load_empty, a_ready, a_empty, steps,
                                 STAGES, A_STAGES, DECODE_WARPS, TILED)),
        ], [1, DECODE_WARPS], [LOAD_REGS, DECODE_REGS])
    acc = results[0]

    # epilogue (the mma partition's warps): each thread 8 consecutive output columns (16-byte stores)
    out_layout: gl.constexpr = gl.BlockedLayout([8, 1], [8, 4], [1, num_warps], [0, 1])
    y = gl.convert_layout(acc, out_layout)
    r = gl.arange(0, ROWS, gl.SliceLayout(1, out_layout))
    t = gl.arange(0, BLOCK_T, gl.SliceLayout(0, out_layout))
    if SPLIT:
        # store this split's partial tile; the last split of the tile to arrive sums them all, in
        # split order (the same bits whatever the arrival order)
        in_tile = t[None, :] * ROWS + r[:, None]  # a thread's 8 rows: one 32-byte store
        tile_partials = partial_ptr + tile.to(gl.int64) * splits * (ROWS * BLOCK_T)
        gl.store(tile_partials + pid_s * (ROWS * BLOCK_T) + in_tile, y)
        gl.thread_barrier()  # every thread's stores before the release
        arrived = gl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == splits - 1:
            gl.store(counter_ptr + tile, 0)  # zeros again for the next launch
            y = gl.zeros([ROWS, BLOCK_T], gl.float32, out_layout)
            for j in range(splits):
                y += gl.load(tile_partials + j * (ROWS * BLOCK_T) + in_tile, cache_modifier=".cg")
            _finish(y, n0 + r, t0 + t, M, N, w_global_scale_ptr, bias_ptr, out_ptr, stride_om, TILED,
                    W_GLOBAL_SCALE_PER_ROW, HAS_BIAS)
    else:
        _finish(y, n0 + r, t0 + t, M, N, w_global_scale_ptr, bias_ptr, out_ptr, stride_om, TILED,
                W_GLOBAL_SCALE_PER_ROW, HAS_BIAS)


@gluon.jit
def _finish(y, rows, tokens, M, N, w_global_scale_ptr, bias_ptr, out_ptr, stride_om, TILED: gl.constexpr,
            W_GLOBAL_SCALE_PER_ROW: gl.constexpr, HAS_BIAS: gl.constexpr):
    """(ROWS, BLOCK_T) fp32 sums of decoded weights times x -> out[tokens, rows] = y * unscale * g
    + bias, masked to M tokens and N rows."""
    row_ok = rows < N
    if W_GLOBAL_SCALE_PER_ROW:
        g = gl.load(w_global_scale_ptr + rows, mask=row_ok, other=0.0)[:, None]
    else:
        g = gl.load(w_global_scale_ptr)
    if TILED:
        y = y * (g * _TILED_UNSCALE)
    else:
        y = y * (g * _UNSCALE)
    if HAS_BIAS:
        y = y + gl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(gl.float32)[:, None]
    offsets = tokens.to(gl.int64)[None, :] * stride_om + rows[:, None]
    mask = row_ok[:, None] & (tokens < M)[None, :]
    gl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)


def descriptor_layouts(config: HopperConfig, tiled: bool = False):
    """-> the shared-memory layouts of x's, the codes' and the scales' TMA boxes, and the boxes:
    reference.hopper's layout, or (tiled) reference.tiled's viewed as int32 (N_pad / 64, K_pad, 8)
    codes and (N_pad / 64, K_pad) scale words."""
    x_box = [config.block_t, config.block_k]
    if tiled:
        codes_box = [config.rows // TILE_N, config.block_k, 8]
        scales_box = [config.rows // TILE_N, config.block_k]
    else:
        kc = config.block_k // layout.CHUNK_K
        codes_box = [kc, 2 * config.rows, 4]
        scales_box = [kc, 2 * config.rows]
    return ((gl.NVMMASharedLayout.get_default_for(x_box, gl.bfloat16), x_box),
            (gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3), codes_box),
            (gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32 if tiled else 16, rank=2), scales_box))


def kernel_constexprs(config: HopperConfig) -> dict:
    """The kernel's tile constexprs of a config (the TMA boxes carry the tile sizes)."""
    return {"STAGES": config.stages, "GROUP_N": config.group_n, "num_warps": config.num_warps,
            "A_STAGES": config.a_stages, "DECODE_WARPS": config.decode_warps, "LOAD_REGS": config.load_regs,
            "DECODE_REGS": config.decode_regs, "REGISTER_A": config.register_a}


def _weight_tensors(w_codes, w_scales, n, k, tiled):
    """The weights as the descriptors read them, checked -> (codes, scales, N rows at most)."""
    if tiled:
        k_pad = -(-k // TILE_K) * TILE_K
        rows = w_codes.numel() * 2 // k_pad if w_codes.dim() == 1 else 0
        if (w_codes.dtype != torch.uint8 or w_scales.dtype != torch.uint8 or w_codes.dim() != 1 or rows % TILE_N
                or tiled_shapes(rows, k) != (tuple(w_codes.shape), tuple(w_scales.shape))):
            raise ValueError(f"w_codes, w_scales must be the tiled layout's 1-D uint8 tensors for K = {k} "
                             "(nvfp4::tile_weight)")
        if n is None or n > rows:
            raise ValueError(f"give n (the weight's rows, at most {rows}) with tiled weights")
        return (w_codes.view(torch.int32).view(rows // TILE_N, k_pad, 8),
                w_scales.view(torch.int32).view(rows // TILE_N, k_pad), rows)
    chunks, rows2 = w_scales.shape
    if w_codes.shape != (chunks, rows2, 4) or w_codes.dtype != torch.int32 or w_scales.dtype != torch.int16:
        raise ValueError("w_codes, w_scales must be reference.hopper.pack's int32 and int16 tensors")
    if not k <= chunks * layout.CHUNK_K < k + layout.CHUNK_K or (n is not None and n > rows2 // 2):
        raise ValueError(f"weights packed for K = {chunks * layout.CHUNK_K}, N <= {rows2 // 2}; x has K = {k}")
    return w_codes, w_scales, rows2 // 2


def hopper_linear(x, w_codes, w_scales, w_global_scale, bias=None, out_dtype=torch.bfloat16,
                  config: HopperConfig | None = None, n: int | None = None, tiled: bool = False,
                  splits: int | None = None):
    """x (M, K) bf16, W of N rows as reference.hopper.pack's (codes, scales), or (tiled) as
    reference.tiled's 1-D (codes, scale bits) with n given, g fp32 () or (N,), bias (N,) or None
    -> (M, N) out_dtype: x @ W^T * g + bias. The tiles and the split of K are plan.hopper_launch's
    (config, splits: a caller's own, checked there): K is split when the output tiles are too few
    to fill the GPU."""
    if x.dim() != 2 or x.dtype != torch.bfloat16:
        raise ValueError(f"x must be a 2-D bf16 tensor, got {tuple(x.shape)} {x.dtype}")
    m, k = x.shape
    if k % 16:
        raise ValueError(f"x's K = {k} is not a multiple of 16")
    w_codes, w_scales, rows = _weight_tensors(w_codes, w_scales, n, k, tiled)
    n = rows if n is None else n
    per_row = w_global_scale.dim() == 1
    if per_row and w_global_scale.shape != (n,):
        raise ValueError(f"a per-row global scale must have shape ({n},)")
    launch = plan.hopper_launch(m, n, k, x.device, config, splits, tiled)
    config, splits, tiles = launch.config, launch.splits, launch.tiles
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        x = x.contiguous()
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    (x_layout, x_box), (codes_layout, codes_box), (scales_layout, scales_box) = descriptor_layouts(config, tiled)
    x_desc = TensorDescriptor(x, list(x.shape), list(x.stride()), x_box, x_layout)
    codes_desc = TensorDescriptor.from_tensor(w_codes, codes_box, codes_layout)
    scales_desc = TensorDescriptor.from_tensor(w_scales, scales_box, scales_layout)
    g = w_global_scale.to(torch.float32).contiguous()
    if splits > 1:
        partials = torch.empty(tiles * splits * config.rows * config.block_t, dtype=torch.float32, device=x.device)
        counters = split_counters(x.device, tiles)
    else:
        partials = counters = g
    hopper_w4a16_kernel[launch.grid](
        x_desc, codes_desc, scales_desc, g, bias if bias is not None else g, out, partials, counters,
        m, n, out.stride(0), splits, launch.steps_per_split,
        TILED=tiled, SPLIT=splits > 1, W_GLOBAL_SCALE_PER_ROW=per_row, HAS_BIAS=bias is not None,
        **kernel_constexprs(config))
    return out
