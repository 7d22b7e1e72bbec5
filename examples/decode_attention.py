"""A decode step's attention for examples/decode.py: rotary embeddings, the KV-cache write and
attention of one query position against the static cache, in one custom op.

    out = decode_attention(q, k, v, cos, sin, k_cache, v_cache, pos)

q (B, H, D), k and v (B, KVH, D): the step's projections, rotary embeddings not yet applied; cos,
sin (1, D / 2) fp32: the angles of the position (the model's tables at pos); k_cache / v_cache
(B, KVH, L, D) with H a multiple of KVH (grouped-query attention: query head h reads KV head
h // (H / KVH)); pos a (1,) int64 tensor on the device. The op rotates q and k ("rotate half", in
fp32, rounded to their dtype: apply_rope, the model's own), writes k and v into the caches
at pos (in place: the caches are the op's mutated arguments), and attends keys 0 .. pos; later
cache slots are not read (the step's causal mask, which also hides slots not written yet).
-> (B, H, D) in q's dtype: softmax(q k^T / sqrt(D)) v, scores, softmax and sums in fp32.
pos must lie in [0, L): a CPU pos outside raises ValueError; a device pos cannot be checked without
a host sync, so there the kernels write nothing and every output is NaN.

A custom op (`nvfp4_example::decode_attention`), so torch.compile keeps it whole (and re-inplaces
its cache writes: no copy of the caches); on CUDA two Triton kernels, flash-decoding style.
Program (b * KVH + j, s) of the first rotates the H / KVH query heads of KV head j and the new key,
takes keys [64 s, 64 s + 64) (the new key and value from registers at pos, the others from the
cache: each read once, two tl.dot on the tensor cores, the heads padded to 16 rows) and stores per
head its scores' max m, l = sum exp(score - m) and acc = the exp-weighted sum of the values (the
weights rounded to the cache's dtype for that product, as the matmul form rounds its
probabilities); the program whose keys hold pos writes the new key and value to the caches;
programs past pos load no keys (masked loads) and store m = -inf, l = 0. Program b * H + h of the
second combines a head's partials, out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s (M = max_s
m_s, finite: key 0 is always attended). On sm_90 both are launched with programmatic dependent
launch, as the backend's kernels are: each waits for the kernel before it before reading anything,
and lets the next one launch once its loads are issued. The position is read on the device and
nothing is allocated but the output and the partials (no state kept between calls), so the op is
capturable in a CUDA graph.
The matmul form it replaces (RoPE and the cache writes as Inductor kernels, then two batched GEMMs
and a softmax kernel over all L slots, scores and probabilities rounded to bf16) stays the
prefill's (more than one query position).
Elsewhere (CPU, or inputs the kernels do not take: kernel_applies) the op computes the same in
torch, in fp32.
"""

import math

import torch
import triton
import triton.language as tl

from nvfp4_inductor.capability import sm90_or_later

BLOCK_L = 64  # keys a program of the first kernel


@triton.jit
def _rotate(ptrs, d, c, s, D: tl.constexpr):
    """Rows at ptrs (pointers to their element 0, any shape (..., 1)) rotated "rotate half" by the
    angles with cosines c, sines s (D,: the D / 2 angles twice), in fp32, rounded to their dtype:
    x[d] c - x[d + D/2] s for d < D/2, x[d - D/2] s + x[d] c above."""
    x = tl.load(ptrs + d)
    partner = tl.load(ptrs + (d + D // 2) % D).to(tl.float32)
    sign = tl.where(d < D // 2, -1.0, 1.0)
    return (x.to(tl.float32) * c + sign * partner * s).to(x.dtype)


@triton.jit
def _partials_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, part_ptr,
                     H, KVH, L, sm_scale, stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
                     REP: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, BLOCK_L: tl.constexpr,
                     F32_DOT: tl.constexpr, PDL: tl.constexpr):
    bkv = tl.program_id(0)  # b * KVH + KV head
    s = tl.program_id(1)
    b = bkv // KVH
    j = bkv % KVH
    r = tl.arange(0, ROWS)  # the KV head's REP query heads, padded to ROWS (tl.dot: 16 at least)
    h = j * REP + tl.minimum(r, REP - 1)  # padding rows repeat the last head: stored by nobody
    d = tl.arange(0, D)
    keys = s * BLOCK_L + tl.arange(0, BLOCK_L)
    if PDL:
        tl.extra.cuda.gdc_wait()
    pos = tl.load(pos_ptr)
    c = tl.load(cos_ptr + d % (D // 2))
    sn = tl.load(sin_ptr + d % (D // 2))
    q = _rotate(q_ptr + b.to(tl.int64) * stride_qb + h[:, None] * stride_qh, d[None, :], c[None, :],
                sn[None, :], D)
    k_new = _rotate(k_ptr + b.to(tl.int64) * stride_kb + j * stride_kh, d, c, sn, D)
    v_new = tl.load(v_ptr + b.to(tl.int64) * stride_vb + j * stride_vh + d)
    rows = (bkv.to(tl.int64) * L + keys) * D
    cached = (keys < pos) & (keys < L)
    k = tl.load(k_cache_ptr + rows[:, None] + d[None, :], mask=cached[:, None], other=0.0)
    v = tl.load(v_cache_ptr + rows[:, None] + d[None, :], mask=cached[:, None], other=0.0)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    is_new = (keys == pos)[:, None]
    k = tl.where(is_new, k_new[None, :], k)
    v = tl.where(is_new, v_new[None, :], v)
    # the program whose keys hold pos writes the new key and value (no other program reads slot
    # pos); a pos outside [0, L) writes nothing and attends no key: every output NaN (unmasked,
    # pos = -1 would write before the cache: pos // BLOCK_L truncates to 0)
    in_range = (pos >= 0) & (pos < L)
    mine = (pos // BLOCK_L == s) & in_range
    slot = (bkv.to(tl.int64) * L + pos) * D + d
    tl.store(k_cache_ptr + slot, k_new, mask=mine & (d < D))
    tl.store(v_cache_ptr + slot, v_new, mask=mine & (d < D))
    valid = (keys <= pos) & (keys < L) & in_range
    if F32_DOT:  # fp32 inputs, or the Triton interpreter (no bf16 tl.dot)
        q, k, v = q.to(tl.float32), k.to(tl.float32), v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(k))  # (ROWS, BLOCK_L) fp32: exact products, fp32 sums
    scores = tl.where(valid[None, :], scores * sm_scale, float("-inf"))
    m = tl.max(scores, axis=1)
    p = tl.exp(scores - tl.where(m == float("-inf"), 0.0, m)[:, None])  # no key: all p = 0, no NaN
    if F32_DOT:
        acc = tl.dot(p, v, input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v)  # p rounded to the cache's dtype, as the matmul form does
    # partials of (b, h, s): [acc (D), m, l]
    part = part_ptr + ((b * H + h).to(tl.int64) * tl.num_programs(1) + s) * (D + 2)
    head = r < REP
    tl.store(part[:, None] + d[None, :], acc, mask=head[:, None])
    tl.store(part + D, m, mask=head)
    tl.store(part + D + 1, tl.sum(p, axis=1), mask=head)


@triton.jit
def _combine_kernel(part_ptr, out_ptr, H, stride_ob, stride_oh, SPLITS: tl.constexpr,
                    SPLITS_P2: tl.constexpr, D: tl.constexpr, PDL: tl.constexpr):
    bh = tl.program_id(0)
    d = tl.arange(0, D)
    ss = tl.arange(0, SPLITS_P2)
    ok = ss < SPLITS
    part = part_ptr + (bh * SPLITS).to(tl.int64) * (D + 2)
    if PDL:
        tl.extra.cuda.gdc_wait()
    ms = tl.load(part + ss * (D + 2) + D, mask=ok, other=float("-inf"))
    ls = tl.load(part + ss * (D + 2) + D + 1, mask=ok, other=0.0)
    accs = tl.load(part + ss[:, None] * (D + 2) + d[None, :], mask=ok[:, None], other=0.0)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    w = tl.exp(ms - tl.max(ms, axis=0))
    out = tl.sum(w[:, None] * accs, axis=0) / tl.sum(w * ls, axis=0)
    tl.store(out_ptr + (bh // H).to(tl.int64) * stride_ob + (bh % H) * stride_oh + d,
             out.to(out_ptr.dtype.element_ty))


def _check(q, k, v, cos, sin, k_cache, v_cache, pos):
    if q.dim() != 3 or k.dim() != 3 or k_cache.dim() != 4 or v.shape != k.shape or v_cache.shape != k_cache.shape:
        raise ValueError(f"decode_attention takes q (B, H, D), k and v (B, KVH, D) and caches (B, KVH, L, D); got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}, {tuple(k_cache.shape)}, "
                         f"{tuple(v_cache.shape)}")
    (batch, heads, dim), (kv_batch, kv_heads, _, kv_dim) = q.shape, k_cache.shape
    if kv_batch != batch or kv_dim != dim or heads % kv_heads or k.shape != (batch, kv_heads, dim) or dim % 2:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and the caches {tuple(k_cache.shape)} do not "
                         f"fit (same B and D, D even, k (B, KVH, D), H a multiple of KVH)")
    if pos.shape != (1,) or pos.dtype != torch.int64:
        raise ValueError(f"pos must be a (1,) int64 tensor; got {tuple(pos.shape)} {pos.dtype}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (1, dim // 2) or t.dtype != torch.float32:
            raise ValueError(f"{name} must be (1, {dim // 2}) float32 (the angles at pos); got "
                             f"{tuple(t.shape)} {t.dtype}")
    tensors = (q, k, v, cos, sin, k_cache, v_cache, pos)
    if len({t.dtype for t in (q, k, v, k_cache, v_cache)}) != 1 or len({t.device for t in tensors}) != 1:
        raise ValueError("all inputs must share a device; q, k, v and the caches a dtype")


def apply_rope(x, cos, sin):
    """x (..., D) with the pairs (x[i], x[i + D/2]) rotated ("rotate half") by the angles whose
    cos, sin (..., D/2) broadcast against x's, in fp32, rounded to x's dtype. The model's own
    (examples/decode.py: x (B, H, T, D), cos (T, D/2)) and the op's torch form's."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)


def _check_position(pos, length) -> None:
    """pos in [0, L): checked where reading it costs no host sync (a CPU pos). On the GPU the
    kernels cannot raise: a pos outside the cache writes nothing and makes every output NaN."""
    if pos.device.type == "cpu" and not 0 <= int(pos.item()) < length:
        raise ValueError(f"pos {int(pos.item())} is outside the cache's positions 0 .. {length - 1}")


def reference(q, k, v, cos, sin, k_cache, v_cache, pos):
    """The op in torch (its CPU implementation): the caches written in place, attention in fp32."""
    _check(q, k, v, cos, sin, k_cache, v_cache, pos)
    _check_position(pos, k_cache.shape[2])
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k_cache[:, :, pos] = k[:, :, None]
    v_cache[:, :, pos] = v[:, :, None]
    rep, length = q.shape[1] // k_cache.shape[1], k_cache.shape[2]
    later = (torch.arange(length, device=q.device) > pos)[:, None]  # slots not read, whatever they hold
    keys = k_cache.float().masked_fill(later, 0).repeat_interleave(rep, dim=1)  # (B, H, L, D)
    values = v_cache.float().masked_fill(later, 0).repeat_interleave(rep, dim=1)
    scores = (keys @ q.float()[..., None])[..., 0] / math.sqrt(q.shape[-1])  # (B, H, L)
    scores = scores.masked_fill(later[:, 0], float("-inf"))
    return (scores.softmax(-1)[:, :, None, :] @ values)[:, :, 0, :].to(q.dtype)


def kernel_applies(q, k, v, k_cache, v_cache, block_l=BLOCK_L) -> bool:
    """Whether the kernels take these inputs: the last dim of q, k, v contiguous, the caches
    contiguous, the head dim and block_l powers of two of at least 16 (tl.dot)."""
    return (all(t.stride(-1) == 1 for t in (q, k, v)) and k_cache.is_contiguous() and v_cache.is_contiguous()
            and all(n >= 16 and not n & (n - 1) for n in (q.shape[-1], block_l)))


def launch(q, k, v, cos, sin, k_cache, v_cache, pos, block_l=BLOCK_L, num_warps=4):
    """The Triton kernels (CUDA, or CPU tensors under TRITON_INTERPRET=1); block_l keys a program
    of the first, num_warps: of both."""
    _check(q, k, v, cos, sin, k_cache, v_cache, pos)
    if not kernel_applies(q, k, v, k_cache, v_cache, block_l):
        raise ValueError(f"the decode_attention kernels need the last dim of q, k, v and the caches "
                         f"contiguous, the head dim and block_l powers of two of at least 16; got "
                         f"{q.shape[-1]}, {block_l}")
    batch, heads, dim = q.shape
    kv_heads, length = k_cache.shape[1], k_cache.shape[2]
    _check_position(pos, length)
    cos, sin = cos.contiguous(), sin.contiguous()  # (1, D / 2): the kernel reads them packed
    splits = triton.cdiv(length, block_l)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    partials = torch.empty(batch * heads * splits * (dim + 2), dtype=torch.float32, device=q.device)
    pdl = sm90_or_later(q.device)
    rep = heads // kv_heads
    _partials_kernel[(batch * kv_heads, splits)](
        q, k, v, cos, sin, k_cache, v_cache, pos, partials, heads, kv_heads, length, 1.0 / math.sqrt(dim),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), REP=rep,
        ROWS=max(16, triton.next_power_of_2(rep)), D=dim, BLOCK_L=block_l,
        F32_DOT=q.dtype == torch.float32 or not q.is_cuda, PDL=pdl, num_warps=num_warps, launch_pdl=pdl)
    _combine_kernel[(batch * heads,)](
        partials, out, heads, out.stride(0), out.stride(1), SPLITS=splits,
        SPLITS_P2=triton.next_power_of_2(splits), D=dim, PDL=pdl, num_warps=num_warps, launch_pdl=pdl)
    return out


@torch.library.custom_op("nvfp4_example::decode_attention", mutates_args=("k_cache", "v_cache"))
def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """See the module docstring. Where the kernels do not apply (kernel_applies), the torch form."""
    if q.is_cuda and kernel_applies(q, k, v, k_cache, v_cache):
        with torch.cuda.device(q.device):  # Triton launches on the current device
            return launch(q, k, v, cos, sin, k_cache, v_cache, pos)
    return reference(q, k, v, cos, sin, k_cache, v_cache, pos)


@decode_attention.register_fake
def _(q, k, v, cos, sin, k_cache, v_cache, pos):
    _check(q, k, v, cos, sin, k_cache, v_cache, pos)
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)
