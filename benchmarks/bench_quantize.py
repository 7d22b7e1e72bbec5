"""NVFP4 quantize throughput: the fused Triton kernel vs the device copy bandwidth, vs
torch.compile of the reference (Inductor's own code) and the eager reference, same run.

    python benchmarks/bench_quantize.py
    python benchmarks/bench_quantize.py --ours-only   # our kernels only: no torch.compile, no tile sweep
                                                      # (for A/B runs of two code versions in one call)

Bytes counted (bf16 input of N elements): static scale reads x once and writes codes + scales,
2N + N/2 + N/16 bytes; a dynamic per-tensor scale must read x twice (amax, then quantize),
4N + N/2 + N/16. The floor is bytes / copy bandwidth (read + write) measured here. Large shapes
are timed per call with CUDA events, cycling through enough input copies to overflow L2 (no L2
flush between calls: a memset flush leaves up to an L2 of dirty lines that the timed kernel would
pay to write back). Small shapes (decode) are latency-bound: timed as CUDA-graph replays, against
an empty kernel timed the same way.
"""

import argparse
import math
import time

import torch
import triton

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


def stream_us(fn, inputs, rounds: int = 3, reps: int = 10, min_calls: int = 32) -> float:
    """Time of one fn(x), from CUDA-graph replays of calls cycling through `inputs` (together
    larger than L2): the GPU's time alone, without the host's launch overhead. At least
    `min_calls` calls a replay (more rounds where there are few inputs): a replay's start is not
    free, and with only a few calls a replay it weighs noticeably on each short kernel."""
    rounds = max(rounds, math.ceil(min_calls / len(inputs)))
    return graph_us(lambda: [fn(x) for x in inputs], calls=rounds, reps=reps) / len(inputs)


def eager_overhead_us(fn, calls: int = 200) -> float:
    """Host time of one eager call (the GPU work is tiny, so the host is the bottleneck)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def copies_beyond_l2(x: torch.Tensor) -> list:
    l2 = torch.cuda.get_device_properties().L2_cache_size
    n = max(2, math.ceil(3 * l2 / (x.numel() * x.element_size())))
    return [x] + [torch.randn_like(x) for _ in range(n - 1)]


def copy_bandwidth_gbs() -> float:
    """1 GiB device copies timed with events (not in a graph: a graph turns them into copy-engine
    memcpy nodes, which measure markedly slower)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return 2 * src.numel() / sorted(times)[len(times) // 2] / 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ours-only", action="store_true",
                        help="time only our kernels (no reference rows, no tile sweep)")
    args = parser.parse_args()
    ours_only = args.ours_only
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
            "ours static": (lambda x: nv.quantize(x, g), static_bytes),
            "ours static swz": (lambda x: nv.quantize(x, g, swizzle=True), static_bytes),
            "ours dynamic": (lambda x: nv.quantize(x), dynamic_bytes),
            "ours dynamic swz": (lambda x: nv.quantize(x, swizzle=True), dynamic_bytes),
            # W4A4's activation quantization without FP4 tensor cores: bf16 values out (2n bytes)
            "ours values dynamic": (lambda x: torch.ops.nvfp4.quantize_values(x), 6 * n),
            "compile(ref) static": (lambda x: compiled_ref(x, g), static_bytes),
            "compile(ref) dynamic": (lambda x: compiled_ref(x), dynamic_bytes),
            "eager ref dynamic": (lambda x: reference.quantize(x), dynamic_bytes),
        }
        if ours_only:
            variants = {name: v for name, v in variants.items() if name.startswith("ours")}
        inputs = copies_beyond_l2(x) if n >= LARGE else None
        for name, (fn, nbytes) in variants.items():
            us = stream_us(fn, inputs) if n >= LARGE else graph_us(lambda: fn(x))
            rows.append((f"{m}x{k}", name, us, nbytes / us / 1e3))
        del inputs

    if not ours_only:
        tile_sweep()
    print(f"\n{'shape':>12} {'variant':>22} {'time us':>10} {'GB/s':>8} {'% copy':>7} {'vs compile':>10}")
    by_key = {(s, v): us for s, v, us, _ in rows}
    for shape, name, us, gbs in rows:
        kind = "static" if "static" in name else "dynamic"
        reference_us = by_key.get((shape, f"compile(ref) {kind}"))
        ratio = f"{reference_us / us:9.2f}x" if reference_us else f"{'-':>10}"
        print(f"{shape:>12} {name:>22} {us:10.2f} {gbs:8.0f} {100 * gbs / copy_gbs:6.1f}% {ratio}")
    print(f"(1x4096 target: <= 2x the empty launch, {2 * empty_us:.2f} us)")
    x = torch.randn(1, 4096, dtype=torch.bfloat16, device="cuda")
    g = torch.tensor(0.01, device="cuda")
    print(f"eager host overhead per call, 1x4096: static {eager_overhead_us(lambda: nv.quantize(x, g)):.1f} us,"
          f" dynamic {eager_overhead_us(lambda: nv.quantize(x)):.1f} us")


def tile_sweep() -> None:
    """Tile configurations on the largest shape (the shipped ones are marked)."""
    x = torch.randn(16384, 8192, dtype=torch.bfloat16, device="cuda")
    inputs = copies_beyond_l2(x)
    g = torch.tensor(0.01, device="cuda")
    n = x.numel()
    static_bytes, dynamic_bytes = 2 * n + n // 2 + n // 16, 4 * n + n // 2 + n // 16
    shipped = (qk.LARGE_TILE, qk.AMAX_TILE)
    print("\ntile sweep, 16384x8192 bf16: quantize tile (BLOCK_M, BLOCK_K, warps) -> static GB/s;"
          " amax tile (rows, cols) -> dynamic GB/s")
    for tile in [(16, 256, 4), (32, 128, 4), (16, 128, 4), (32, 256, 8)]:
        qk.LARGE_TILE = tile
        us = stream_us(lambda x: nv.quantize(x, g), inputs)
        mark = " (shipped)" if tile == shipped[0] else ""
        print(f"  quantize {tile}{mark}: {us:8.1f} us {static_bytes / us / 1e3:6.0f} GB/s")
    qk.LARGE_TILE = shipped[0]
    for amax_tile in [(16, 512), (8, 512), (32, 256)]:
        qk.AMAX_TILE = amax_tile
        us = stream_us(lambda x: nv.quantize(x), inputs)
        mark = " (shipped)" if amax_tile == shipped[1] else ""
        print(f"  amax {amax_tile}{mark}: {us:8.1f} us {dynamic_bytes / us / 1e3:6.0f} GB/s")
    qk.AMAX_TILE = shipped[1]


if __name__ == "__main__":
    main()
