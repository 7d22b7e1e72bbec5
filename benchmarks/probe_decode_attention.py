"""The decode step's attention (examples/decode_attention.py) alone, CUDA-graph timed: the op's two
kernels (rotary embeddings, cache writes, attention) at several keys-a-program / warps settings
against the form it replaced (RoPE, the cache writes, two batched GEMMs and a softmax, compiled by
Inductor), bench_decode's shapes (32 query / 8 KV heads of 128, cache of 584 slots, position 540),
batch 1 and 8. Checked against float64 first.

    python benchmarks/probe_decode_attention.py
"""

import math
import sys
from pathlib import Path

import torch
import triton
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import decode  # noqa: E402
import decode_attention  # noqa: E402

HEADS, KV_HEADS, DIM, LENGTH, POS = 32, 8, 128, 584, 540


def matmul_form(q, k, v, cos, sin, k_cache, v_cache, pos, mask):
    """examples/decode.py's prefill attention at one position (q (B, H, D), k, v (B, KVH, D))."""
    batch, rep = q.shape[0], HEADS // KV_HEADS
    q, k = (decode.apply_rope(t[:, :, None], cos, sin) for t in (q, k))
    k_cache[:, :, pos] = k
    v_cache[:, :, pos] = v[:, :, None]
    scores = (q.view(batch, KV_HEADS, rep, DIM) @ k_cache.transpose(-1, -2)).float() / math.sqrt(DIM)
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1).to(q.dtype)
    return (probs @ v_cache).view(batch, HEADS, DIM)


def main():
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    compiled = torch.compile(matmul_form, dynamic=False)
    for batch in (1, 8):
        q = torch.randn(batch, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(batch, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        angles = torch.rand(1, DIM // 2, device="cuda") * 6.3
        cos, sin = angles.cos(), angles.sin()
        k_cache, v_cache = (torch.randn(batch, KV_HEADS, LENGTH, DIM, device="cuda", dtype=torch.bfloat16)
                            for _ in range(2))
        pos = torch.tensor([POS], device="cuda")
        mask = torch.arange(LENGTH, device="cuda") <= pos
        rep = HEADS // KV_HEADS
        qr, kr = (decode.apply_rope(t[:, :, None], cos, sin)[:, :, 0] for t in (q, k))
        keys, values = (c[:, :, :POS + 1].double().repeat_interleave(rep, 1) for c in (k_cache, v_cache))
        keys[:, :, POS], values[:, :, POS] = kr.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
        scores = torch.einsum("bhd,bhld->bhl", qr.double(), keys) / DIM ** 0.5
        ref = torch.einsum("bhl,bhld->bhd", scores.softmax(-1), values)
        args = (q, k, v, cos, sin, k_cache, v_cache, pos)
        rows = [("matmul form (compiled)", lambda: compiled(*args, mask))]
        for block_l in (32, 64, 128):
            for warps in (2, 4, 8):
                rows.append((f"op, {block_l} keys, {warps} warps",
                             lambda b=block_l, w=warps: decode_attention.launch(*args, b, w)))
        print(f"batch {batch}:")
        for name, fn in rows:
            err = (fn().double() - ref).abs().max().item()
            print(f"  {name:>26}: {do_bench_cudagraph(fn, rep=200) * 1e3:7.2f} us  (max error {err:.1e})")


if __name__ == "__main__":
    main()
