"""Hugging Face transformers decode through backend="nvfp4", as a user runs it, bf16 in the same run.

    python benchmarks/bench_hf.py                 # Llama-3-8B shapes, 16 layers, batch 1, 128 tokens
    python benchmarks/bench_hf.py --small         # a tiny model (any device): a smoke run

A LlamaForCausalLM with random bf16 weights decodes greedily through `generate(ids,
max_new_tokens, cache_implementation="static", compile_config=CompileConfig(backend, mode=
"reduce-overhead"))` (one warm-up generate compiles, the timed ones replay). Variants:

    bf16                  backend="inductor"
    nvfp4                 backend="nvfp4" on the bf16 model (weights quantized at compile time)
    convert + nvfp4       nv.convert(model) first (W4A16), then backend="nvfp4"
    convert W4A4 + nvfp4  nv.convert(model, Config(activations="nvfp4")), then backend="nvfp4"
    convert, eager        nv.convert(model), generate without compiling (nor a static cache)
    bf16, eager           the bf16 model, generate without compiling

Columns: tokens/s (new tokens over the timed generate's wall time, median of --repeats), the
ratio to bf16, the model's own tensors in GPU memory, peak memory, CUDA-graph skips. HF's own
per-token host cost is measured in the same run as the per-token time of the same generate on a
one-layer model of hidden size 256 (its GPU work is negligible). Last, the host cost of one eager
linear: the median of 7 runs of 40 calls without a synchronize, a bf16 nn.Linear against NVFP4Linear and nv.linear (W4A16).
"""

import argparse
import gc
import statistics
import time

import torch
import triton
import transformers
from torch._dynamo.utils import counters

import nvfp4_inductor as nv

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                 num_key_value_heads=8, max_position_embeddings=1024, rope_theta=500000.0)
SMALL = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)


def build(shapes: dict, layers: int, device: str):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**shapes, num_hidden_layers=layers)
    with torch.device(device):
        return transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()


def model_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def generate_tps(model, ids, new_tokens: int, backend: str | None, repeats: int) -> tuple[float, float]:
    """-> (median tokens/s of the timed generates, seconds of the first, compiling, one)."""
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    if backend is not None:
        config = transformers.CompileConfig(backend=backend, mode="reduce-overhead")
        config._compile_all_devices = True  # (for --small on a CPU)
        kwargs.update(cache_implementation="static", compile_config=config)
    times = []
    for _ in range(repeats + 1):
        _sync(ids)
        start = time.perf_counter()
        model.generate(ids, **kwargs)
        _sync(ids)
        times.append(time.perf_counter() - start)
    return new_tokens / statistics.median(times[1:]), times[0]


def _sync(t):
    if t.is_cuda:
        torch.cuda.synchronize()


def host_us_per_call(fn, calls: int = 40, repeats: int = 7) -> float:
    """Host time a call: the median over repeats of `calls` calls without a synchronize."""
    fn()
    fn()
    times = []
    for _ in range(repeats):
        _sync(torch.empty(0, device="cuda" if torch.cuda.is_available() else "cpu"))
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    _sync(torch.empty(0, device="cuda" if torch.cuda.is_available() else "cpu"))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true", help="a tiny model: a smoke run")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes, layers = (SMALL, 2) if args.small else (LLAMA3_8B, args.layers)
    new_tokens = 8 if args.small else args.new_tokens
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"device: {name}, torch {torch.__version__}, triton {triton.__version__}, "
          f"transformers {transformers.__version__}")
    print(f"model: Llama, {layers} layers, {shapes}; batch 1, prompt {args.prompt}, {new_tokens} new tokens")
    ids = torch.randint(0, shapes["vocab_size"], (1, args.prompt), device=device)
    variants = [("bf16", None, "inductor"), ("nvfp4", None, "nvfp4"),
                ("convert + nvfp4", "bf16", "nvfp4"), ("convert W4A4 + nvfp4", "nvfp4", "nvfp4"),
                ("convert, eager", "bf16", None), ("bf16, eager", None, None)]
    rows, base = [], {}
    for label, convert, backend in variants:
        torch._dynamo.reset()
        gc.collect()  # the previous variant's model (transformers models hold reference cycles)
        model = build(shapes, layers, device)
        if convert is not None:
            nv.convert(model, nv.Config(activations=convert))
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        skips = counters["inductor"]["cudagraph_skips"]
        tps, first = generate_tps(model, ids, new_tokens, backend, args.repeats)
        peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
        row = (label, tps, model_bytes(model) / 2**30, peak, counters["inductor"]["cudagraph_skips"] - skips, first)
        rows.append(row)
        if label.startswith("bf16"):
            base["compiled" if backend else "eager"] = tps
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    torch._dynamo.reset()
    tiny = build(SMALL, 1, device)
    loop_tps, _ = generate_tps(tiny, ids.clamp(max=SMALL["vocab_size"] - 1), new_tokens, "inductor", args.repeats)
    print(f"\n{'variant':>22} {'tokens/s':>9} {'vs bf16':>8} {'model GiB':>10} {'peak GiB':>9} "
          f"{'skips':>6} {'first s':>8}")
    for label, tps, model_gib, peak, skips, first in rows:
        ref = base["eager" if "eager" in label else "compiled"]
        print(f"{label:>22} {tps:9.1f} {tps / ref:7.2f}x {model_gib:10.2f} {peak:9.2f} {skips:6d} {first:8.1f}")
    print(f"HF generate's own cost a token (1 layer, hidden 256, compiled): {1e6 / loop_tps:.0f} us")
    k, n = shapes["hidden_size"], shapes["intermediate_size"]
    x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
    with torch.device(device):
        linear = torch.nn.Linear(k, n, bias=False).to(torch.bfloat16)
    layer = nv.NVFP4Linear.from_linear(linear, "bf16")
    q = nv.quantize(linear.weight)
    with torch.no_grad():
        bf16_us = host_us_per_call(lambda: linear(x))
        layer_us = host_us_per_call(lambda: layer(x))
        nv_us = host_us_per_call(lambda: nv.linear(x, q))
    print(f"host cost of one eager linear ({n} x {k}, M = 1, no_grad): bf16 nn.Linear {bf16_us:.1f} us, "
          f"NVFP4Linear {layer_us:.1f} us ({layer_us / bf16_us:.2f}x), nv.linear {nv_us:.1f} us "
          f"({nv_us / bf16_us:.2f}x)")

if __name__ == "__main__":
    main()
