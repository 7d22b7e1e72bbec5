"""The NVFP4 KV cache's kernels: the write (quantize new keys and values into their slots) and
decode attention that reads the packed cache directly (split-KV, "flash-decoding").

The cache layout is reference/kv_cache.py's: per layer and side one (B, H, T, R) uint8 tensor
whose planes are data (B, H, T, D/2), scale bits (B, H, T, D/16) and g fp32 (B, H, T); the
launchers take the planes, row i = (b * H + h) * T + t of each.

Write. Program (b * H + h, s-tile) loads ROWS tokens of x[b, h] (keys, then values) as pair words,
takes each row's finite amax -> g = amax / 2688, quantizes the row with it (kernels/quantize's
element step, bit-exact with reference.quantize(per_row=True)) and stores codes, scales and g at
row (b * H + h) * T + positions[s]. Positions outside [0, T) write nothing. One launch a layer and
step for both sides; nothing is read back to the host.

Decode attention, q (B, Hq, 1, D) with Hq = GROUP * H (grouped-query attention):
  1. Program (b * H + j, split) owns kv head j's GROUP query heads (padded to ROWS >= 16 rows for
     tl.dot) and the slots [split * L, (split + 1) * L). It first reads the split's mask bytes to
     find its last attended slot, so slots past the sequence's end (a static cache is mostly empty
     early on) cost neither loads nor math. Then, BLOCK_N slots at a time, it loads their packed
     codes, e4m3 scale bytes and global scales, decodes codes * block scale in registers
     (device/mainloops.decode_tile, the skinny GEMM's word decode: e2m1 * s * 2^-7, exact in bf16),
     and multiplies:
         scores (BLOCK_N, ROWS) = decode(K) . q^T * g_k * scale (in log2 units, exp2 softmax)
         acc    (ROWS, D)      += (p * g_v)^T . decode(V)         (online softmax, fp32 sums)
     The per-row global scales multiply scores and probabilities, never the decoded tile. Decoded
     keys and values exist only in registers: nothing but partials is written.
  2. Program b * Hq + h combines its head's splits: out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s.
A query that attends no slot gets zeros. Partials are (B * Hq, SPLITS, D + 2) fp32: acc, m, l.

On the GPU the products take bf16 operands (q rounded to bf16, p * g_v rounded to bf16 as a matmul
over bf16 probabilities does) with fp32 accumulation. The Triton interpreter (CPU tests) has no
bf16 tl.dot: there the decode yields fp32 and the dots run in fp32 (input_precision "ieee").
"""

import math

import torch
import triton
import triton.language as tl

from nvfp4_inductor import capability
from nvfp4_inductor.format import BLOCK_SIZE
from nvfp4_inductor.kernels.device.common import finite_abs, global_scale_from_amax, load_pair_words, split_pair_words
from nvfp4_inductor.kernels.device.mainloops import decode_tile
from nvfp4_inductor.kernels.quantize import quantize_pairs

LOG2E = math.log2(math.e)
DECODE_UNSCALE = 128.0  # decode_tile's values carry 2^-7
DECODE_UNSCALE_: tl.constexpr = tl.constexpr(DECODE_UNSCALE)

# Write: tokens a program (prefill writes many, decode one per (b, h)).
WRITE_ROWS = 16
# Decode attention: slots a step, warps, mask bytes read at a time when looking for a split's end,
# and programs per SM the split count aims at. Starting points, not tuned on a device
# (benchmarks/bench_kv_cache.py measures them).
BLOCK_N = 64
NUM_WARPS = 4
MASK_CHUNK = 1024
PROGRAMS_PER_SM = 4
MIN_ROWS = 16  # tl.dot's smallest M: the query heads of a kv head are padded to it


@triton.jit
def _write_rows(x_ptr, stride_s, s, ok, dst, data_ptr, scale_ptr, g_ptr,
                D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, USE_ASM: tl.constexpr):
    """Rows s (ROWS,) of one (b, h) of x (pair words at x_ptr + s * stride_s) -> NVFP4 with a
    per-row g at cache rows dst (int64), where ok."""
    pair_cols = tl.arange(0, BLOCK_D // 2)
    pair_ok = pair_cols < D // 2
    words = load_pair_words(x_ptr, (s.to(tl.int64) * (stride_s // 2))[:, None] + pair_cols[None, :],
                            ok[:, None] & pair_ok[None, :])
    even, odd = split_pair_words(words, x_ptr.dtype.element_ty)
    g = global_scale_from_amax(tl.max(tl.maximum(finite_abs(even), finite_abs(odd)), axis=1))
    packed, bits = quantize_pairs(words, g[:, None], x_ptr.dtype.element_ty, USE_ASM, ROWS, BLOCK_D)
    packed = tl.reshape(packed.to(tl.uint8), (ROWS, BLOCK_D // 2))
    tl.store(data_ptr + dst[:, None] * (D // 2) + pair_cols[None, :], packed, mask=ok[:, None] & pair_ok[None, :])
    blocks = tl.arange(0, BLOCK_D // 16)
    tl.store(scale_ptr + dst[:, None] * (D // 16) + blocks[None, :], bits.to(tl.uint8),
             mask=ok[:, None] & (blocks < D // 16)[None, :])
    tl.store(g_ptr + dst, g, mask=ok)


@triton.jit
def _write_kernel(
    # pointers
    k_ptr, v_ptr, pos_ptr, k_data_ptr, k_scale_ptr, k_g_ptr, v_data_ptr, v_scale_ptr, v_g_ptr,
    # sizes
    H, S, T,
    # strides (elements; all even)
    stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    # meta-parameters
    D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, USE_ASM: tl.constexpr,
):
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    s = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    slot = tl.load(pos_ptr + s, mask=s < S, other=-1).to(tl.int64)
    ok = (s < S) & (slot >= 0) & (slot < T)
    dst = bh.to(tl.int64) * T + tl.where(ok, slot, 0)
    _write_rows(k_ptr + b.to(tl.int64) * stride_kb + h * stride_kh, stride_ks, s, ok, dst,
                k_data_ptr, k_scale_ptr, k_g_ptr, D, BLOCK_D, ROWS, USE_ASM)
    _write_rows(v_ptr + b.to(tl.int64) * stride_vb + h * stride_vh, stride_vs, s, ok, dst,
                v_data_ptr, v_scale_ptr, v_g_ptr, D, BLOCK_D, ROWS, USE_ASM)


def _pair_strides(x: torch.Tensor) -> torch.Tensor:
    """x (B, H, S, D) as the write reads it: last dim contiguous, other strides even, starting on an
    element pair; otherwise a contiguous copy."""
    if x.stride(-1) != 1 or any(st % 2 for st in x.stride()[:-1]) or x.data_ptr() % (2 * x.element_size()):
        x = x.contiguous()
    return x


def write(key, value, k_planes, v_planes, positions) -> None:
    """key, value (B', H, S, D) bf16 / fp16 / fp32 -> quantized into slots positions (S,) of the
    planes (data, scale bits, g) of two caches, sequences 0 .. B'-1 (checked by the op)."""
    batch, heads, seq, dim = key.shape
    if batch * heads * seq == 0:
        return
    key, value = _pair_strides(key), _pair_strides(value)
    slots = k_planes[0].shape[2]
    use_asm = capability.sm90_or_later(key.device)
    grid = (batch * heads, triton.cdiv(seq, WRITE_ROWS))
    _write_kernel[grid](
        key, value, positions.contiguous(), *k_planes, *v_planes,
        heads, seq, slots, *key.stride()[:3], *value.stride()[:3],
        D=dim, BLOCK_D=max(triton.next_power_of_2(dim), BLOCK_SIZE), ROWS=WRITE_ROWS, USE_ASM=use_asm,
        num_warps=1 if seq == 1 else 4,
    )


@triton.jit
def _attention_partials_kernel(
    # pointers
    q_ptr, k_data_ptr, k_scale_ptr, k_g_ptr, v_data_ptr, v_scale_ptr, v_g_ptr, mask_ptr, part_ptr,
    # sizes
    H, T, kv_limit, slots_per_split,
    # strides
    stride_qb, stride_qh, stride_mb, stride_mt,
    # scores' factor: softmax scale * log2(e) * 2^7
    qk_scale,
    # meta-parameters
    GROUP: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr, MASK_CHUNK: tl.constexpr,
    USE_ASM: tl.constexpr, OPERAND: tl.constexpr,
):
    bh = tl.program_id(0)  # b * H + kv head
    split = tl.program_id(1)
    b = bh // H
    j = bh % H
    r = tl.arange(0, ROWS)
    head = j * GROUP + tl.minimum(r, GROUP - 1)  # padding rows repeat the last head: stored by nobody
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + head[:, None] * stride_qh + d[None, :],
                mask=d_ok[None, :], other=0.0).to(OPERAND)

    # The split's slots, and the end of those the mask attends (none attended: an empty loop).
    lo = split * slots_per_split
    hi = tl.minimum(lo + slots_per_split, kv_limit)
    if HAS_MASK:
        mask_row = mask_ptr + b.to(tl.int64) * stride_mb
        end = lo
        for c in range(lo, hi, MASK_CHUNK):
            n = c + tl.arange(0, MASK_CHUNK)
            attended = tl.load(mask_row + n * stride_mt, mask=n < hi, other=0) != 0
            end = tl.maximum(end, tl.max(tl.where(attended, n + 1, 0), axis=0))
        hi = end

    pair_cols = tl.arange(0, BLOCK_D // 2)
    block_cols = tl.arange(0, BLOCK_D // 16)
    rows0 = bh.to(tl.int64) * T
    m = tl.full((ROWS,), float("-inf"), tl.float32)
    l = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, BLOCK_D), tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        valid = n < hi
        if HAS_MASK:
            valid &= tl.load(mask_row + n * stride_mt, mask=valid, other=0) != 0
        rows = rows0 + n
        # codes loaded as rows of D/2 contiguous bytes (16-byte vectors), viewed as (slots, blocks, 8)
        code_ok = valid[:, None] & (pair_cols < D // 2)[None, :]
        scale_ok = valid[:, None] & (block_cols < D // 16)[None, :]
        k_packed = tl.load(k_data_ptr + rows[:, None] * (D // 2) + pair_cols[None, :], mask=code_ok, other=0)
        k_bits = tl.load(k_scale_ptr + rows[:, None] * (D // 16) + block_cols[None, :], mask=scale_ok, other=0)
        k_g = tl.load(k_g_ptr + rows, mask=valid, other=0.0)
        v_packed = tl.load(v_data_ptr + rows[:, None] * (D // 2) + pair_cols[None, :], mask=code_ok, other=0)
        v_bits = tl.load(v_scale_ptr + rows[:, None] * (D // 16) + block_cols[None, :], mask=scale_ok, other=0)
        v_g = tl.load(v_g_ptr + rows, mask=valid, other=0.0)
        k_packed = tl.reshape(k_packed, (BLOCK_N, BLOCK_D // 16, 8))
        v_packed = tl.reshape(v_packed, (BLOCK_N, BLOCK_D // 16, 8))

        keys = decode_tile(k_packed, k_bits, USE_ASM, OPERAND, BLOCK_N, BLOCK_D)  # (BLOCK_N, BLOCK_D)
        if OPERAND == tl.float32:
            scores = tl.dot(keys, tl.trans(q), input_precision="ieee")
        else:
            scores = tl.dot(keys, tl.trans(q))  # (BLOCK_N, ROWS) fp32
        scores = tl.where(valid[:, None], scores * (k_g * qk_scale)[:, None], float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing attended yet: no NaN
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(scores - m_safe[None, :])
        l = l * alpha + tl.sum(p, axis=0)
        values = decode_tile(v_packed, v_bits, USE_ASM, OPERAND, BLOCK_N, BLOCK_D)
        pv = tl.trans(p * v_g[:, None]).to(OPERAND)  # (ROWS, BLOCK_N)
        if OPERAND == tl.float32:
            acc = acc * alpha[:, None] + tl.dot(pv, values, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(pv, values)
        m = m_new

    # partials of (b, head, split): [acc (D), m, l]
    part = part_ptr + ((b * (H * GROUP) + head).to(tl.int64) * tl.num_programs(1) + split) * (D + 2)
    is_head = r < GROUP
    tl.store(part[:, None] + d[None, :], acc * DECODE_UNSCALE_, mask=is_head[:, None] & d_ok[None, :])
    tl.store(part + D, m, mask=is_head)
    tl.store(part + D + 1, l, mask=is_head)


@triton.jit
def _combine_kernel(part_ptr, out_ptr, HQ, stride_ob, stride_oh, SPLITS: tl.constexpr,
                    SPLITS_P2: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr):
    bh = tl.program_id(0)  # b * Hq + head
    d = tl.arange(0, BLOCK_D)
    ss = tl.arange(0, SPLITS_P2)
    ok = ss < SPLITS
    part = part_ptr + (bh * SPLITS).to(tl.int64) * (D + 2)
    ms = tl.load(part + ss * (D + 2) + D, mask=ok, other=float("-inf"))
    ls = tl.load(part + ss * (D + 2) + D + 1, mask=ok, other=0.0)
    accs = tl.load(part + ss[:, None] * (D + 2) + d[None, :], mask=ok[:, None] & (d < D)[None, :], other=0.0)
    top = tl.max(ms, axis=0)
    w = tl.exp2(ms - tl.where(top == float("-inf"), 0.0, top))
    total = tl.sum(w * ls, axis=0)
    out = tl.sum(w[:, None] * accs, axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + (bh // HQ).to(tl.int64) * stride_ob + (bh % HQ) * stride_oh + d,
             out.to(out_ptr.dtype.element_ty), mask=d < D)


def default_splits(programs: int, slots: int, device: torch.device) -> int:
    """Splits of the slots per (sequence, kv head) so that about PROGRAMS_PER_SM programs run per SM."""
    wanted = triton.cdiv(capability.sm_count(device) * PROGRAMS_PER_SM, programs)
    return max(1, min(wanted, triton.cdiv(slots, BLOCK_N)))


def decode_attention(query, k_planes, v_planes, mask, scale: float, splits: int | None = None):
    """query (B', Hq, 1, D), the caches' planes, mask (B', T) bool or None (slot 0 only: the
    causal rule of reference.kv_cache.attention) -> (B', Hq, 1, D) in query's dtype (checked by
    the op). splits: the slot ranges per (sequence, kv head); default_splits when None."""
    batch, q_heads, _, dim = query.shape
    if query.stride(-1) != 1:
        query = query.contiguous()
    heads, slots = k_planes[0].shape[1], k_planes[0].shape[2]
    group = q_heads // heads
    out = torch.empty((batch, q_heads, 1, dim), dtype=query.dtype, device=query.device)
    if batch == 0:
        return out
    if splits is None:
        splits = default_splits(batch * heads, slots, query.device)
    slots_per_split = triton.cdiv(triton.cdiv(slots, splits), BLOCK_N) * BLOCK_N
    splits = triton.cdiv(slots, slots_per_split)
    part = torch.empty((batch * q_heads, splits, dim + 2), dtype=torch.float32, device=query.device)
    if mask is None:
        mask_arg, stride_mb, stride_mt, kv_limit = part, 0, 0, 1
    else:
        mask_arg, (stride_mb, stride_mt), kv_limit = mask.view(torch.uint8), mask.stride(), slots
    use_asm = capability.sm90_or_later(query.device)
    block_d = max(triton.next_power_of_2(dim), BLOCK_SIZE)
    _attention_partials_kernel[(batch * heads, splits)](
        query, *k_planes, *v_planes, mask_arg, part,
        heads, slots, kv_limit, slots_per_split,
        query.stride(0), query.stride(1), stride_mb, stride_mt,
        scale * LOG2E * DECODE_UNSCALE,
        GROUP=group, ROWS=max(MIN_ROWS, triton.next_power_of_2(group)), D=dim, BLOCK_D=block_d,
        BLOCK_N=BLOCK_N, HAS_MASK=mask is not None, MASK_CHUNK=MASK_CHUNK,
        USE_ASM=use_asm, OPERAND=tl.bfloat16 if use_asm else tl.float32, num_warps=NUM_WARPS,
    )
    _combine_kernel[(batch * q_heads,)](
        part, out, q_heads, out.stride(0), out.stride(1), SPLITS=splits,
        SPLITS_P2=triton.next_power_of_2(splits), D=dim, BLOCK_D=block_d, num_warps=1,
    )
    return out
