"""The register-fed decode GEMM (kernels/gemm_mma.py) on tiled codes in the natural order vs the
MMA order (nvfp4_inductor.tiled.to_mma_order: 11 decode instructions a word instead of 16, x's
words straight to the MMA), M = 1, 4, 16, same run: both checked against float64 first, then timed
(kernel + reduce, CUDA-graph replays over weight copies beyond L2) with bf16 cuBLAS and the floor.

    python benchmarks/probe_mma_order.py
"""

import math

import torch
import triton
from bench_quantize import copy_bandwidth_gbs, stream_us

import nvfp4_inductor as nv
from nvfp4_inductor import tiled
from nvfp4_inductor.kernels import gemm_configs
from nvfp4_inductor.kernels.gemm_splitk import gemm_splitk

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672), (4096, 1024)]  # (K, N)
ops = torch.ops.nvfp4


def run(x, w, n, mma_order, out_dtype=torch.bfloat16, splits=None):
    config = None if splits is None else (16, 64, 64, splits, 4, 1)
    return gemm_splitk(x, w[3] if mma_order else w[0], w[1], w[2], None, out_dtype, False, config=config,
                       tiled_n=n, reg_mma=True, mma_order=mma_order)


def weights(w):
    q = nv.quantize(w)
    data, scale = ops.tile_weight(q.data, q.scale.view(torch.uint8))
    return data, scale, q.global_scale, tiled.to_mma_order(data)


def check() -> None:
    worst = 0.0
    for n, k in [(64, 64), (80, 176), (4096, 4096), (1024, 14336), (192, 4160)]:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        wt = weights(w)
        ref_w = nv.quantize(w).dequantize(torch.float32).double()
        for m in (1, 3, 8, 9, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = x.double() @ ref_w.T
            for splits in (None, 1, 3):
                for order in (False, True):
                    y = run(x, wt, n, order, torch.float32, splits)
                    err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
                    worst = max(worst, err)
                    assert err < 1e-4, (n, k, m, splits, order, err)
    print(f"correct: worst relative error {worst:.2e} (both orders, fp32 out vs float64)")


def kernel_us(fn, inputs, rounds: int = 3) -> dict:
    """Mean device time of each kernel per call (profiler), from the same CUDA-graph replays."""
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
    out = {}
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.count >= calls:
            out[event.key[:28]] = event.device_time_total / calls
    return out


def breakdown() -> None:
    """Where a call's time goes at M = 1: the kernels' own durations against the time per call."""
    l2 = torch.cuda.get_device_properties().L2_cache_size
    print("\nM = 1, natural order: per-call time (graph replays) vs the kernels' durations (profiler)")
    for k, n in SHAPES:
        copies = max(2, math.ceil(3 * l2 / (n * k * 2)))
        w_bf16 = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for _ in range(copies)]
        w_all = [weights(w) for w in w_bf16]
        x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
        for name, fn, inputs in (("bf16", lambda w: x @ w.T, w_bf16), ("nvfp4", lambda w: run(x, w, n, False), w_all)):
            call = stream_us(fn, inputs)
            kernels = kernel_us(fn, inputs)
            parts = ", ".join(f"{key} {t:.1f}" for key, t in kernels.items())
            print(f"{k:>6} {n:>6} {name:>6}: {call:6.1f} us a call; kernels: {parts} (sum {sum(kernels.values()):.1f})",
                  flush=True)
        del w_bf16, w_all


def main() -> None:
    torch.manual_seed(0)
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    check()
    copy = copy_bandwidth_gbs()
    l2 = torch.cuda.get_device_properties().L2_cache_size
    print(f"device copy: {copy:.0f} GB/s; us per call, x: speed-up over bf16 cuBLAS")
    print(f"{'K':>6} {'N':>6} {'M':>3} {'bf16':>7} {'natural':>8} {'mma ord':>8} {'floor':>6} | "
          f"{'natural':>7} {'mma ord':>7} {'floor':>6} {'gain':>6}")
    for k, n in SHAPES:
        copies = max(2, math.ceil(3 * l2 / (n * k * 2)))
        w_bf16 = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for _ in range(copies)]
        w_all = [weights(w) for w in w_bf16]
        for m in (1, 4, 16):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            bf16 = stream_us(lambda w: x @ w.T, w_bf16)
            nat = stream_us(lambda w: run(x, w, n, False), w_all)
            mma = stream_us(lambda w: run(x, w, n, True), w_all)
            floor = (n * k * 0.5625 + 2 * m * k + 2 * m * n) / copy / 1e3
            print(f"{k:>6} {n:>6} {m:>3} {bf16:7.1f} {nat:8.1f} {mma:8.1f} {floor:6.1f} | "
                  f"{bf16 / nat:7.2f} {bf16 / mma:7.2f} {bf16 / floor:6.2f} {nat / mma:6.2f}", flush=True)
        del w_bf16, w_all
    breakdown()


if __name__ == "__main__":
    main()
