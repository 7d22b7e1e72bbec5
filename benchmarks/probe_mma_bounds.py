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

Eager tiled W4A16 (gemm_splitk), CUDA-graph times over weight copies beyond L2; base and paired
are checked against float64 first."""
import sys

import torch
import triton
import triton.language as tl
from bench_gemm import weight_copies
from bench_quantize import stream_us

from nvfp4_inductor.kernels import gemm_mma
from nvfp4_inductor.kernels.gemm_splitk import gemm_splitk

SHAPES = [(4096, 4096), (4096, 6144), (4096, 14336), (14336, 4096), (4096, 28672), (8192, 28672)]
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


if "paired" in VARIANT or "mmaorder" in VARIANT:
    gemm_mma._x_pairs = _x_words
if "mmaorder" in VARIANT:  # gemm_mma._decode_pairs with this asm (the same operands and outputs)
    gemm_mma._DECODE_PAIRS_ASM = _MMA_ORDER_ASM
if "nodecode" in VARIANT:
    gemm_mma._decode_pairs = _no_decode
if "noscale" in VARIANT:
    gemm_mma._scales = _no_scales


def x_as_read(x):
    """paired: x (M, K) with each 8 consecutive values in the order (0, 4, 1, 5, 2, 6, 3, 7)."""
    if "paired" not in VARIANT:
        return x
    m, k = x.shape
    return x.view(m, k // 8, 2, 4).transpose(-1, -2).reshape(m, k).contiguous()


def main():
    print(f"{'+'.join(VARIANT)}: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    l2 = torch.cuda.get_device_properties().L2_cache_size
    torch.manual_seed(0)
    for k, n in SHAPES:
        _, w_q, w_t = weight_copies(k, n, l2)
        row = []
        for m in (1, 16):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            xr = x_as_read(x)
            if CHECKED:
                ref = x.double() @ w_q[0].dequantize(torch.float32).double().T
                got = gemm_splitk(xr, *w_t[0][:3], None, torch.float32, False, tiled_n=n).double()
                assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-5, (k, n, m)
            row.append(stream_us(lambda w: gemm_splitk(xr, w[0], w[1], w[2], None, torch.bfloat16, False,
                                                       tiled_n=n), w_t))
        print(f"{k:>6} {n:>6}  M=1 {row[0]:6.1f} us  M=16 {row[1]:6.1f} us", flush=True)
        del w_q, w_t


if __name__ == "__main__":
    main()
