"""Decode tokens/s under CUDA graphs: bf16 vs NVFP4 W4A16 vs W4A4, same run, same model.

    python benchmarks/bench_decode.py            # the table (meant to take < 4 minutes with compiles)
    python benchmarks/bench_decode.py --check    # correctness checks only; exit status 1 on a failure
    python benchmarks/bench_decode.py --matmul-attention  # decode attention as the prefill's matmuls
    python benchmarks/bench_decode.py --no-fuse-norms     # NVFP4 norms as kernels of their own
    python benchmarks/bench_decode.py --host-loop         # argmax and pos += 1 outside the step
    torchrun --nproc-per-node 2 benchmarks/bench_decode.py --tp 2 --batches 1 16
                              # tensor parallel: bf16 and NVFP4 W4A16 at TP 2, then TP 1 on rank 0,
                              # 8 layers of Llama-3-70B shapes (hidden 8192, 64 / 8 heads, MLP 28672)

The model is examples/decode.py's Llama-style decoder with 8 layers of Llama-3-8B shapes (hidden
4096, 32 query / 8 KV heads of 128, MLP 14336; vocab 32000; the output head stays bf16), random
weights. Each variant is compiled with mode="reduce-overhead" and static shapes: bf16 with
`torch.compile`, NVFP4 with `nvfp4_inductor.compile` (backend="nvfp4"). Per batch size (1, 8) the
KV cache is filled to the context (512) token by token through the compiled decode step, then
`--steps` greedy decode steps are timed on the host's clock (launch overhead included), median of
3. The step is examples/decode.py's GreedyStep (model call, argmax and the position's advance in
the compiled graph, the token and position in buffers: the loop only replays it); `--host-loop`
times the model call with the argmax and `pos += 1` run eagerly after each replay instead. A fourth row, "bf16 PDL", is bf16 with Inductor's programmatic dependent
launch on, which backend="nvfp4" turns on and torch.compile leaves off: the NVFP4 rows' ratio to
it is the speed-up that is NVFP4's own. Also checked per variant and batch: zero CUDA-graph skips (Inductor's
counter) and no host sync in a replayed decode step (`torch.cuda.set_sync_debug_mode("error")`).

Floor: a decode step must read every weight once (bf16: 2 bytes per weight; NVFP4: 0.5625 for the
converted linears, 2 for the output head) plus the KV cache; the floor tokens/s is batch /
(bytes / copy bandwidth measured here). The embedding reads one row per token (ignored).
Peak memory is `torch.cuda.max_memory_allocated` over the variant's compile and run; the NVFP4
rows include the bf16 weights, which the model object still holds (the compiled graphs hold the
NVFP4 copies as frozen constants, one copy per compiled graph).
"""

import os

# Tensor-parallel runs (--tp): NVLink SHARP / multicast off in every process, before
# torch.distributed initializes (the machines these runs use have it withheld).
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import argparse
import copy
import dataclasses
import gc
import statistics
import sys
import time
from pathlib import Path

import torch
import triton
from bench_quantize import copy_bandwidth_gbs
from torch._dynamo.utils import counters

import nvfp4_inductor as nv

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import decode  # the model and the decode loop of examples/decode.py

TARGETS = {"nvfp4 W4A16": 2.5, "nvfp4 W4A4": 2.0}  # x bf16 tokens/s at batch 1
# bf16 with programmatic dependent launch, which backend="nvfp4" turns on (torch.compile leaves it
# off): the part of the NVFP4 rows' speed-up that is PDL's, not NVFP4's
BF16_PDL = "bf16 PDL"
NVFP4_BYTES_PER_WEIGHT = 0.5 + 1 / 16  # E2M1 code + one E4M3 scale per 16 (global scales ignored)


def step_bytes(model: decode.Transformer, nvfp4: bool, batch: int) -> float:
    """Bytes a decode step must read: the linear weights, and the whole bf16 KV cache (the matmul
    form reads every slot; the decode_attention op the slots up to the position, ~93% of them in
    the timed steps: the floor is then a little low)."""
    total = 0.0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            per_weight = 2 if (not nvfp4 or name == "lm_head") else NVFP4_BYTES_PER_WEIGHT
            total += module.weight.numel() * per_weight
    cfg = model.cfg
    return total + 2 * cfg.layers * batch * cfg.kv_heads * model.max_len * cfg.head_dim * 2


def decode_from(step, token, pos, steps):
    """steps greedy decode steps of the model step (the host loop: argmax and pos += 1 outside the
    compiled step) from (token (B, 1), pos (1,)), both on the device; -> token."""
    for _ in range(steps):
        torch.compiler.cudagraph_mark_step_begin()
        token = step(token, pos).argmax(-1, keepdim=True)
        pos += 1
    return token


class Loop:
    """A variant's decode loop at one batch size: GreedyStep compiled (the default), or the model
    compiled with the argmax and the position's advance outside it (host_loop)."""

    def __init__(self, model, compile_fn, batch, host_loop):
        self.host_loop = host_loop
        if host_loop:
            self.step = compile_fn(model)
            self.token = torch.zeros(batch, 1, dtype=torch.long, device="cuda")
            self.pos = torch.zeros(1, dtype=torch.long, device="cuda")
        else:
            self.loop = decode.GreedyStep(model, batch)
            self.step = compile_fn(self.loop)
            self.pos = self.loop.pos

    def run(self, steps):
        if self.host_loop:
            self.token = decode_from(self.step, self.token, self.pos, steps)
            return
        for _ in range(steps):
            torch.compiler.cudagraph_mark_step_begin()
            self.step()

    def seconds(self, start, steps) -> float:
        """Wall time of `steps` decode steps from position start (host overhead included)."""
        self.pos.fill_(start)
        torch.cuda.synchronize()
        begin = time.perf_counter()
        self.run(steps)
        torch.cuda.synchronize()
        return time.perf_counter() - begin

    def sync_free(self, start) -> str:
        """One replayed decode step under sync debug mode "error": "ok", or the error."""
        self.pos.fill_(start)
        return replay_is_sync_free(lambda: self.run(1))


def replay_is_sync_free(step_once) -> str:
    """step_once() twice (the second a replay of the graph the first ran), the second under sync
    debug mode "error": "ok", or the error."""
    step_once()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step_once()
        result = "ok"
    except RuntimeError as error:
        result = f"SYNC: {str(error).splitlines()[0]}"
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return result


def sync_free_step(step, batch, start) -> str:
    """One replayed model step (host loop) under sync debug mode "error": "ok", or the error."""
    token = torch.zeros(batch, 1, dtype=torch.long, device="cuda")
    pos = torch.full((1,), start, dtype=torch.long, device="cuda")
    return replay_is_sync_free(lambda: decode_from(step, token, pos.clone(), 1))


def run_variant(model, config, batches, context, steps, pdl=False, host_loop=False):
    """-> one row per batch: dict of the measurements. pdl: bf16 with Inductor's programmatic
    dependent launch on (torch.compile leaves it off; backend="nvfp4" turns it on)."""
    if pdl:
        options = {**torch._inductor.list_mode_options("reduce-overhead"), "triton.enable_pdl": True}

        def compile_fn(module):
            return decode.compile_variant(module, config, None, options=options)
    else:
        def compile_fn(module):
            return decode.compile_variant(module, config, "reduce-overhead")
    rows = []
    for batch in batches:
        model.setup_cache(batch)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        skips = counters["inductor"]["cudagraph_skips"]
        loop = Loop(model, compile_fn, batch, host_loop)
        begin = time.perf_counter()
        loop.run(3)  # compile, warm up, record the CUDA graph
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - begin
        loop.run(context - 3)  # the rest of the context, through the graph
        times = [loop.seconds(context, steps) for _ in range(3)]
        rows.append({
            "batch": batch, "tokens_s": batch * steps / statistics.median(times), "compile_s": compile_s,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
            "skips": counters["inductor"]["cudagraph_skips"] - skips,
            "sync": loop.sync_free(context),
            "floor_tokens_s": None})
        del loop
    return rows


def max_relative_error(step, reference, prompt, forced, steps=5) -> float:
    """The largest relative error of step's logits against reference's over the prefill of prompt
    and steps - 1 decode steps fed forced's tokens (each model its own KV cache)."""
    pos = torch.arange(prompt.shape[1], device=prompt.device)
    err = 0.0
    with torch.no_grad():
        for i in range(steps):
            tokens = prompt if i == 0 else forced[:, i - 1:i]
            torch.compiler.cudagraph_mark_step_begin()
            got = step(tokens, pos).float()
            want = reference(tokens, pos).float()
            err = max(err, ((got - want).norm() / want.norm()).item())
            pos = pos[-1:] + 1
    return err


def greedy_choices(model, config, prompt, steps, forced=None):
    """decode.greedy of the variant (the prefill and GreedyStep compiled, CUDA graphs)."""
    loop = decode.GreedyStep(model, prompt.shape[0])
    prefill = decode.compile_variant(model, config, "reduce-overhead", fullgraph=True)
    step = decode.compile_variant(loop, config, "reduce-overhead", fullgraph=True)
    return decode.greedy(prefill, step, loop, prompt, steps, forced=forced)


def check(model, steps) -> bool:
    """Correctness only, batch 1: compiled NVFP4 vs the same model converted eagerly, agreement
    with bf16 (teacher-forced), CUDA-graph skips, host syncs. -> True when all pass."""
    ok = True
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.cfg.vocab, (1, 16), generator=generator).cuda()
    # No cache reset between runs: each prefill rewrites positions 0..15, and the mask hides
    # every slot beyond the current position.
    torch._dynamo.reset()
    model.setup_cache(1)
    bf16_choices = greedy_choices(model, None, prompt, steps)
    # Inductor's own bf16 compile is this far from bf16 eager on this model (its fused kernels keep
    # fp32 where eager rounds after every op, and 8 random layers grow the difference: 2.6e-2 on
    # the CPU): the scale of the W4A16 bound below (a fixed 2e-2 would be tighter than that).
    torch._dynamo.reset()
    bf16_err = max_relative_error(decode.compile_variant(copy.deepcopy(model), None, "default"),
                                  copy.deepcopy(model), prompt, bf16_choices)
    bound = max(2e-2, 1.5 * bf16_err)
    print(f"bf16: compiled vs eager relative error {bf16_err:.1e} (the W4A16 bound: {bound:.1e})")
    for name, config in list(decode.VARIANTS.items())[1:]:
        torch._dynamo.reset()
        skips = counters["inductor"]["cudagraph_skips"]
        choices = greedy_choices(model, config, prompt, steps, forced=bf16_choices)
        step = decode.compile_variant(model, config, "reduce-overhead", fullgraph=True)
        agreement = (choices == bf16_choices).float().mean().item()
        # The CUDA-graph replays vs the same graphs compiled without CUDA graphs (same kernels),
        # and vs the model converted eagerly (nv.convert: the same quantized weights), on the
        # logits of the prefill and 4 decode steps. The eager bound applies to W4A16 only: W4A4
        # quantizes activations (discontinuous), and on a tiny model a one-ulp change of the
        # embeddings already moves its logits by 5% (measured on the CPU).
        eager = copy.deepcopy(model)
        no_graphs = decode.compile_variant(copy.deepcopy(model), config, "default")
        nv.convert(eager, config)
        replay_err = max_relative_error(step, no_graphs, prompt, bf16_choices)
        eager_err = max_relative_error(step, eager, prompt, bf16_choices)
        if config.activations == "bf16":
            # Each against the same quantized model run in fp32 (norms, residuals, attention; x
            # still enters every NVFP4 product as bf16): whose rounding is further from exact.
            fp32 = copy.deepcopy(model).float()
            nv.convert(fp32, config)
            print(f"{name}: relative error against the fp32 model: compiled "
                  f"{max_relative_error(step, fp32, prompt, bf16_choices):.1e}, eager "
                  f"{max_relative_error(eager, fp32, prompt, bf16_choices):.1e}")
            del fp32
        del eager, no_graphs
        sync = sync_free_step(step, 1, 16 + 5)  # the model step, then the timed loop's step
        if sync == "ok":
            sync = Loop(model, lambda m: decode.compile_variant(m, config, "reduce-overhead"), 1,
                        False).sync_free(16 + 5)
        new_skips = counters["inductor"]["cudagraph_skips"] - skips
        eager_ok = eager_err < bound or config.activations == "nvfp4"
        passed = replay_err < 1e-3 and eager_ok and new_skips == 0 and sync == "ok"
        ok &= passed
        print(f"{name}: {'PASS' if passed else 'FAIL'}  replay vs no CUDA graphs relative error "
              f"{replay_err:.1e} (< 1e-3), vs eager NVFP4 {eager_err:.1e} "
              f"({f'< {bound:.1e}' if config.activations == 'bf16' else 'not bounded'}), cudagraph skips "
              f"{new_skips}, sync check {sync}, agreement with bf16 {100 * agreement:.1f}% of "
              f"{steps} steps (teacher-forced)")
        del step
    return ok


TP_PRESET = decode.ModelConfig(vocab=32000, hidden=8192, layers=8, heads=64, kv_heads=8, head_dim=128,
                               mlp=28672)  # 8 layers of Llama-3-70B shapes


def tp_model(cfg, max_len, batch, mesh, config):
    """The decoder, its layers sharded over mesh (None: whole) with the standard plan (q / k / v and
    w1 / w3 column-parallel, wo / w2 row-parallel; each rank's attention runs its own heads), in
    bf16 (config None) or converted to NVFP4 after sharding (each share with its whole weight's
    global scale: nvfp4_inductor.parallel)."""
    from torch.distributed.tensor.parallel import parallelize_module

    from nvfp4_inductor.parallel import ColwiseParallel, RowwiseParallel

    model = decode.build_model(cfg, max_len, batch, "cuda")
    if mesh is not None:
        plan = {"attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
                "attn.wo": RowwiseParallel(), "mlp.w1": ColwiseParallel(), "mlp.w3": ColwiseParallel(),
                "mlp.w2": RowwiseParallel()}
        for layer in model.layers:
            parallelize_module(layer, mesh, plan)
            layer.attn.heads //= mesh.size()
            layer.attn.kv_heads //= mesh.size()
        model.setup_cache(batch)
    if config is not None:
        nv.convert(model, config)
    return model


def tp_main(args) -> None:
    """--tp N under torchrun: bf16 and NVFP4 W4A16 decode tokens/s at TP N, then at TP 1 on rank 0
    (the other ranks wait), one table on rank 0."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != args.tp:
        sys.exit(f"--tp {args.tp} needs {args.tp} processes: torchrun --nproc-per-node {args.tp} "
                 f"benchmarks/bench_decode.py --tp {args.tp} (WORLD_SIZE is {world})")
    rank = int(os.environ.get("RANK", "0"))
    mesh = None
    if args.tp > 1:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        # rank 0's TP 1 run (compiles included) keeps the others waiting in a barrier
        dist.init_process_group("nccl", timeout=datetime.timedelta(hours=2))
        mesh = init_device_mesh("cuda", (args.tp,))
    torch._dynamo.config.cache_size_limit = 64
    cfg = dataclasses.replace(TP_PRESET, layers=args.layers, decode_attention=not args.matmul_attention)
    if rank == 0:
        print(f"GPU: {torch.cuda.get_device_name()} x {args.tp}, torch {torch.__version__}, "
              f"triton {triton.__version__}, NCCL_NVLS_ENABLE={os.environ['NCCL_NVLS_ENABLE']}")
        print(f"model: {cfg}; context {args.context}, batches {args.batches}")
    max_len = args.context + args.steps + 8
    variants = {name: decode.VARIANTS[name] for name in ("bf16", "nvfp4 W4A16")}
    results = {}
    for tp in dict.fromkeys((args.tp, 1)):
        if tp == 1 and rank != 0:
            continue
        for name, config in variants.items():
            torch._dynamo.reset()
            gc.collect()
            torch.cuda.empty_cache()
            model = tp_model(cfg, max_len, max(args.batches), mesh if tp > 1 else None, config)
            results[(name, tp)] = run_variant(model, config, args.batches, args.context, args.steps,
                                              host_loop=args.host_loop)
            del model
    if mesh is not None:
        torch._dynamo.reset()
        dist.barrier()
    if rank != 0:
        if mesh is not None:
            dist.destroy_process_group()
        return
    print(f"\n{'variant':>12} {'TP':>3} {'batch':>5} {'tokens/s':>9} {'vs bf16':>8} {'vs TP 1':>8} "
          f"{'peak GiB':>8} {'compile s':>9} {'skips':>5} {'sync':>5}")
    for (name, tp), rows in results.items():
        for i, row in enumerate(rows):
            base = results[("bf16", tp)][i]["tokens_s"]
            one = results[(name, 1)][i]["tokens_s"]
            print(f"{name:>12} {tp:3d} {row['batch']:5d} {row['tokens_s']:9.1f} {row['tokens_s'] / base:7.2f}x "
                  f"{row['tokens_s'] / one:7.2f}x {row['peak_gib']:8.2f} {row['compile_s']:9.1f} "
                  f"{row['skips']:5d} {row['sync']:>5}")
    if 1 in args.batches and args.tp > 1:
        i = args.batches.index(1)
        nvfp4, bf16 = results[("nvfp4 W4A16", args.tp)][i]["tokens_s"], results[("bf16", args.tp)][i]["tokens_s"]
        one = results[("nvfp4 W4A16", 1)][i]["tokens_s"]
        for what, ratio, target in ((f"bf16 TP {args.tp}", nvfp4 / bf16, 2.0), ("NVFP4 TP 1", nvfp4 / one, 1.6)):
            print(f"target NVFP4 W4A16 TP {args.tp} >= {target}x {what} at batch 1: {ratio:.2f}x "
                  f"{'MET' if ratio >= target else 'NOT MET'}")
    clean = all(r["skips"] == 0 and r["sync"] == "ok" for rows in results.values() for r in rows)
    print(f"target zero CUDA-graph skips and no host sync in a decode step: {'MET' if clean else 'NOT MET'}")
    if mesh is not None:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="correctness checks only")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=64, help="timed decode steps per repeat")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--matmul-attention", action="store_true",
                        help="decode steps as the prefill (Inductor's RoPE and cache writes, matmuls "
                             "and softmax), not the decode_attention op")
    parser.add_argument("--no-fuse-norms", action="store_true",
                        help="NVFP4 with Config(fuse_norms=False): each RMSNorm a kernel of its own "
                             "(W4A4 also without its norm + quantize kernel)")
    parser.add_argument("--host-loop", action="store_true",
                        help="time the model step with the argmax and pos += 1 outside it "
                             "instead of decode.GreedyStep")
    parser.add_argument("--tp", type=int, default=None,
                        help="tensor parallel over this many GPUs (launch with torchrun --nproc-per-node "
                             "N): bf16 and NVFP4 W4A16 at TP N and TP 1, 8 layers of Llama-3-70B shapes")
    args = parser.parse_args()
    if args.tp is not None:
        if args.tp < 1:
            parser.error(f"--tp must be >= 1; got {args.tp}")
        return tp_main(args)
    torch._dynamo.config.cache_size_limit = 64
    cfg = decode.PRESETS["llama3-8b-8layers"]
    cfg = decode.ModelConfig(**{**cfg.__dict__, "layers": args.layers,
                                "decode_attention": not args.matmul_attention})
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"model: {cfg}; context {args.context}, batches {args.batches}")
    max_len = args.context + args.steps + 8
    model = decode.build_model(cfg, max_len, max(args.batches), "cuda")
    if args.check:
        sys.exit(0 if check(model, 32) else 1)

    copy_gbs = copy_bandwidth_gbs()
    print(f"device copy: {copy_gbs:.0f} GB/s (read + write); bf16 weights "
          f"{torch.cuda.memory_allocated() / 2**30:.2f} GiB allocated before compiling")
    results = {}
    variants = [(name, config if config is None or not args.no_fuse_norms
                 else dataclasses.replace(config, fuse_norms=False), False)
                for name, config in decode.VARIANTS.items()]
    variants.insert(1, (BF16_PDL, None, True))
    for name, config, pdl in variants:
        torch._dynamo.reset()  # drops the previous variant's graphs and CUDA-graph pools
        gc.collect()
        torch.cuda.empty_cache()
        results[name] = run_variant(model, config, args.batches, args.context, args.steps, pdl,
                                    args.host_loop)
        for row in results[name]:
            nbytes = step_bytes(model, config is not None, row["batch"])
            row["floor_tokens_s"] = row["batch"] / (nbytes / (copy_gbs * 1e9))

    print(f"\n{'variant':>12} {'batch':>5} {'tokens/s':>9} {'vs bf16':>8} {'floor tok/s':>11} "
          f"{'% floor':>7} {'peak GiB':>8} {'compile s':>9} {'skips':>5} {'sync':>5}")
    for name, rows in results.items():
        for row, base in zip(rows, results["bf16"]):
            print(f"{name:>12} {row['batch']:5d} {row['tokens_s']:9.1f} "
                  f"{row['tokens_s'] / base['tokens_s']:7.2f}x {row['floor_tokens_s']:11.1f} "
                  f"{100 * row['tokens_s'] / row['floor_tokens_s']:6.1f}% {row['peak_gib']:8.2f} "
                  f"{row['compile_s']:9.1f} {row['skips']:5d} {row['sync']:>5}")
    print("(compile s: the first 3 decode calls at that batch: compile, warm-up, CUDA-graph record;"
          " floor: weights + KV cache read once at the copy bandwidth)")
    failures = []
    if 1 in args.batches:
        index = args.batches.index(1)
        base = results["bf16"][index]["tokens_s"]
        for name, target in TARGETS.items():
            ratio = results[name][index]["tokens_s"] / base
            met = ratio >= target
            failures += [] if met else [name]
            print(f"target {name} >= {target}x bf16 tokens/s at batch 1: {ratio:.2f}x "
                  f"{'MET' if met else 'NOT MET'} ({results[name][index]['tokens_s'] / results[BF16_PDL][index]['tokens_s']:.2f}x "
                  f"{BF16_PDL})")
    clean = all(r["skips"] == 0 and r["sync"] == "ok" for rows in results.values() for r in rows)
    print(f"target zero CUDA-graph skips and no host sync in a decode step: {'MET' if clean else 'NOT MET'}")
    for name, rows in results.items():
        for row in rows:
            if row["sync"] != "ok":
                print(f"  {name} batch {row['batch']}: {row['sync']}")


if __name__ == "__main__":
    main()
