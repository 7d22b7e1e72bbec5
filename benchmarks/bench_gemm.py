"""NVFP4 linear (y = x @ W^T) vs bf16 cuBLAS, same run.

    python benchmarks/bench_gemm.py [--ms 4096]

Times are CUDA-graph replays cycling through weight copies, each format's set 3x the L2 (each call
reads its weights from HBM, as in a real model), at least 32 calls a replay. W4A4 includes
quantizing x. The floor is the
NVFP4 bytes (weights 0.5625 B/element, x and y in bf16) over the copy bandwidth measured here.
"""

import argparse
import math

import torch
import triton
from bench_quantize import copy_bandwidth_gbs, stream_us

import nvfp4_inductor as nv
from nvfp4_inductor.kernels import gemm_configs
from nvfp4_inductor.kernels.gemm_splitk import gemm_splitk

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672)]  # (K, N)
MS = [1, 16, 64, 256, 4096]


def weight_copies(k: int, n: int, l2: int):
    """-> (bf16 (N, K) weights, NVFP4 weights, their tiled parts + global scale): fresh random
    copies, each format's set 3x the L2 in its own bytes (the NVFP4 set needs 3.56x more copies)."""
    def copies(nbytes):
        return max(2, math.ceil(3 * l2 / nbytes))

    w_bf16 = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for _ in range(copies(n * k * 2))]
    w_fp4 = [nv.quantize(torch.randn(n, k, dtype=torch.bfloat16, device="cuda"))
             for _ in range(copies(n * k * 0.5625))]
    w_tiled = [(*torch.ops.nvfp4.tile_weight(q.data, q.scale.view(torch.uint8)), q.global_scale) for q in w_fp4]
    return w_bf16, w_fp4, w_tiled


# the decode GEMM probes' shapes (K, N): the four above and the decoder block's q / k / v and gate / up
PROBE_SHAPES = [(4096, 4096), (4096, 6144), (4096, 14336), (14336, 4096), (4096, 28672), (8192, 28672)]


def time_tiled_w4a16(label: str, checked: bool = True, x_as_read=lambda x: x) -> None:
    """Eager tiled W4A16 (kernels/gemm_splitk.py, its default config) at M = 1 and 16 on PROBE_SHAPES,
    for the probes that change that kernel: checked against float64 first where `checked` (1e-5 of
    the largest output), then CUDA-graph times over weight copies beyond L2, a row a shape.
    x_as_read: the x the kernel is given (a probe's own layout of it)."""
    print(f"{label}: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    l2 = torch.cuda.get_device_properties().L2_cache_size
    torch.manual_seed(0)
    for k, n in PROBE_SHAPES:
        _, w_q, w_t = weight_copies(k, n, l2)
        row = []
        for m in (1, 16):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            xr = x_as_read(x)
            if checked:
                ref = x.double() @ w_q[0].dequantize(torch.float32).double().T
                got = gemm_splitk(xr, *w_t[0][:3], None, torch.float32, False, tiled_n=n).double()
                assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-5, (k, n, m)
            row.append(stream_us(lambda w: gemm_splitk(xr, w[0], w[1], w[2], None, torch.bfloat16, False,
                                                       tiled_n=n), w_t))
        print(f"{k:>6} {n:>6}  M=1 {row[0]:6.1f} us  M=16 {row[1]:6.1f} us", flush=True)
        del w_q, w_t


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ms", type=int, nargs="+", default=MS, help="rows of x (default: all)")
    ms = parser.parse_args().ms
    torch.manual_seed(0)
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    copy = copy_bandwidth_gbs()
    l2 = torch.cuda.get_device_properties().L2_cache_size
    print(f"device copy: {copy:.0f} GB/s")
    print("W4A16 / W4A4: nvfp4_inductor.linear (M <= 16: the skinny split-K kernel; above: dequantize +"
          " cuBLAS); tiled16 / tiled4: nvfp4::linear_tiled, what backend='nvfp4' calls (weights in the"
          " tiled layout); deq16: W4A16 through dequantize + cuBLAS, forced. x: speed-up over bf16"
          " cuBLAS (>1 is faster); floor: NVFP4 bytes at the copy bandwidth.")
    print(f"\n{'K':>6} {'N':>6} {'M':>5} {'bf16 us':>8} {'W4A16':>7} {'W4A4':>7} {'tiled16':>8} {'tiled4':>7}"
          f" {'deq16':>7} {'floor':>6} | {'W4A16 x':>7} {'W4A4 x':>6} {'tiled16 x':>9} {'tiled4 x':>8}"
          f" {'deq16 x':>7} {'floor x':>7}")
    ops = torch.ops.nvfp4
    for k, n in SHAPES:
        w_bf16, w_fp4, w_tiled = weight_copies(k, n, l2)
        for m in ms:
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            bf16 = stream_us(lambda w: x @ w.T, w_bf16)
            w4a16 = stream_us(lambda w: nv.linear(x, w), w_fp4)
            w4a4 = stream_us(lambda w: nv.linear(x, w, activation="nvfp4"), w_fp4)
            t16 = stream_us(lambda w: ops.linear_tiled(x, *w, None, n, "bf16"), w_tiled)
            t4 = stream_us(lambda w: ops.linear_tiled(x, *w, None, n, "nvfp4"), w_tiled)
            gemm_configs.FORCE_PATH = "dequant_cublas"
            deq16 = stream_us(lambda w: nv.linear(x, w), w_fp4)
            gemm_configs.FORCE_PATH = None
            floor = (n * k * 0.5625 + 2 * m * k + 2 * m * n) / copy / 1e3
            times = (w4a16, w4a4, t16, t4, deq16, floor)
            print(f"{k:>6} {n:>6} {m:>5} {bf16:8.1f} " + " ".join(f"{t:7.1f}" for t in times) + " | "
                  + " ".join(f"{bf16 / t:7.2f}" for t in times), flush=True)
        del w_bf16, w_fp4, w_tiled


if __name__ == "__main__":
    main()
