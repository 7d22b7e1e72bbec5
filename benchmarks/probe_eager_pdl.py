"""The eager split-K GEMM launched with programmatic dependent launch or not (session 32).

    python benchmarks/probe_eager_pdl.py

Variants (gemm_splitk.LAUNCH_PDL): off; on (every program waits before any load; the next launch
is not released early). Session 32 also ran a third, the next launch released after the mainloop
(experiment code, not kept: slower at M = 16; results/probe_eager_pdl_session32_h100.txt).
bench_gemm's method (CUDA-graph replays over weight copies 3x the L2), alternating twice; outputs
checked equal.
"""

import torch
import triton
from bench_gemm import weight_copies
from bench_quantize import stream_us

import nvfp4_inductor as nv  # noqa: F401  (registers the ops)
from nvfp4_inductor.kernels import gemm_splitk

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672)]
VARIANTS = {"off": False, "wait": True}


def set_variant(name):
    gemm_splitk.LAUNCH_PDL = VARIANTS[name]


def main():
    torch.manual_seed(0)
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    l2 = torch.cuda.get_device_properties().L2_cache_size
    ops = torch.ops.nvfp4
    print(f"{'K':>6} {'N':>6} {'M':>3} {'op':>8} {'bf16':>7} " + " ".join(f"{v:>20}" for v in VARIANTS))
    for k, n in SHAPES:
        w_bf16, w_fp4, w_tiled = weight_copies(k, n, l2)
        for m in (1, 16):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            bf16 = stream_us(lambda w: x @ w.T, w_bf16)
            fns = {
                "tiled16": lambda w: ops.linear_tiled(x, *w, None, n, "bf16"),
                "tiled4": lambda w: ops.linear_tiled(x, *w, None, n, "nvfp4"),
            }
            for name, fn in fns.items():
                outs = {}
                for v in VARIANTS:
                    set_variant(v)
                    outs[v] = fn(w_tiled[0])
                for v in VARIANTS:
                    assert torch.equal(outs[v], outs["off"]), (k, n, m, name, v)
                times = {v: [] for v in VARIANTS}
                for _ in range(2):
                    for v in VARIANTS:
                        set_variant(v)
                        times[v].append(stream_us(fn, w_tiled))
                cells = " ".join(f"{a:6.1f}/{b:5.1f} {bf16 / min(a, b):5.2f}x".rjust(20)
                                 for a, b in times.values())
                print(f"{k:>6} {n:>6} {m:>3} {name:>8} {bf16:7.1f} {cells}", flush=True)
        del w_bf16, w_fp4, w_tiled
    set_variant("wait")


if __name__ == "__main__":
    main()
