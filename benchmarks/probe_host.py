"""Host time of one call of the compiled decoder block of bench_block.py (M = 1, reduce-overhead),
bf16 vs NVFP4: the launch rate with the GPU lagging behind, and a cProfile of the calls.
    python benchmarks/probe_host.py [--profile]"""
import cProfile
import pstats
import sys
import time

import torch
from bench_block import VARIANTS, build_block, call, compile_variant


def host_us(step, x, calls=300):
    for _ in range(20):
        call(step, x)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call(step, x)
    host = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return host


def main():
    block = build_block()
    x = torch.randn(1, 1, 4096, dtype=torch.bfloat16, device="cuda")
    for name, config in VARIANTS.items():
        step = compile_variant(block, config, "reduce-overhead")
        for _ in range(3):
            call(step, x)
        print(f"{name:12s} host {host_us(step, x):6.1f} us per call", flush=True)
        if "--profile" in sys.argv:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(200):
                call(step, x)
            prof.disable()
            torch.cuda.synchronize()
            pstats.Stats(prof).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
