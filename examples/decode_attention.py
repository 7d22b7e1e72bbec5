"""Attention of one query position against a static KV cache, for examples/decode.py's decode step.

    out = decode_attention(q, k_cache, v_cache, pos)

q (B, H, D) (the step's queries, RoPE applied), k_cache / v_cache (B, KVH, L, D) with H a multiple
of KVH (grouped-query attention: query head h reads KV head h // (H / KVH)), pos a (1,) int64 tensor
on the device: keys 0 .. pos are attended, later cache slots are not read (the causal mask of the
step, which also hides slots not written yet). -> (B, H, D) in q's dtype: softmax(q k^T / sqrt(D)) v,
scores, softmax and sums in fp32.

A custom op (`nvfp4_example::decode_attention`), so torch.compile keeps it whole: on CUDA two
Triton kernels, flash-decoding style. Program (b * KVH + j, s) of the first takes the H / KVH query
heads of KV head j against keys [64 s, 64 s + 64) (each key and value read once, two tl.dot on
the tensor cores, the heads padded to 16 rows): per head its scores, their max m, l = sum
exp(score - m) and acc = the exp-weighted sum of the values (the weights rounded to the cache's
dtype for that product, as the matmul form rounds its probabilities), stored as partials;
programs past pos load nothing (masked loads) and store m = -inf, l = 0. Program b * H + h of the
second combines a head's partials, out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s (M = max_s
m_s, finite: key 0 is always attended). On sm_90 both are launched with programmatic dependent
launch, as the backend's kernels are: each waits for the kernel before it before reading anything,
and lets the next one launch once its loads are issued. The position is read on the device and
nothing is allocated but the output and the partials (no state kept between calls), so the op is
capturable in a CUDA graph. H100, batch 1 / 8, bench_decode's shapes (benchmarks/probe_decode_attention.py):
see benchmarks/NOTES.md, session 24.
The matmul form it replaces (two batched GEMMs and a softmax kernel over all L slots, scores and
probabilities rounded to bf16) stays the prefill's (more than one query position).
Elsewhere (CPU, or a head dim the kernels do not take) the op computes the same in torch, in fp32.
"""

import math

import torch
import triton
import triton.language as tl

from nvfp4_inductor.kernels.gemm_configs import sm90_or_later

BLOCK_L = 64  # keys a program of the first kernel


@triton.jit
def _partials_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, part_ptr, H, KVH, L, sm_scale, stride_qb, stride_qh,
                     REP: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, BLOCK_L: tl.constexpr,
                     F32_DOT: tl.constexpr, PDL: tl.constexpr):
    bkv = tl.program_id(0)  # b * KVH + KV head
    s = tl.program_id(1)
    b = bkv // KVH
    r = tl.arange(0, ROWS)  # the KV head's REP query heads, padded to ROWS (tl.dot: 16 at least)
    h = (bkv % KVH) * REP + r
    d = tl.arange(0, D)
    keys = s * BLOCK_L + tl.arange(0, BLOCK_L)
    if PDL:
        tl.extra.cuda.gdc_wait()
    valid = (keys <= tl.load(pos_ptr)) & (keys < L)
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + h[:, None] * stride_qh + d[None, :],
                mask=(r < REP)[:, None], other=0.0)
    rows = (bkv.to(tl.int64) * L + keys) * D
    k = tl.load(k_ptr + rows[:, None] + d[None, :], mask=valid[:, None], other=0.0)
    v = tl.load(v_ptr + rows[:, None] + d[None, :], mask=valid[:, None], other=0.0)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
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


def _check(q, k_cache, v_cache, pos):
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"decode_attention takes q (B, H, D) and caches (B, KVH, L, D) of one shape; got "
                         f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    (batch, heads, dim), (kv_batch, kv_heads, _, kv_dim) = q.shape, k_cache.shape
    if kv_batch != batch or kv_dim != dim or heads % kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)} (same B and D, "
                         f"H a multiple of KVH)")
    if pos.shape != (1,) or pos.dtype != torch.int64:
        raise ValueError(f"pos must be a (1,) int64 tensor; got {tuple(pos.shape)} {pos.dtype}")
    if len({q.dtype, k_cache.dtype, v_cache.dtype}) != 1 or len({q.device, k_cache.device, pos.device}) != 1:
        raise ValueError("q, the caches and pos must share a device; q and the caches a dtype")


def reference(q, k_cache, v_cache, pos):
    """The op in torch, fp32 (its CPU implementation)."""
    _check(q, k_cache, v_cache, pos)
    rep, length = q.shape[1] // k_cache.shape[1], k_cache.shape[2]
    later = (torch.arange(length, device=q.device) > pos)[:, None]  # slots not read, whatever they hold
    k = k_cache.float().masked_fill(later, 0).repeat_interleave(rep, dim=1)  # (B, H, L, D)
    v = v_cache.float().masked_fill(later, 0).repeat_interleave(rep, dim=1)
    scores = (k @ q.float()[..., None])[..., 0] / math.sqrt(q.shape[-1])  # (B, H, L)
    scores = scores.masked_fill(later[:, 0], float("-inf"))
    return (scores.softmax(-1)[:, :, None, :] @ v)[:, :, 0, :].to(q.dtype)


def kernel_applies(q, k_cache, v_cache, block_l=BLOCK_L) -> bool:
    """Whether the kernels take these inputs: q's last dim and the caches contiguous, the head dim
    and block_l powers of two of at least 16 (tl.dot)."""
    dim = q.shape[-1]
    return (q.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
            and all(n >= 16 and not n & (n - 1) for n in (dim, block_l)))


def launch(q, k_cache, v_cache, pos, block_l=BLOCK_L, num_warps=4):
    """The Triton kernels (CUDA, or CPU tensors under TRITON_INTERPRET=1); block_l keys a program
    of the first, num_warps: of both."""
    _check(q, k_cache, v_cache, pos)
    if not kernel_applies(q, k_cache, v_cache, block_l):
        raise ValueError(f"the decode_attention kernels need q's last dim and the caches contiguous, the "
                         f"head dim and block_l powers of two of at least 16; got {q.shape[-1]}, {block_l}")
    batch, heads, dim = q.shape
    kv_heads, length = k_cache.shape[1], k_cache.shape[2]
    splits = triton.cdiv(length, block_l)
    out = torch.empty_like(q)
    partials = torch.empty(batch * heads * splits * (dim + 2), dtype=torch.float32, device=q.device)
    pdl = sm90_or_later(q.device)
    rep = heads // kv_heads
    _partials_kernel[(batch * kv_heads, splits)](
        q, k_cache, v_cache, pos, partials, heads, kv_heads, length, 1.0 / math.sqrt(dim), q.stride(0),
        q.stride(1), REP=rep, ROWS=max(16, triton.next_power_of_2(rep)), D=dim, BLOCK_L=block_l,
        F32_DOT=q.dtype == torch.float32 or not q.is_cuda, PDL=pdl, num_warps=num_warps, launch_pdl=pdl)
    _combine_kernel[(batch * heads,)](
        partials, out, heads, out.stride(0), out.stride(1), SPLITS=splits,
        SPLITS_P2=triton.next_power_of_2(splits), D=dim, PDL=pdl, num_warps=num_warps, launch_pdl=pdl)
    return out


@torch.library.custom_op("nvfp4_example::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     pos: torch.Tensor) -> torch.Tensor:
    """See the module docstring. Where the kernels do not apply (kernel_applies), the torch form."""
    if q.is_cuda and kernel_applies(q, k_cache, v_cache):
        return launch(q, k_cache, v_cache, pos)
    return reference(q, k_cache, v_cache, pos)


@decode_attention.register_fake
def _(q, k_cache, v_cache, pos):
    _check(q, k_cache, v_cache, pos)
    return torch.empty_like(q)
