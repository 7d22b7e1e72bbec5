"""Measured once (H100, results/probe_prefetch_pdl_h100.txt: neither helps; the knobs were removed
in the next commit). The register-fed decode GEMM (kernels/gemm_mma.py, eager nvfp4::linear_tiled) with its loads
issued 1 or 2 tiles ahead (gemm_configs.REG_MMA_AHEAD), launched plainly or as a programmatic
dependent (gemm_configs.PDL: the next GEMM starts and loads its first weight tiles while this one
finishes), at 8 / 12 / 16 programs per SM. Each variant is first checked bit for bit against the
plain launch with the same split (the same MMAs in the same order), then timed by CUDA-graph
replays of back-to-back calls over weights larger than L2, bf16 cuBLAS alongside.

    python benchmarks/probe_prefetch_pdl.py
"""

import math

import torch
from bench_quantize import stream_us

import nvfp4_inductor as nv
from nvfp4_inductor.kernels import gemm_configs

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672)]  # (K, N)
VARIANTS = [(ahead, pdl, per_sm) for per_sm in (8, 12, 16) for ahead in (1, 2) for pdl in (False, True)]
ops = torch.ops.nvfp4


def set_variant(ahead: int, pdl: bool, per_sm: int) -> None:
    gemm_configs.REG_MMA_AHEAD, gemm_configs.PDL = ahead, pdl
    gemm_configs.REG_MMA_CONFIG = (64, 64, per_sm, 4, 1)


def main() -> None:
    torch.manual_seed(0)
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    l2 = torch.cuda.get_device_properties().L2_cache_size
    names = [f"a{a}{'p' if p else '-'}{s}" for a, p, s in VARIANTS]
    print("us a call; aAp S: A tiles ahead, p: PDL launch, S programs per SM")
    print(f"{'K':>6} {'N':>6} {'M':>2} {'bf16':>6} " + " ".join(f"{n:>6}" for n in names))
    for k, n in SHAPES:
        copies = max(2, math.ceil(3 * l2 / (n * k // 2)))
        weights, dense = [], []
        for _ in range(copies):
            w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda")
            q = nv.quantize(w)
            weights.append((*ops.tile_weight(q.data, q.scale.view(torch.uint8)), q.global_scale))
        dense = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for _ in range(max(2, math.ceil(3 * l2 / (n * k * 2))))]
        for m in (1, 8, 16):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            want = {}
            for ahead, pdl, per_sm in VARIANTS:
                set_variant(ahead, pdl, per_sm)
                got = ops.linear_tiled(x, *weights[0], None, n, "bf16")
                ref = want.setdefault(per_sm, got)
                assert torch.equal(got, ref), (k, n, m, ahead, pdl, per_sm)
            base = stream_us(lambda w: x @ w.T, dense)
            times = []
            for variant in VARIANTS:
                set_variant(*variant)
                times.append(stream_us(lambda w: ops.linear_tiled(x, *w, None, n, "bf16"), weights))
            print(f"{k:>6} {n:>6} {m:>2} {base:6.1f} " + " ".join(f"{t:6.1f}" for t in times), flush=True)
        del weights, dense
    set_variant(1, False, 8)


if __name__ == "__main__":
    main()
