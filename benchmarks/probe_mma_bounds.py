"""The register-fed decode GEMM (kernels/gemm_mma.py) at M = 1 and 16 with parts of its per-weight
work changed (session 34). Each variant runs in its own process: the JIT picks up a replaced
function at its first compile.

    python benchmarks/probe_mma_bounds.py base
    python benchmarks/probe_mma_bounds.py paired     # x stored in mma pair order (each 8 values as
        0, 4, 1, 5, 2, 6, 3, 7) and _x_pairs' byte permutes dropped: correct, checked
    python benchmarks/probe_mma_bounds.py mmaorder   # the decode of session 6's MMA code order
        (tiled.to_mma_order at 24c0bc2: 11 instructions a word against 16, pairs of consecutive k,
        so x's words go to the mma as loaded) on natural-order codes: its instruction count, wrong
        outputs
    python benchmarks/probe_mma_bounds.py nodecode   # bound: _decode_pairs returns the code word
    python benchmarks/probe_mma_bounds.py noscale    # bound: _scales returns the scale bytes
    python benchmarks/probe_mma_bounds.py nodecode noscale
    python benchmarks/probe_mma_bounds.py nosum      # bound: split 0 runs the epilogue at once, on
        zeros (no barrier, counter atomic or partial loads); every split still stores its partials
    python benchmarks/probe_mma_bounds.py nodecode nosum

Eager tiled W4A16 (gemm_splitk), CUDA-graph times over weight copies beyond L2; base and paired
are checked against float64 first."""
import sys

import triton
import triton.language as tl
from bench_gemm import time_tiled_w4a16

from nvfp4_inductor.kernels import gemm_mma, gemm_splitk

VARIANT = sys.argv[1:] or ["base"]
CHECKED = VARIANT in (["base"], ["paired"])

_MMA_ORDER_ASM: tl.constexpr = tl.constexpr("""
{
.reg .b32 m, s;
and.b32 m, $4, 0x81C081C0; mul.rn.bf16x2 $0, m, $5;
shl.b32 m, $4, 6; and.b32 m, m, 0x81C081C0; mul.rn.bf16x2 $1, m, $5;
shl.b32 m, $4, 3; and.b32 m, m, 0x01C001C0; shl.b32 s, $4, 5; and.b32 s, s, 0x80008000;
or.b32 m, m, s; mul.rn.bf16x2 $2, m, $5;
shr.b32 m, $4, 5; and.b32 m, m, 0x01C001C0; shl.b32 s, $4, 1; and.b32 s, s, 0x80008000;
or.b32 m, m, s; mul.rn.bf16x2 $3, m, $5;
}
""")


@triton.jit
def _x_words(x):
    return x


@triton.jit
def _no_decode(word, scale):
    return word, word, word, word


@triton.jit
def _no_scales(s_pair):
    return s_pair, s_pair


@triton.jit
def _first_split(counter_ptr, num_splits):
    return tl.program_id(1) == 0


@triton.jit
def _no_sum(partial_ptr, num_splits, M, N, cols_n, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
            SPLITS: tl.constexpr):
    return tl.zeros((BLOCK_N, ROWS), tl.float32)


if "paired" in VARIANT or "mmaorder" in VARIANT:
    gemm_mma._x_pairs = _x_words
if "mmaorder" in VARIANT:  # gemm_mma._decode_pairs with this asm (the same operands and outputs)
    gemm_mma._DECODE_PAIRS_ASM = _MMA_ORDER_ASM
if "nodecode" in VARIANT:
    gemm_mma._decode_pairs = _no_decode
if "noscale" in VARIANT:
    gemm_mma._scales = _no_scales
if "nosum" in VARIANT:
    gemm_splitk.last_split = _first_split
    gemm_splitk.sum_splits = _no_sum


def x_as_read(x):
    """paired: x (M, K) with each 8 consecutive values in the order (0, 4, 1, 5, 2, 6, 3, 7)."""
    if "paired" not in VARIANT:
        return x
    m, k = x.shape
    return x.view(m, k // 8, 2, 4).transpose(-1, -2).reshape(m, k).contiguous()


def main():
    time_tiled_w4a16("+".join(VARIANT), CHECKED, x_as_read)


if __name__ == "__main__":
    main()
