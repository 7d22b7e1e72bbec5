"""Where a decode step's GPU time goes: bench_decode's model (8 Llama-3-8B layers, batch 1, context
512, reduce-overhead), per variant: GPU time per step (CUDA events over back-to-back steps, as
bench_decode runs them), the sum of its kernels' times (torch.profiler) and the difference (gaps
between kernels and idle GPU), and the kernels grouped by name, us per step.

    python benchmarks/probe_decode.py [--layers 8] [--top 25] [--variants "nvfp4 W4A4" ...]
"""

import argparse
import collections
import gc

import torch
import triton
from bench_decode import Loop, decode
from torch.profiler import ProfilerActivity, profile


def gpu_us_per_step(loop, start, steps=64, repeats=3):
    times = []
    for _ in range(repeats):
        loop.pos.fill_(start)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        begin.record()
        loop.run(steps)
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) * 1e3 / steps)
    return sorted(times)[len(times) // 2]


def kernels_per_step(loop, start, steps=20):
    """-> {kernel name: (us per step, launches per step)}."""
    loop.pos.fill_(start)
    loop.run(3)
    torch.cuda.synchronize()
    loop.pos.fill_(start)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        loop.run(steps)
        torch.cuda.synchronize()
    table = collections.defaultdict(lambda: [0.0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            row = table[event.name[:70]]
            row[0] += event.device_time / steps
            row[1] += 1 / steps
    return dict(table)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--variants", nargs="+", default=list(decode.VARIANTS), help="of examples/decode.py")
    parser.add_argument("--host-loop", action="store_true",
                        help="the model step with the argmax and pos += 1 outside it (bench_decode's loop "
                             "before session 26) instead of decode.GreedyStep")
    args = parser.parse_args()
    torch._dynamo.config.cache_size_limit = 64
    cfg = decode.ModelConfig(**{**decode.PRESETS["llama3-8b-8layers"].__dict__, "layers": args.layers})
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"model: {cfg}; context {args.context}, batch 1")
    model = decode.build_model(cfg, args.context + 96, 1, "cuda")
    summary = []
    for name in args.variants:
        config = decode.VARIANTS[name]
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()
        model.setup_cache(1)
        loop = Loop(model, lambda module: decode.compile_variant(module, config, "reduce-overhead"), 1,
                    args.host_loop)
        loop.run(args.context)  # compile, record, fill the cache
        step_us = gpu_us_per_step(loop, args.context)
        table = kernels_per_step(loop, args.context)
        kernel_us = sum(us for us, _ in table.values())
        launches = sum(n for _, n in table.values())
        summary.append((name, step_us, kernel_us, launches))
        print(f"\n{name}: {step_us:.1f} us per step on the GPU, kernels {kernel_us:.1f} us "
              f"({launches:.0f} launches), gaps {step_us - kernel_us:.1f} us")
        for kernel, (us, n) in sorted(table.items(), key=lambda item: -item[1][0])[:args.top]:
            print(f"  {us:8.1f} us {n:5.0f}x  {kernel}")
        del loop
    print(f"\n{'variant':>12} {'step us':>8} {'kernel us':>9} {'gaps us':>8} {'launches':>8}")
    for name, step_us, kernel_us, launches in summary:
        print(f"{name:>12} {step_us:8.1f} {kernel_us:9.1f} {step_us - kernel_us:8.1f} {launches:8.0f}")


if __name__ == "__main__":
    main()
