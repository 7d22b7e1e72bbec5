"""NVFP4 quantize throughput: the fused Triton kernel vs the device copy bandwidth, vs
torch.compile of the reference (Inductor's own code) and the eager reference, same run.

    python benchmarks/bench_quantize.py

Bytes counted (bf16 input of N elements): static scale reads x once and writes codes + scales,
2N + N/2 + N/16 bytes; a dynamic per-tensor scale must read x twice (amax, then quantize),
4N + N/2 + N/16. The floor is bytes / copy bandwidth (read + write) measured here. Small shapes
(decode) are latency-bound: timed as CUDA-graph replays, against an empty kernel timed the same way.
"""

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

import nvfp4_inductor as nv
from nvfp4_inductor import reference
from nvfp4_inductor.kernels import quantize as qk

SHAPES = [(1, 4096), (16, 4096), (4096, 4096), (8192, 8192), (16384, 8192)]
LARGE = 4096 * 4096  # from here on, report bandwidth; below, latency


@triton.jit
def _empty_kernel(ptr):
    pass


def graph_us(fn, calls: int = 50, reps: int = 20) -> float:
    """Median time of one fn() call, from CUDA-graph replays of `calls` back-to-back calls."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return sorted(times)[len(times) // 2]


def bench_us(fn) -> float:
    """Median over repetitions, L2 flushed before each (triton's do_bench)."""
    return do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def copy_bandwidth_gbs() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    us = bench_us(lambda: dst.copy_(src))
    return 2 * src.numel() / us / 1e3


def main() -> None:
    torch.manual_seed(0)
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    copy_gbs = copy_bandwidth_gbs()
    empty_us = graph_us(lambda: _empty_kernel[(1,)](None))
    print(f"device copy: {copy_gbs:.0f} GB/s (read + write); empty kernel launch (graph): {empty_us:.2f} us")

    torch._dynamo.config.cache_size_limit = 64  # one specialized compile per shape and variant
    compiled_ref = torch.compile(reference.quantize, dynamic=False)
    rows = []
    for m, k in SHAPES:
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        g = torch.tensor(x.float().abs().max().item() / 2688.0, device="cuda")
        n = m * k
        out_bytes = n // 2 + n // 16
        static_bytes, dynamic_bytes = 2 * n + out_bytes, 4 * n + out_bytes
        variants = {
            "ours static": (lambda: nv.quantize(x, g), static_bytes),
            "ours static swz": (lambda: nv.quantize(x, g, swizzle=True), static_bytes),
            "ours dynamic": (lambda: nv.quantize(x), dynamic_bytes),
            "ours dynamic swz": (lambda: nv.quantize(x, swizzle=True), dynamic_bytes),
            "compile(ref) static": (lambda: compiled_ref(x, g), static_bytes),
            "compile(ref) dynamic": (lambda: compiled_ref(x), dynamic_bytes),
            "eager ref dynamic": (lambda: reference.quantize(x), dynamic_bytes),
        }
        for name, (fn, nbytes) in variants.items():
            us = bench_us(fn) if n >= LARGE else graph_us(fn)
            rows.append((f"{m}x{k}", name, us, nbytes / us / 1e3))

    # A few tile configurations on the largest shape (the shipped one is marked).
    x = torch.randn(16384, 8192, dtype=torch.bfloat16, device="cuda")
    g = torch.tensor(0.01, device="cuda")
    shipped = (qk.BLOCK_M, qk.BLOCK_K, qk.NUM_WARPS)
    sweep = []
    for cfg in [(32, 128, 4), (16, 256, 4), (32, 256, 8), (64, 128, 8), (16, 128, 4), (8, 512, 4)]:
        qk.BLOCK_M, qk.BLOCK_K, qk.NUM_WARPS = cfg
        n = x.numel()
        us_s = bench_us(lambda: nv.quantize(x, g))
        us_d = bench_us(lambda: nv.quantize(x))
        sweep.append((cfg, us_s, (2 * n + n // 2 + n // 16) / us_s / 1e3, us_d,
                      (4 * n + n // 2 + n // 16) / us_d / 1e3))
    qk.BLOCK_M, qk.BLOCK_K, qk.NUM_WARPS = shipped

    print("\ntile sweep, 16384x8192 bf16 (BLOCK_M, BLOCK_K, warps): static us, GB/s | dynamic us, GB/s")
    for cfg, us_s, gbs_s, us_d, gbs_d in sweep:
        mark = " (shipped)" if cfg == shipped else ""
        print(f"  {cfg}{mark}: {us_s:8.1f} {gbs_s:6.0f} | {us_d:8.1f} {gbs_d:6.0f}")

    print(f"\n{'shape':>12} {'variant':>22} {'time us':>10} {'GB/s':>8} {'% copy':>7} {'vs compile':>10}")
    by_key = {(s, v): us for s, v, us, _ in rows}
    for shape, name, us, gbs in rows:
        kind = "static" if "static" in name else "dynamic"
        ratio = by_key[(shape, f"compile(ref) {kind}")] / us
        print(f"{shape:>12} {name:>22} {us:10.2f} {gbs:8.0f} {100 * gbs / copy_gbs:6.1f}% {ratio:9.2f}x")
    print(f"(1x4096 target: <= 2x the empty launch, {2 * empty_us:.2f} us)")


if __name__ == "__main__":
    main()
