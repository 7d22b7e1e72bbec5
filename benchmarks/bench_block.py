"""A Llama-style decoder block, bf16 vs backend="nvfp4", same mode, same run.

    python benchmarks/bench_block.py                    # M = 1, 16, 4096; mode="reduce-overhead"
    python benchmarks/bench_block.py --m 1 --mode default
    python benchmarks/bench_block.py --m 1 --kernels      # and each variant's kernels, GPU us per call

The block (hidden 4096, 32 query / 8 KV heads of 128, MLP 14336, Llama-3-8B shapes, random N(0, 0.02)
weights): x + Wo(attention(RMSNorm(x))), then h + W2(SiLU(W1 g) * W3 g) with g = RMSNorm(h). x is
(1, M, 4096): M is the number of rows every linear multiplies. Attention is causal SDPA over the M
tokens themselves (no KV cache): the same for every variant, and small, so the table isolates what
the backend changes (the 7 linears and what fuses around them); bench_decode.py measures decoding
with a KV cache.

Variants: bf16 `torch.compile(block, mode=...)`; NVFP4 `nvfp4_inductor.compile(block, Config(...),
mode=...)` (backend="nvfp4") with W4A16 and W4A4 activations, programmatic dependent launch off
unless --pdl (then on for every variant, bf16 through Inductor's own option: it overlaps kernels,
and the kernel sums below count the overlap twice; "GPU busy" does not). Each is compiled per M
with static shapes (compile time = the first three calls: compiling, recording the CUDA graph),
checked against bf16 eager (and W4A16 against its eager NVFP4 counterpart), then timed over 100
back-to-back calls (median of 5: "us per call", the host's launch work included where it is the
longer part) and per kernel with torch.profiler ("kernel us": the sum of the kernels' GPU times per
call, gaps excluded; "kernels": distinct kernels; "GPU busy": per call, each followed by a
synchronize, first start to last end of each run of kernels less than HOST_GAP_US apart, summed:
the graph's own gaps and PDL overlap in, the waits for the host out; --timeline prints a call's
graph kernel by kernel).
Floor at small M: the weights read once (bf16 2 bytes a weight, NVFP4 0.5625) at the copy bandwidth
measured here.
"""

import argparse
import collections
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from bench_quantize import copy_bandwidth_gbs
from torch.profiler import ProfilerActivity, profile
from torch import nn

import nvfp4_inductor as nv

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import decode  # RMSNorm, MLP and the Llama-3-8B config of examples/decode.py

CFG = decode.PRESETS["llama3-8b-8layers"]
VARIANTS = {"bf16": None, "nvfp4 W4A16": nv.Config(activations="bf16"),
            "nvfp4 W4A4": nv.Config(activations="nvfp4")}
TARGETS = {1: 2.5, 16: 2.5, 4096: 0.9}  # x bf16: >= 2.5x at M <= 16, >= 0.9x at 4096
NVFP4_BYTES_PER_WEIGHT = 0.5 + 1 / 16


def kernel_times(fn, calls=50):
    """-> {kernel name: average us per call} over `calls` calls of fn (after 5 warm-up calls)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.name[:60]] += event.device_time / calls  # us
    return dict(times)


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.attn_norm = decode.RMSNorm(cfg.hidden, cfg.norm_eps)
        self.wq = nn.Linear(cfg.hidden, cfg.heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden, bias=False)
        self.mlp_norm = decode.RMSNorm(cfg.hidden, cfg.norm_eps)
        self.mlp = decode.MLP(cfg)

    def forward(self, x):
        batch, seq, _ = x.shape
        h = self.attn_norm(x)
        q = self.wq(h).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(h).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(h).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.wo(a.transpose(1, 2).reshape(batch, seq, -1))
        return x + self.mlp(self.mlp_norm(x))


def build_block(seed=0):
    torch.manual_seed(seed)
    with torch.device("cuda"):
        block = Block(CFG).to(torch.bfloat16)
    for name, p in block.named_parameters():
        if not name.endswith("norm.weight"):
            with torch.no_grad():
                p.normal_(0.0, 0.02)
    return block.eval()


def compile_variant(block, config, mode, pdl=False):
    """pdl: leave the backend's programmatic dependent launch on (bf16: Inductor's option on too).
    Off by default here: with it a kernel's profiled time includes its wait for the one before it,
    so the "kernel us" sums would count the overlap twice (bench_decode measures PDL per decode
    step)."""
    if config is not None:
        options = None if pdl else {"triton.enable_pdl": False}
        return nv.compile(block, config, mode=mode, options=options, dynamic=False)
    if pdl:  # torch.compile takes a mode or options, not both
        options = {**torch._inductor.list_mode_options(mode), "triton.enable_pdl": True}
        compiled = torch.compile(block, options=options, dynamic=False)
    else:
        compiled = torch.compile(block, mode=mode, dynamic=False)

    def run(x):
        with torch.no_grad():
            return compiled(x)
    return run


def call(step, x):
    torch.compiler.cudagraph_mark_step_begin()
    return step(x)


def per_call_us(step, x, calls=100, repeats=5) -> float:
    """GPU time per call of back-to-back calls (median over repeats): as in a decode loop, the host
    prepares the next call while the GPU runs this one. (triton.testing.do_bench syncs and flushes
    L2 around each call, which leaves the GPU idle while the host launches: at M = 1 it measures
    the CUDA-graph replay's host overhead too.)"""
    for _ in range(10):
        call(step, x)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(calls):
            call(step, x)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


# Kernels of one CUDA graph are well under this apart on the GPU (with and without PDL); where the
# GPU waits for the host (between calls, and inside a call between the CUDA-graph tree's input
# copy kernel and the graph's replay) well over.
HOST_GAP_US = 10.0


def busy_runs(kernels, gap_us: float = HOST_GAP_US) -> list[list]:
    """(start, end, ...) us of kernels -> runs of kernels each starting less than gap_us after the
    latest end before it."""
    runs, latest = [], None
    for kernel in sorted(kernels):
        if runs and kernel[0] - latest < gap_us:
            runs[-1].append(kernel)
            latest = max(latest, kernel[1])
        else:
            runs.append([kernel])
            latest = kernel[1]
    return runs


def span(kernels) -> float:
    return max(k[1] for k in kernels) - kernels[0][0]


def gpu_busy_us(step, x, calls=20, timeline=False) -> float:
    """GPU time per call with the host's gaps left out: over `calls` calls (a synchronize after
    each), the runs of kernels (busy_runs: PDL overlap counted once) first start to last end,
    summed, per call; from torch.profiler's kernel records. timeline: print the median run of the
    graph (start, time, gap before, name)."""
    for _ in range(5):
        call(step, x)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call(step, x)
            torch.cuda.synchronize()
    kernels = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA]
    runs = busy_runs(kernels)
    if len(kernels) % calls:
        print(f"    (GPU busy: {len(kernels)} kernels for {calls} calls)")
    if timeline:
        longest = max(len(run) for run in runs)
        graphs = sorted((run for run in runs if len(run) == longest), key=span)
        run = graphs[len(graphs) // 2]
        latest = run[0][0]
        for start, end, name in run:
            print(f"    {start - run[0][0]:7.1f} {end - start:6.1f} us (gap {start - latest:5.1f})  {name[:60]}")
            latest = max(latest, end)
    return sum(span(run) for run in runs) / calls


def eager_reference(block, config, x):
    """The block with its linears converted eagerly (NVFP4Linear: the eager nvfp4 ops)."""
    if config is None:
        with torch.no_grad():
            return block(x)
    converted = copy.deepcopy(block)
    nv.convert(converted, config)
    with torch.no_grad():
        return converted(x)


def weight_bytes(block, nvfp4: bool) -> float:
    per = NVFP4_BYTES_PER_WEIGHT if nvfp4 else 2
    return sum(m.weight.numel() * per for m in block.modules() if isinstance(m, nn.Linear))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--m", type=int, nargs="+", default=[1, 16, 4096])
    parser.add_argument("--mode", default="reduce-overhead")
    parser.add_argument("--kernels", action="store_true", help="also print each variant's kernels")
    parser.add_argument("--timeline", action="store_true", help="print a call's kernels on the GPU's clock")
    parser.add_argument("--pdl", action="store_true",
                        help="programmatic dependent launch on (NVFP4: the backend's default; bf16: "
                             "Inductor's option); kernel us then counts overlapping kernels twice")
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    print(f"# {props.name}, torch {torch.__version__}, triton {triton.__version__}, mode={args.mode}"
          f"{', with PDL' if args.pdl else ''}")
    bandwidth = copy_bandwidth_gbs() * 1e9
    block = build_block()
    rows = []
    for m in args.m:
        x = torch.randn(1, m, CFG.hidden, device="cuda", dtype=torch.bfloat16)
        bf16_eager = eager_reference(block, None, x).float()
        base_us = base_kernel_us = base_busy_us = None
        for name, config in VARIANTS.items():
            torch._dynamo.reset()
            step = compile_variant(block, config, args.mode, args.pdl)
            begin = time.perf_counter()
            for _ in range(3):  # compile; reduce-overhead: warm up, record
                y = call(step, x).clone().float()
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - begin
            # vs bf16 eager: the format's error; vs the eager NVFP4 block (W4A16 only: quantizing
            # activations is discontinuous, a one-ulp change of a norm output moves W4A4 a lot)
            err_bf16 = ((y - bf16_eager).norm() / bf16_eager.norm()).item()
            err_eager = float("nan")
            if config is not None and config.activations == "bf16":
                expected = eager_reference(block, config, x).float()
                err_eager = ((y - expected).norm() / expected.norm()).item()
            us = per_call_us(step, x)
            kernels = kernel_times(lambda step=step, x=x: call(step, x), calls=20)
            kernel_us = sum(kernels.values())
            busy_us = gpu_busy_us(step, x, timeline=args.timeline)
            base_us, base_kernel_us = base_us or us, base_kernel_us or kernel_us
            base_busy_us = base_busy_us or busy_us
            floor_us = weight_bytes(block, config is not None) / bandwidth * 1e6
            rows.append((m, name, us, base_us / us, kernel_us, base_kernel_us / kernel_us, busy_us,
                         base_busy_us / busy_us, len(kernels), floor_us, compile_s, err_bf16, err_eager))
            print(f"M={m:5d} {name:12s} {us:9.1f} us  x{base_us / us:5.2f}  kernels {kernel_us:8.1f} us "
                  f"x{base_kernel_us / kernel_us:5.2f}  GPU busy {busy_us:8.1f} us "
                  f"x{base_busy_us / busy_us:5.2f}"
                  f"  compile {compile_s:5.1f} s"
                  f"  rel err vs bf16 eager {err_bf16:.1e}, vs NVFP4 eager {err_eager:.1e}", flush=True)
            if args.kernels:
                for kernel, k_us in sorted(kernels.items(), key=lambda item: -item[1]):
                    print(f"    {k_us:8.1f} us  {kernel}")
            del step
    print()
    print("| M | variant | us per call | x bf16 | kernel us per call | x bf16 | GPU busy us | x bf16 "
          "| kernels | target | weight-read floor us | compile s | rel. err vs bf16 eager | vs NVFP4 eager |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (m, name, us, speedup, kernel_us, kernel_speedup, busy_us, busy_speedup, n_kernels, floor_us,
         compile_s, err_bf16, err_eager) in rows:
        target = "" if name == "bf16" else f">= {TARGETS.get(m, '')}"
        print(f"| {m} | {name} | {us:.1f} | {speedup:.2f} | {kernel_us:.1f} | {kernel_speedup:.2f} "
              f"| {busy_us:.1f} | {busy_speedup:.2f} | {n_kernels} | {target} | {floor_us:.1f} "
              f"| {compile_s:.1f} | {err_bf16:.1e} | {err_eager:.1e} |")

if __name__ == "__main__":
    main()
