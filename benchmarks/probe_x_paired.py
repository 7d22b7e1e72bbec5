"""Upper bound of x stored in mma pair order (experiment, session 34): the register-fed mainloop
(kernels/gemm_mma.py) forms each B operand from two loaded x words with a byte permute
(_x_pairs: 8 PRMT a tile per x-row block). With x stored so that a lane's 16 values are already in
the pair order (0, 4, 1, 5, 2, 6, 3, 7, 8, 12, ...), the loaded words are the operands.

    python benchmarks/probe_x_paired.py base     # the shipped mainloop
    python benchmarks/probe_x_paired.py paired   # _x_pairs replaced by the identity, x pre-paired

Eager tiled W4A16 (gemm_splitk), M = 1 and 16, CUDA-graph times over weight copies beyond L2."""
import sys

import torch
import triton
import triton.language as tl
from bench_gemm import weight_copies
from bench_quantize import stream_us

import nvfp4_inductor as nv
from nvfp4_inductor.kernels import gemm_mma
from nvfp4_inductor.kernels.gemm_splitk import gemm_splitk

SHAPES = [(4096, 4096), (4096, 6144), (4096, 14336), (14336, 4096), (4096, 28672), (8192, 28672)]
PAIRED = sys.argv[1] == "paired"


@triton.jit
def _x_words(x):
    return x


if PAIRED:
    gemm_mma._x_pairs = _x_words


def paired(x):
    """x (M, K) -> each 8 consecutive values in the order (0, 4, 1, 5, 2, 6, 3, 7)."""
    m, k = x.shape
    return x.view(m, k // 8, 2, 4).transpose(-1, -2).reshape(m, k).contiguous()


def run(x, w, n):
    return gemm_splitk(paired(x) if PAIRED else x, w[0], w[1], w[2], None, torch.bfloat16, False, tiled_n=n)


def main():
    print(f"{sys.argv[1]}: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    l2 = torch.cuda.get_device_properties().L2_cache_size
    torch.manual_seed(0)
    for k, n in SHAPES:
        _, w_q, w_t = weight_copies(k, n, l2)
        row = []
        for m in (1, 16):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            ref = x.double() @ w_q[0].dequantize(torch.float32).double().T
            got = run(x, w_t[0], n).double()
            err = ((got - ref).abs().max() / ref.abs().max()).item()
            assert err < 1e-2, (k, n, m, err)
            xp = paired(x) if PAIRED else x
            call = (lambda w: gemm_splitk(xp, w[0], w[1], w[2], None, torch.bfloat16, False, tiled_n=n))
            row.append(stream_us(call, w_t))
        print(f"{k:>6} {n:>6}  M=1 {row[0]:6.1f} us  M=16 {row[1]:6.1f} us", flush=True)
        del w_q, w_t


if __name__ == "__main__":
    main()
