"""Tile configurations of the NVFP4 GEMM, kept apart from the kernel: (BLOCK_M, BLOCK_N, BLOCK_K,
num_warps, num_stages) by path and M bucket. First, correctness-oriented values: not yet tuned
on the device (benchmarks/bench_gemm.py measures them)."""

MMA_DEQUANT = 0
MMA_DOT_SCALED = 1

# sm_100: tcgen05 block-scaled MMA wants 128-row tiles.
DOT_SCALED_CONFIGS = [(128, 128, 128, 4, 3), (128, 256, 128, 8, 3)]

# sm_90 in-kernel dequant, by M bucket (upper bound, inclusive).
DEQUANT_CONFIGS = [
    (16, (16, 64, 128, 4, 3)),    # decode: mma.sync tiles, many programs along N
    (64, (64, 64, 128, 4, 3)),
    (None, (128, 128, 64, 8, 3)),  # prefill: wgmma tiles
]


def gemm_config(m: int, n: int, k: int, mma: int) -> tuple[int, int, int, int, int]:
    if mma == MMA_DOT_SCALED:
        return DOT_SCALED_CONFIGS[0]
    for bound, config in DEQUANT_CONFIGS:
        if bound is None or m <= bound:
            return config
    raise AssertionError("unreachable")


# Which implementation nvfp4::linear uses on CUDA. "dequant_cublas": dequantize W (and, for W4A4,
# the quantized x) to bf16 with the Triton dequantize kernel, then a bf16 cuBLAS GEMM; "triton":
# the NVFP4 GEMM kernel above. Measured on an H200 (benchmarks/results/bench_gemm_h200_first.txt):
# the first Triton kernel was 2.3-16x slower than bf16 cuBLAS at every M (its weight decode costs
# ~20 instructions a weight; the decode floor needs ~4), so dequantize + cuBLAS is the default
# wherever its bf16 output is exact enough (x in bf16); fp16 / fp32 x keep the Triton kernel.
# FORCE_PATH overrides the choice (benchmarks use it to measure both).
FORCE_PATH = None


def linear_path(m: int, n: int, k: int, x_dtype, activation: str) -> str:
    import torch

    if FORCE_PATH is not None:
        return FORCE_PATH
    return "dequant_cublas" if x_dtype == torch.bfloat16 else "triton"
