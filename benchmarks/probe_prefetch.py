"""Memory-level parallelism of the register-fed decode GEMM (kernels/gemm_mma.py) at M = 1 and 16:
L2 prefetch of the tiles ahead (per lane, or through the bulk-copy unit), a register cap that lets
ptxas keep the next tile's loads at the top of the loop (it sinks them behind the MMAs to reach
~40 registers otherwise), and programs per SM. Every variant is checked bit-identical to the plain
kernel first, then timed (CUDA-graph replays over weight copies beyond L2), same run. Not a
benchmark of record (bench_gemm.py is).

    python benchmarks/probe_prefetch.py
"""

import math

import torch
import triton
from bench_quantize import copy_bandwidth_gbs, stream_us

import nvfp4_inductor as nv
from nvfp4_inductor.kernels import gemm_configs
from nvfp4_inductor.kernels.gemm_splitk import gemm_splitk

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672), (4096, 1024)]  # (K, N)
# name: (prefetch distance in tiles, < 0 bulk; maxnreg; programs per SM)
VARIANTS = {
    "base": (0, None, 8),
    "L2x2": (2, None, 8),
    "L2x4": (4, None, 8),
    "L2x8": (8, None, 8),
    "bulk4": (-4, None, 8),
    "bulk8": (-8, None, 8),
    "r64": (0, 64, 8),
    "r64L2x4": (4, 64, 8),
    "r64L2x8": (8, 64, 8),
    "L2x4s12": (4, None, 12),
    "L2x4s4": (4, None, 4),
    "r64L2x4s4": (4, 64, 4),
}
ops = torch.ops.nvfp4


def run(x, w, n, k, variant):
    prefetch, maxnreg, per_sm = VARIANTS[variant]
    sms = torch.cuda.get_device_properties().multi_processor_count
    _, _, _, splits, _, _ = gemm_configs._skinny_config(x.shape[0], n, k, sms, 64, 64, per_sm, 4, 1, 8)
    return gemm_splitk(x, w[0], w[1], w[2], None, torch.float32, False, config=(16, 64, 64, splits, 4, 1),
                       tiled_n=n, reg_mma=True, prefetch=prefetch, maxnreg=maxnreg)


def check() -> None:
    for n, k in [(64, 64), (80, 176), (4096, 4096), (1024, 14336), (192, 4160)]:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        q = nv.quantize(w)
        tiled = (*ops.tile_weight(q.data, q.scale.view(torch.uint8)), q.global_scale)
        ref = q.dequantize(torch.float32).double()
        for m in (1, 3, 9, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            base = run(x, tiled, n, k, "base")
            err = ((base.double() - x.double() @ ref.T).abs().max() / (x.double() @ ref.T).abs().max()).item()
            assert err < 1e-4, (n, k, m, err)
            for variant in VARIANTS:
                y = run(x, tiled, n, k, variant)
                # the same splits give the same sums; other splits differ in fp32 rounding only
                same_splits = VARIANTS[variant][2] == VARIANTS["base"][2]
                if same_splits:
                    assert torch.equal(y, base), (variant, n, k, m)
                else:
                    torch.testing.assert_close(y, base, rtol=1e-5, atol=1e-5 * base.abs().max().item())
    print("correct: every variant equals the plain kernel (bit for bit at the same split)")


def main() -> None:
    torch.manual_seed(0)
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    check()
    copy = copy_bandwidth_gbs()
    l2 = torch.cuda.get_device_properties().L2_cache_size
    print(f"device copy: {copy:.0f} GB/s; times in us (kernel + reduce), x: speed-up over bf16 cuBLAS")
    names = list(VARIANTS)
    print(f"{'K':>6} {'N':>6} {'M':>3} {'bf16':>7} {'floor':>6} " + " ".join(f"{c:>9}" for c in names))
    for k, n in SHAPES:
        copies = max(2, math.ceil(3 * l2 / (n * k * 2)))
        w_bf16 = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for _ in range(copies)]
        w_q = [nv.quantize(w) for w in w_bf16]
        w_tiled = [(*ops.tile_weight(q.data, q.scale.view(torch.uint8)), q.global_scale) for q in w_q]
        for m in (1, 16):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            bf16 = stream_us(lambda w: x @ w.T, w_bf16)
            floor = (n * k * 0.5625 + 2 * m * k + 2 * m * n) / copy / 1e3
            times = [stream_us(lambda w: run(x, w, n, k, v), w_tiled) for v in names]
            print(f"{k:>6} {n:>6} {m:>3} {bf16:7.1f} {floor:6.1f} "
                  + " ".join(f"{t:5.1f} {bf16 / t:3.1f}" for t in times), flush=True)
        del w_bf16, w_q, w_tiled


if __name__ == "__main__":
    main()
