"""What each part of a decode step costs, by taking it out: bench_decode's model (8 Llama-3-8B
layers, batch 1, context 512, mode="reduce-overhead"), bf16 and NVFP4 W4A16, one variant of the
model per row, GPU time per step (CUDA events over bench_decode's loop: model call + argmax).

    python benchmarks/probe_decode_parts.py [--parts base norm_id attn_skip ...]

Parts (each changes examples/decode.py's classes for that row only; the outputs of the "_id" and
"_skip" rows are wrong on purpose, they bound what making that part free would give):
    base       the model as it is
    norm_id    RMSNorm returns its input (W4A16: no norm kernel before the GEMMs)
    attn_skip  attention returns q (RoPE and the KV-cache writes kept, the two matmuls and the
               softmax gone)
    sdpa       attention through F.scaled_dot_product_attention(mask, enable_gqa=True)
    flex       attention through flex_attention, the mask as a score_mod on the device position
    pointwise  attention as broadcast products and sums (Inductor reductions, no cuBLAS)
    argmax_in  the argmax inside the compiled step (its output cloned before the next replay)
    loop_in    the whole loop step inside the compiled step (examples/decode.py's GreedyStep): the
               token and the position are buffers the step reads, writes (the argmax) and
               advances; the loop only replays
    norm_kernel  W4A16 with Config(fuse_norms=False): each RMSNorm a kernel of its own before the
               GEMMs (the model before session 25) instead of applied by the GEMMs
    argmax2    loop_in with the argmax as two reductions (split_argmax: each 256-logit chunk's max
               and first index, then the first chunk holding the largest; the same index)
    matmul     decode steps as the prefill (Inductor's RoPE and cache writes, two matmuls and a
               softmax: the model before session 24) instead of the decode_attention op
               (examples/decode_attention.py); every other row uses the op where its attention
               is the model's own
"""

import argparse
import dataclasses
import gc
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import decode  # noqa: E402

ATTENTION = decode.Attention.forward
NORM = decode.RMSNorm.forward
GREEDY = decode.GreedyStep.forward


def _qkv(self, x, pos, cos, sin):
    """Attention.forward up to the cache writes -> q (B, H, T, D)."""
    batch, seq, _ = x.shape
    q = self.wq(x).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
    k = self.wk(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
    v = self.wv(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
    q, k = decode.apply_rope(q, cos, sin), decode.apply_rope(k, cos, sin)
    self.k_cache[:, :, pos] = k
    self.v_cache[:, :, pos] = v
    return q


def _out(self, out, x):
    batch, seq, _ = x.shape
    return self.wo(out.transpose(1, 2).reshape(batch, seq, self.heads * self.head_dim))


def attn_skip(self, x, pos, cos, sin, mask):
    return _out(self, _qkv(self, x, pos, cos, sin), x)


def attn_sdpa(self, x, pos, cos, sin, mask):
    q = _qkv(self, x, pos, cos, sin)
    return _out(self, F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask,
                                                     enable_gqa=True), x)


def attn_flex(self, x, pos, cos, sin, mask):
    from torch.nn.attention.flex_attention import flex_attention

    q = _qkv(self, x, pos, cos, sin)

    def causal(score, b, h, q_idx, kv_idx):
        return torch.where(kv_idx <= pos[q_idx], score, -float("inf"))

    return _out(self, flex_attention(q, self.k_cache, self.v_cache, score_mod=causal, enable_gqa=True), x)


def attn_pointwise(self, x, pos, cos, sin, mask):
    q = _qkv(self, x, pos, cos, sin)
    batch, seq = x.shape[:2]
    rep, max_len = self.heads // self.kv_heads, self.k_cache.shape[2]
    q = q.reshape(batch, self.kv_heads, rep * seq, 1, self.head_dim).float()
    scores = (q * self.k_cache[:, :, None].float()).sum(-1) * (1.0 / math.sqrt(self.head_dim))
    scores = scores.view(batch, self.kv_heads, rep, seq, max_len).masked_fill(~mask, float("-inf"))
    probs = scores.softmax(-1).view(batch, self.kv_heads, rep * seq, max_len, 1)
    out = (probs * self.v_cache[:, :, None].float()).sum(-2).to(x.dtype)
    return _out(self, out.view(batch, self.heads, seq, self.head_dim), x)


PARTS = {  # name -> (Attention.forward, RMSNorm.forward)
    "base": (ATTENTION, NORM), "norm_id": (ATTENTION, lambda self, x: x),
    "attn_skip": (attn_skip, NORM), "sdpa": (attn_sdpa, NORM), "flex": (attn_flex, NORM),
    "pointwise": (attn_pointwise, NORM), "argmax_in": (ATTENTION, NORM), "loop_in": (ATTENTION, NORM),
    "matmul": (ATTENTION, NORM),  # decode steps attend as the prefill does (decode_op off)
    "norm_kernel": (ATTENTION, NORM),  # W4A16 keeps Inductor's norm kernels (fuse_norms off)
    "argmax2": (ATTENTION, NORM),  # loop_in with the argmax in two reductions (split_argmax)
}


def split_argmax(logits, chunk=256):
    """argmax(-1, keepdim=True) of (B, V) in two reductions: each chunk's max and its first index,
    then the first chunk holding the largest (same index as argmax, first occurrence, NaN too)."""
    batch, vocab = logits.shape
    vals, idx = logits.view(batch, vocab // chunk, chunk).max(-1)
    best = vals.argmax(-1, keepdim=True)
    return best * chunk + idx.gather(-1, best)


def greedy_split_argmax(self):
    self.token.copy_(split_argmax(self.model(self.token, self.pos)))
    self.pos.add_(1)


class ArgmaxStep(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens, pos):
        return self.model(tokens, pos).argmax(-1, keepdim=True)


def run_steps(step, token, pos, steps, in_graph):
    for _ in range(steps):
        torch.compiler.cudagraph_mark_step_begin()
        if in_graph == "loop":  # decode.GreedyStep: it reads and advances its own buffers
            step()
            continue
        out = step(token, pos)
        token = out.clone() if in_graph else out.argmax(-1, keepdim=True)
        pos += 1
    return token


def gpu_us_per_step(step, in_graph, context, steps=64, repeats=3, loop_pos=None):
    """loop_pos: the loop_in step's position buffer (set before each run; the runs' own pos
    tensors are not read by that step)."""
    token = torch.zeros(1, 1, dtype=torch.long, device="cuda")
    run_steps(step, token, torch.zeros(1, dtype=torch.long, device="cuda"), context, in_graph)
    times = []
    for _ in range(repeats):
        pos = torch.full((1,), context, dtype=torch.long, device="cuda")
        if loop_pos is not None:
            loop_pos.fill_(context)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        run_steps(step, token, pos, steps, in_graph)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / steps)
    return sorted(times)[len(times) // 2]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS))
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--variants", nargs="+", default=["bf16", "W4A16"], choices=["bf16", "W4A16"])
    args = parser.parse_args()
    torch._dynamo.config.cache_size_limit = 64
    cfg = decode.PRESETS["llama3-8b-8layers"]
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    model = decode.build_model(cfg, args.context + 96, 1, "cuda")
    variants = {name: config for name, config in (("bf16", None), ("W4A16", decode.VARIANTS["nvfp4 W4A16"]))
                if name in args.variants}
    rows = []
    for part in args.parts:
        decode.Attention.forward, decode.RMSNorm.forward = PARTS[part]
        for layer in model.layers:
            layer.attn.decode_op = part != "matmul"
        decode.GreedyStep.forward = greedy_split_argmax if part == "argmax2" else GREEDY
        us = {}
        for name, config in variants.items():
            if part == "norm_kernel" and config is not None:
                config = dataclasses.replace(config, fuse_norms=False)
            torch._dynamo.reset()
            gc.collect()
            torch.cuda.empty_cache()
            target = {"argmax_in": ArgmaxStep, "loop_in": lambda m: decode.GreedyStep(m, 1),
                      "argmax2": lambda m: decode.GreedyStep(m, 1)}.get(
                part, lambda m: m)(model)
            step = decode.compile_variant(target, config, "reduce-overhead")
            model.setup_cache(1)
            in_graph = {"argmax_in": True, "loop_in": "loop", "argmax2": "loop"}.get(part, False)
            us[name] = gpu_us_per_step(step, in_graph, args.context,
                                       loop_pos=target.pos if in_graph == "loop" else None)
            del step
        rows.append((part, us.get("bf16", math.nan), us.get("W4A16", math.nan)))
        print(f"{part:>10}: bf16 {rows[-1][1]:7.1f} us, W4A16 {rows[-1][2]:7.1f} us per step", flush=True)
    decode.Attention.forward, decode.RMSNorm.forward = ATTENTION, NORM
    decode.GreedyStep.forward = GREEDY
    base = dict((p, (b, w)) for p, b, w in rows).get("base")
    print(f"\n{'part':>10} {'bf16 us':>8} {'W4A16 us':>9} {'x bf16':>7}" + (" | vs base: bf16 us  W4A16 us" if base else ""))
    for part, b, w in rows:
        delta = f" | {b - base[0]:+16.1f} {w - base[1]:+9.1f}" if base else ""
        print(f"{part:>10} {b:8.1f} {w:9.1f} {b / w:6.2f}x{delta}")


if __name__ == "__main__":
    main()
