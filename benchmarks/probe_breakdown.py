"""Where a decode GEMM call's time goes (M = 1 and 16, tiled W4A16, `nvfp4::linear_tiled`): the
time per call from CUDA-graph replays (bench_gemm's method) against each kernel's own duration
from the profiler over the same replays, bf16 cuBLAS alongside. The difference is launch gaps.

    python benchmarks/probe_breakdown.py
"""

import math

import torch
import triton
from bench_quantize import stream_us

import nvfp4_inductor as nv

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672), (4096, 1024)]  # (K, N)
ops = torch.ops.nvfp4


def kernel_us(fn, inputs, rounds: int = 3) -> dict:
    """Mean device time of each kernel per call (profiler), from CUDA-graph replays."""
    fn(inputs[0])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(rounds):
            for w in inputs:
                fn(w)
    graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    calls = rounds * len(inputs)
    return {event.key[:28]: event.device_time_total / calls for event in prof.key_averages()
            if event.device_type == torch.autograd.DeviceType.CUDA and event.count >= calls}


def main() -> None:
    torch.manual_seed(0)
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    l2 = torch.cuda.get_device_properties().L2_cache_size
    for k, n in SHAPES:
        copies = max(2, math.ceil(3 * l2 / (n * k * 2)))
        w_bf16 = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for _ in range(copies)]
        w_tiled = []
        for w in w_bf16:
            q = nv.quantize(w)
            w_tiled.append((*ops.tile_weight(q.data, q.scale.view(torch.uint8)), q.global_scale))
        for m in (1, 16):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            for name, fn, inputs in (("bf16", lambda w: x @ w.T, w_bf16),
                                     ("nvfp4", lambda w: ops.linear_tiled(x, *w, None, n, "bf16"), w_tiled)):
                call = stream_us(fn, inputs)
                kernels = kernel_us(fn, inputs)
                parts = ", ".join(f"{key} {t:.1f}" for key, t in kernels.items())
                print(f"{k:>6} {n:>6} {m:>3} {name:>6}: {call:6.1f} us a call; kernels: {parts} "
                      f"(sum {sum(kernels.values()):.1f})", flush=True)
        del w_bf16, w_tiled


if __name__ == "__main__":
    main()
