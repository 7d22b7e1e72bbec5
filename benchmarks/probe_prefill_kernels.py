"""M = 4096 (prefill) by kernel: bf16 cuBLAS against the tiled NVFP4 linear (nvfp4::linear_tiled,
what the backend's eager fallback and bench_gemm's tiled columns run: dequantize + one cuBLASLt
GEMM, W4A4 with x's quantization first), each call's kernels from torch.profiler over CUDA-graph
replays of weight copies beyond L2 (as bench_gemm times them; probe_breakdown.kernel_us).

    python benchmarks/probe_prefill_kernels.py
"""
import torch
import triton
from bench_gemm import weight_copies
from bench_quantize import stream_us
from probe_breakdown import kernel_us

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336)]  # (K, N)
M = 4096
ops = torch.ops.nvfp4


def main():
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    l2 = torch.cuda.get_device_properties().L2_cache_size
    torch.manual_seed(0)
    for k, n in SHAPES:
        w_b, _, w_t = weight_copies(k, n, l2)
        x = torch.randn(M, k, dtype=torch.bfloat16, device="cuda")
        variants = {"bf16": (lambda w: x @ w.T, w_b),
                    "tiled W4A16": (lambda w: ops.linear_tiled(x, *w, None, n, "bf16"), w_t),
                    "tiled W4A4": (lambda w: ops.linear_tiled(x, *w, None, n, "nvfp4"), w_t)}
        for name, (fn, inputs) in variants.items():
            us = stream_us(fn, inputs)
            print(f"K {k} N {n} M {M} {name}: {us:.1f} us a call (CUDA-graph replays)")
            for kernel, t in sorted(kernel_us(fn, inputs).items(), key=lambda kv: -kv[1]):
                print(f"    {t:8.1f} us  {kernel}")
        del w_b, w_t


if __name__ == "__main__":
    main()
