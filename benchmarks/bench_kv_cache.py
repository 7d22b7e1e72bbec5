"""NVFP4 KV cache (nv.NVFP4Cache, attn_implementation "nvfp4") against the bf16 static cache, same run.

    python benchmarks/bench_kv_cache.py                      # everything below
    python benchmarks/bench_kv_cache.py --skip-e2e           # memory and attention only

1. KV memory: bytes of an NVFP4Cache against a bf16 StaticCache of the same shape (Llama-3-8B:
   8 kv heads, head_dim 128, 32 layers, batch 1, 32k tokens).
2. Decode attention, Llama-3-8B heads (32 q, 8 kv, d 128), batch 1 and 16, context 8k and 32k,
   a full cache and the boolean mask transformers passes: `nvfp4::kv_attention` (the split-KV
   kernel reading packed K/V) against torch SDPA over the bf16 cache (with that mask, and
   without one). CUDA-graph replays cycling through cache copies larger than L2 (every call reads
   HBM); medians. GB/s counts the bytes each reads (NVFP4: 76 bytes a row of 128 values, K and V;
   bf16: 256); the floor is the NVFP4 bytes over the device copy bandwidth measured here.
3. End to end: greedy decode steps of 8 Llama-3-8B-shaped layers (vocab 4096, so that the layers
   and the cache are what a token reads) at a 32k context, batch 8 and 1, caches filled directly
   (no 32k prefill), each step compiled with CUDA graphs (mode "reduce-overhead"): bf16 weights +
   bf16 static cache (Inductor), bf16 weights + NVFP4 cache (Inductor), NVFP4 weights (nv.convert,
   W4A16) + NVFP4 cache (backend "nvfp4"), NVFP4 weights + bf16 cache. tokens/s = batch x steps /
   seconds, ratios to all-bf16.
Every row runs in its own try/except: a failure prints its error and the table goes on.
"""

import argparse
import math
import time
import traceback

import torch
import triton
import transformers

import nvfp4_inductor as nv
from bench_quantize import copy_bandwidth_gbs, graph_us
from nvfp4_inductor.reference import kv_cache as layout

Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
LLAMA3_8B = dict(vocab_size=4096, hidden_size=4096, intermediate_size=14336, num_attention_heads=Q_HEADS,
                 num_key_value_heads=KV_HEADS, max_position_embeddings=40960, rope_theta=500000.0)
OPS = torch.ops.nvfp4


def cycle_us(fn, inputs) -> float:
    """Time of one fn(*x), from graph replays of calls cycling through inputs."""
    return graph_us(lambda: [fn(*x) for x in inputs], calls=20, reps=15) / len(inputs)


def copies_for(nbytes: int) -> int:
    """Copies of an input whose bytes together exceed 3x L2: cycling through them reads HBM."""
    return max(1, math.ceil(3 * torch.cuda.get_device_properties().L2_cache_size / nbytes))


def nvfp4_caches(batch: int, slots: int):
    """Filled NVFP4 K and V caches (random keys and values, written by nvfp4::kv_write)."""
    k_cache = torch.empty(layout.cache_shape(batch, KV_HEADS, slots, HEAD_DIM), dtype=torch.uint8, device="cuda")
    v_cache = torch.empty_like(k_cache)
    for start in range(0, slots, 4096):
        n = min(4096, slots - start)
        k = torch.randn(batch, KV_HEADS, n, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        OPS.kv_write(k, torch.randn_like(k), k_cache, v_cache, torch.arange(start, start + n, device="cuda"))
    return k_cache, v_cache


def memory_row() -> None:
    config = transformers.LlamaConfig(**{**LLAMA3_8B, "num_hidden_layers": 32})
    slots = 32768
    cache = nv.NVFP4Cache(config, max_batch_size=1, max_cache_len=slots, device="cuda")
    ours = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    bf16 = 32 * 2 * KV_HEADS * slots * HEAD_DIM * 2  # StaticCache: K and V, (1, H, T, D) bf16, 32 layers
    print(f"KV memory, Llama-3-8B, 32 layers, batch 1, {slots} tokens: NVFP4Cache {ours / 2**30:.2f} GiB, "
          f"bf16 StaticCache {bf16 / 2**30:.2f} GiB, ratio {ours / bf16:.3f}")
    del cache


def attention_rows(batches, contexts, copy_gbs: float) -> None:
    print(f"\nDecode attention, {Q_HEADS} q / {KV_HEADS} kv heads, d {HEAD_DIM} (CUDA graphs, medians)")
    print(f"{'batch':>5} {'context':>7} {'variant':>22} {'us':>9} {'GB/s':>7} {'vs SDPA':>8} {'% floor':>8}")
    scale = HEAD_DIM**-0.5
    for batch in batches:
        for slots in contexts:
            try:
                nvfp4_bytes = 2 * batch * KV_HEADS * slots * layout.row_bytes(HEAD_DIM)
                bf16_bytes = 2 * batch * KV_HEADS * slots * HEAD_DIM * 2
                floor_us = nvfp4_bytes / copy_gbs / 1e3
                q = torch.randn(batch, Q_HEADS, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
                mask = torch.ones(batch, 1, 1, slots, dtype=torch.bool, device="cuda")
                results = {}
                bf16_caches = [(torch.randn(batch, KV_HEADS, slots, HEAD_DIM, device="cuda", dtype=torch.bfloat16),
                                torch.randn(batch, KV_HEADS, slots, HEAD_DIM, device="cuda", dtype=torch.bfloat16))
                               for _ in range(copies_for(bf16_bytes))]
                for name, attn_mask in (("SDPA bf16, mask", mask), ("SDPA bf16, no mask", None)):
                    results[name] = (cycle_us(lambda k, v, m=attn_mask: torch.nn.functional.scaled_dot_product_attention(
                        q, k, v, attn_mask=m, scale=scale, enable_gqa=True), bf16_caches), bf16_bytes)
                del bf16_caches
                caches = [nvfp4_caches(batch, slots) for _ in range(copies_for(nvfp4_bytes))]
                results["NVFP4 kv_attention"] = (cycle_us(lambda k, v: OPS.kv_attention(q, k, v, mask, scale), caches),
                                                 nvfp4_bytes)
                del caches
                base = results["SDPA bf16, mask"][0]
                for name, (us, nbytes) in results.items():
                    floor = f"{100 * floor_us / us:7.1f}%" if name.startswith("NVFP4") else ""
                    print(f"{batch:>5} {slots:>7} {name:>22} {us:9.1f} {nbytes / us / 1e3:7.0f} {base / us:7.2f}x {floor:>8}")
                print(f"{'':>5} {'':>7} {'NVFP4 bytes floor':>22} {floor_us:9.1f}")
            except Exception as error:  # one row's failure must not end the table
                print(f"{batch:>5} {slots:>7} FAILED: {type(error).__name__}: {str(error)[:300]}")
                traceback.print_exc(limit=3)
            torch.cuda.empty_cache()


def cache_kw(model, cache) -> dict:
    import inspect

    name = "cache" if "cache" in inspect.signature(model.model.forward).parameters else "past_key_values"
    return {name: cache}


def filled_cache(model, kind: str, batch: int, slots: int, filled: int):
    """A cache for `model` holding `filled` random tokens (written directly, no prefill)."""
    if kind == "nvfp4":
        cache = nv.NVFP4Cache(model.config, max_batch_size=batch, max_cache_len=slots, device="cuda")
        for layer in cache.layers:
            for start in range(0, filled, 4096):
                n = min(4096, filled - start)
                k = torch.randn(batch, KV_HEADS, n, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
                OPS.kv_write(k, torch.randn_like(k), layer.keys, layer.values,
                             torch.arange(start, start + n, device="cuda"))
            layer.cumulative_length.fill_(filled)
            layer.written = filled
        return cache
    cache = transformers.StaticCache(config=model.config, max_cache_len=slots)
    cache.early_initialization(batch, KV_HEADS, HEAD_DIM, torch.bfloat16, torch.device("cuda"))
    for layer in cache.layers:
        layer.keys[:, :, :filled].normal_()
        layer.values[:, :, :filled].normal_()
        layer.cumulative_length.fill_(filled)
    return cache


def decode_tps(model, step, kind: str, batch: int, slots: int, steps: int) -> float:
    """Tokens/s of `steps` compiled decode steps (after 3 warm-up steps) at a context of ~slots."""
    cache = filled_cache(model, kind, batch, slots, slots - steps - 8)
    tokens = torch.randint(0, LLAMA3_8B["vocab_size"], (batch, 1), device="cuda")
    with torch.no_grad():
        for _ in range(3):
            step(input_ids=tokens, **cache_kw(model, cache), use_cache=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            step(input_ids=tokens, **cache_kw(model, cache), use_cache=True)
        torch.cuda.synchronize()
    return batch * steps / (time.perf_counter() - start)


def e2e_rows(batches, slots: int, steps: int) -> None:
    print(f"\nEnd to end: decode, 8 Llama-3-8B layers, context {slots} (compiled, CUDA graphs)")
    print(f"{'batch':>5} {'weights':>8} {'cache':>6} {'tokens/s':>9} {'vs bf16':>8}")
    config = transformers.LlamaConfig(**{**LLAMA3_8B, "num_hidden_layers": 8})
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(config).to(device="cuda", dtype=torch.bfloat16).eval()
    bf16_tps = {}
    for weights in ("bf16", "nvfp4"):
        if weights == "nvfp4":
            nv.convert(base)
        for batch in batches:
            for kind in ("bf16", "nvfp4") if weights == "bf16" else ("nvfp4", "bf16"):
                w = weights
                try:
                    base.set_attn_implementation("nvfp4" if kind == "nvfp4" else "sdpa")
                    torch._dynamo.reset()
                    if weights == "bf16":
                        step = torch.compile(base, mode="reduce-overhead")
                    else:
                        step = nv.compile(base, mode="reduce-overhead")
                    tps = decode_tps(base, step, kind, batch, slots, steps)
                    if (w, kind) == ("bf16", "bf16"):
                        bf16_tps[batch] = tps
                    ref = bf16_tps.get(batch)
                    ratio = f"{tps / ref:7.2f}x" if ref else ""
                    print(f"{batch:>5} {w:>8} {kind:>6} {tps:9.1f} {ratio:>8}")
                except Exception as error:
                    print(f"{batch:>5} {w:>8} {kind:>6} FAILED: {type(error).__name__}: {str(error)[:300]}")
                    traceback.print_exc(limit=3)
                torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16], help="decode attention batches")
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--e2e-batches", type=int, nargs="+", default=[8, 1])
    parser.add_argument("--e2e-context", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps")
    parser.add_argument("--skip-e2e", action="store_true")
    args = parser.parse_args()
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}, "
          f"transformers {transformers.__version__}")
    copy_gbs = copy_bandwidth_gbs()
    print(f"device copy: {copy_gbs:.0f} GB/s (read + write)")
    for section in (memory_row, lambda: attention_rows(args.batches, args.contexts, copy_gbs),
                    None if args.skip_e2e else lambda: e2e_rows(args.e2e_batches, args.e2e_context, args.steps)):
        if section is None:
            continue
        try:
            section()
        except Exception as error:
            print(f"FAILED: {type(error).__name__}: {str(error)[:300]}")
            traceback.print_exc(limit=3)


if __name__ == "__main__":
    main()
