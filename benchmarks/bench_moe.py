"""One mixture-of-experts layer's experts (gate_up, SiLU * up, down, the routing's weighted sum):
NVFP4 (nvfp4_inductor.moe.NVFP4Experts, W4A16 and W4A4) vs the bf16 transformers experts module
with experts_implementation "grouped_mm" (torch._grouped_mm) and "eager" (a loop over experts),
same run.

    python benchmarks/bench_moe.py [--tokens 1 16] [--shapes qwen3 mixtral] [--no-eager]
    python benchmarks/bench_moe.py --small      # tiny shapes, any machine: runs and checks, no times
    python benchmarks/bench_moe.py --generate [--layers 4]   # a Qwen3-MoE-shaped model through generate

Qwen3-30B-A3B experts: 128 experts, top-8, hidden 2048, expert MLP 768; Mixtral-8x7B: 8 experts,
top-2, hidden 4096, MLP 14336. Routing: top-k of random router logits (every token k distinct
experts). grouped_mm and NVFP4 are timed as CUDA-graph replays (the GPU's time alone) of calls
that cycle through 8 routings (and their x), so that the hit experts' weights come from HBM, as
they do in a model whose every layer has its own; one routing replayed would keep NVFP4's fewer
bytes in L2 where they fit (Qwen3's 8 experts at one token: 21 MB) and bf16's not. The eager
loop reads the hit experts back to the host every call, so it cannot be captured: it is timed
with events around eager calls (host launch cost included). The floor: the bytes of the experts
a routing hits (NVFP4 0.5625 B/weight; the mean over the routings) plus x and y, over the copy
bandwidth measured here.
"""

import argparse

import torch

from nvfp4_inductor.modules.experts import NVFP4Experts

SHAPES = {  # name: (experts, top-k, hidden, expert MLP)
    "qwen3": (128, 8, 2048, 768),
    "mixtral": (8, 2, 4096, 14336),
}
SMALL_SHAPES = {"qwen3": (16, 4, 64, 32), "mixtral": (4, 2, 128, 64)}
TOKENS = [1, 16, 64, 512, 4096]
ROUTINGS = 8  # routings a timed call cycles through (module docstring)


def bf16_experts(e: int, h: int, i: int, implementation: str, device: str):
    """A transformers Qwen3-MoE experts module (the Mixtral one is the same code) with random
    bf16 weights, dispatching to `implementation`."""
    import transformers

    config = transformers.Qwen3MoeConfig(hidden_size=h, moe_intermediate_size=i, num_experts=e,
                                         experts_implementation=implementation)
    config._experts_implementation = implementation
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    experts = Qwen3MoeExperts(config)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, h**-0.5)
        experts.down_proj.normal_(0, i**-0.5)
    return experts.to(device, torch.bfloat16).eval()


def routing(t: int, e: int, k: int, h: int, device: str, gen: torch.Generator):
    """-> (hidden_states (T, H) bf16, top_k_index (T, k), top_k_weights (T, k) bf16)."""
    x = torch.randn(t, h, generator=gen, device=device).to(torch.bfloat16)
    logits = torch.randn(t, e, generator=gen, device=device)
    weights, index = logits.softmax(-1).topk(k, dim=-1)
    return x, index, (weights / weights.sum(-1, keepdim=True)).to(torch.bfloat16)


def event_us(fn, calls: int = 20) -> float:
    """Median time of one eager fn() call (host launches included), timed with events."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def small() -> None:
    """Every path once on tiny shapes (CPU or GPU): NVFP4 against the bf16 module."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(0)
    for name, (e, k, h, i) in SMALL_SHAPES.items():
        bf16 = bf16_experts(e, h, i, "grouped_mm", device)
        eager = bf16_experts(e, h, i, "eager", device)
        eager.load_state_dict(bf16.state_dict())
        for activations in ("bf16", "nvfp4"):
            nvfp4 = NVFP4Experts.from_experts(bf16, activations)
            for t in (1, 16, 37):
                x, index, weights = routing(t, e, k, h, device, gen)
                with torch.no_grad():
                    want, loop, got = bf16(x, index, weights), eager(x, index, weights), nvfp4(x, index, weights)
                err = ((got.float() - want.float()).norm() / want.float().norm()).item()
                loop_err = ((loop.float() - want.float()).norm() / want.float().norm()).item()
                print(f"{name:8} {activations:6} T={t:3}: NVFP4 vs grouped_mm rel. error {err:.3f}, "
                      f"eager loop vs grouped_mm {loop_err:.4f}")
                # quantization error against bf16, two GEMMs deep (W4A4 quantizes x too: about twice
                # W4A16's); a wrong kernel is off by ~1
                if not err < (0.25 if activations == "bf16" else 0.5) or not loop_err < 0.02:
                    raise SystemExit(f"{name} {activations} T={t}: error too large")


GENERATE_SHAPES = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                       num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                       vocab_size=151936, max_position_embeddings=1024)


def generate_bench(layers: int = 4, new_tokens: int = 128, prompt: int = 16, runs: int = 3) -> None:
    """A Qwen3-30B-A3B-shaped model of `layers` layers (random weights, experts_implementation
    "grouped_mm") through generate with a static cache, its decode step compiled with
    CompileConfig(mode="reduce-overhead"): bf16 under backend="inductor", the same model under
    backend="nvfp4" (experts and linears quantized at compile time, moe_rewrite.py), and the model
    converted by nv.convert under backend="nvfp4". Tokens/s of whole generate calls, prompt
    included (median of `runs` timed calls after a warm-up call), the CUDA-graph skips each compile
    counted, and of one more call under torch.profiler the GPU's kernel time a token (GPU ms) and
    the rest of a token's time (idle ms: the GPU waiting for the host, generate's own work), which
    no kernel can shorten."""
    import time

    import transformers
    from torch._dynamo.utils import counters

    import nvfp4_inductor as nv

    def model(seed=0):
        torch.manual_seed(seed)
        config = transformers.Qwen3MoeConfig(num_hidden_layers=layers, experts_implementation="grouped_mm",
                                             **GENERATE_SHAPES)
        return transformers.Qwen3MoeForCausalLM(config).to("cuda", torch.bfloat16).eval()

    ids = torch.randint(0, GENERATE_SHAPES["vocab_size"], (1, prompt), device="cuda")
    print(f"\n{layers}-layer Qwen3-MoE-shaped model, generate {new_tokens} tokens after a {prompt}-token prompt, "
          "batch 1, static cache, decode step compiled with mode='reduce-overhead'")
    print(f"{'variant':>28} {'tokens/s':>9} {'x bf16':>7} {'GPU ms':>7} {'idle ms':>8} {'cudagraph skips':>16}")
    base = None
    for name, backend, convert in (("bf16, backend=inductor", "inductor", False),
                                   ("bf16 model, backend=nvfp4", "nvfp4", False),
                                   ("nv.convert, backend=nvfp4", "nvfp4", True)):
        m = model()
        if convert:
            nv.convert(m, nv.Config(activations="bf16"))
        torch._dynamo.reset()
        skips = counters["inductor"]["cudagraph_skips"]
        config = transformers.CompileConfig(backend=backend, mode="reduce-overhead")
        kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                      cache_implementation="static", compile_config=config)
        m.generate(ids, **kwargs)  # compiles (and records the CUDA graphs)
        times = []
        for _ in range(runs):
            torch.cuda.synchronize()
            start = time.perf_counter()
            m.generate(ids, **kwargs)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        rate = new_tokens / sorted(times)[len(times) // 2]
        base = base or rate
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            m.generate(ids, **kwargs)
            torch.cuda.synchronize()
        gpu_ms = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3 / new_tokens
        print(f"{name:>28} {rate:9.1f} {rate / base:7.2f} {gpu_ms:7.3f} {1e3 / rate - gpu_ms:8.3f} "
              f"{counters['inductor']['cudagraph_skips'] - skips:16d}", flush=True)
        del m
        torch._dynamo.reset()
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=TOKENS, help="tokens a call (default: all)")
    parser.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES))
    parser.add_argument("--no-eager", action="store_true", help="skip the eager loop (slow at 4096 tokens)")
    parser.add_argument("--small", action="store_true", help="tiny shapes, run and check only (any machine)")
    parser.add_argument("--generate", action="store_true",
                        help="a 4-layer Qwen3-MoE-shaped model through generate, NVFP4 vs bf16 (GPU)")
    parser.add_argument("--layers", type=int, default=4, help="layers of the --generate model")
    args = parser.parse_args()
    if args.small:
        small()
        return
    if args.generate:
        if not torch.cuda.is_available():
            raise SystemExit("--generate needs a CUDA GPU")
        import triton

        print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
        generate_bench(args.layers)
        return
    import triton
    from bench_quantize import copy_bandwidth_gbs, graph_us

    from nvfp4_inductor.kernels import gemm_configs

    grouped_splits = gemm_configs.grouped_splits

    torch.manual_seed(0)
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    copy = copy_bandwidth_gbs()
    print(f"device copy: {copy:.0f} GB/s")
    print("grouped_mm / eager: the bf16 transformers experts module; W4A16 / W4A4: NVFP4Experts (W4A4 includes "
          "quantizing x per expert group); 1 split: W4A16 with K not split; x: speed-up over bf16 grouped_mm "
          "(>1 is faster); floor: the hit experts' NVFP4 bytes plus x and y at the copy bandwidth")
    print(f"\n{'shape':>8} {'T':>5} {'hit':>5} {'grouped_mm us':>13} {'eager':>8} {'W4A16':>8} {'W4A4':>8} "
          f"{'1 split':>8} {'floor':>7} | {'eager x':>7} {'W4A16 x':>7} {'W4A4 x':>7} {'1 split x':>9} {'floor x':>7}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name in args.shapes:
        e, k, h, i = SHAPES[name]
        bf16 = bf16_experts(e, h, i, "grouped_mm", "cuda")
        eager = bf16_experts(e, h, i, "eager", "cuda")
        eager.gate_up_proj, eager.down_proj = bf16.gate_up_proj, bf16.down_proj  # the same weights
        w4a16 = NVFP4Experts.from_experts(bf16, "bf16")
        w4a4 = NVFP4Experts.from_experts(bf16, "nvfp4")
        for t in args.tokens:
            calls = [routing(t, e, k, h, "cuda", gen) for _ in range(ROUTINGS)]
            hit = sum(index.unique().numel() for _, index, _ in calls) / ROUTINGS  # (setup, not timed)

            def each(module):
                return lambda: [module(*call) for call in calls]

            with torch.no_grad():
                base = graph_us(each(bf16), calls=2, reps=10) / ROUTINGS
                loop = float("nan") if args.no_eager else event_us(lambda: eager(*calls[0]))
                t16 = graph_us(each(w4a16), calls=2, reps=10) / ROUTINGS
                t4 = graph_us(each(w4a4), calls=2, reps=10) / ROUTINGS
                gemm_configs.grouped_splits = lambda *_: 1  # (the planner's, read at each launch)
                try:
                    t16_unsplit = graph_us(each(w4a16), calls=2, reps=10) / ROUTINGS
                finally:
                    gemm_configs.grouped_splits = grouped_splits
            floor = (hit * 3 * h * i * 0.5625 + 2 * t * h * 2) / copy / 1e3
            times = (loop, t16, t4, t16_unsplit, floor)
            print(f"{name:>8} {t:>5} {hit:5.1f} {base:13.1f} " + " ".join(f"{v:8.1f}" for v in times[:4])
                  + f" {floor:7.1f} | " + " ".join(f"{base / v:7.2f}" for v in times[:3])
                  + f" {base / t16_unsplit:9.2f} {base / floor:7.2f}", flush=True)
        del bf16, eager, w4a16, w4a4
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
