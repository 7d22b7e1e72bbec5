"""What M = 9..16 (two x-row blocks) costs the register-fed GEMM (kernels/gemm_mma.py) over M = 1,
eager, tiled weights, CUDA-graph times over weight copies beyond L2 (session 30, benchmarks/NOTES.md).

    python benchmarks/probe_m16.py         # M = 1 / 8 / 16 / 9, and M = 16 with x's rows all one row
                                           # (stride 0: x's L2 traffic of M = 1, the same instructions)
    python benchmarks/probe_m16.py --occ   # M = 16: splits rounded up / down, register ceilings
    python benchmarks/probe_m16.py --dot   # M = 32 / 64 (the tl.dot kernel): splits rounded up / down
    ncu --kernel-name regex:_splitk_kernel --launch-skip 2 --launch-count 1 \
        python benchmarks/probe_m16.py --ncu K N M STRIDE0   # launches for Nsight Compute
"""
import sys

import torch
import triton
from bench_gemm import weight_copies
from bench_quantize import copy_bandwidth_gbs, stream_us

import nvfp4_inductor as nv
from nvfp4_inductor.kernels import gemm_configs
from nvfp4_inductor.kernels.gemm_splitk import gemm_splitk

ops = torch.ops.nvfp4
SHAPES = [(4096, 4096), (4096, 6144), (4096, 14336), (14336, 4096), (4096, 28672), (8192, 28672)]


def tiled_weight(n, k):
    """A fresh random (n, k) NVFP4 weight -> (q, (tiled codes, tiled scales, global scale))."""
    q = nv.quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
    return q, (*ops.tile_weight(q.data, q.scale.view(torch.uint8)), q.global_scale)


def rel_err(got, x, q):
    """max |got - x @ W^T| / max |x @ W^T| against float64."""
    ref = x.double() @ q.dequantize(torch.float32).double().T
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


def run(x, w, n):
    return gemm_splitk(x, w[0], w[1], w[2], None, torch.bfloat16, False, tiled_n=n)


def check():
    for n, k in [(128, 256), (4096, 4096)]:
        q, w = tiled_weight(n, k)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16).expand(16, k)
        err = rel_err(run(x, w, n), x, q)
        assert err < 1e-2, err
    print("stride-0 x correct")


def main():
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    check()
    print(f"device copy: {copy_bandwidth_gbs():.0f} GB/s")
    l2 = torch.cuda.get_device_properties().L2_cache_size
    cols = ["bf16 M16", "M1", "M8", "M16", "M16 x-stride0", "M9"]
    print(f"{'K':>6} {'N':>6} " + " ".join(f"{c:>13}" for c in cols))
    for k, n in SHAPES:
        w_b, w_q, w_t = weight_copies(k, n, l2)
        x16 = torch.randn(16, k, dtype=torch.bfloat16, device="cuda")
        xs0 = torch.randn(1, k, dtype=torch.bfloat16, device="cuda").expand(16, k)
        times = [stream_us(lambda w: x16 @ w.T, w_b)]
        for x in (x16[:1], x16[:8], x16, xs0, x16[:9]):
            times.append(stream_us(lambda w: run(x, w, n), w_t))
        print(f"{k:>6} {n:>6} " + " ".join(f"{t:13.1f}" for t in times), flush=True)
        del w_q, w_t, w_b


def ncu():
    k, n, m, s0 = (int(a) for a in sys.argv[2:6])
    _, w = tiled_weight(n, k)
    x = (torch.randn(1, k, dtype=torch.bfloat16, device="cuda").expand(m, k) if s0
         else torch.randn(m, k, dtype=torch.bfloat16, device="cuda"))
    for _ in range(4):
        run(x, w, n)
    torch.cuda.synchronize()


class _WithMaxnreg:
    """_splitk_kernel launched with a register ceiling."""
    def __init__(self, kernel, maxnreg):
        self.kernel, self.maxnreg = kernel, maxnreg

    def __getitem__(self, grid):
        launch = self.kernel[grid]
        return lambda *a, **kw: launch(*a, maxnreg=self.maxnreg, **kw)


def occupancy():
    """M = 16: programs per SM against a register ceiling (maxnreg), eager."""
    from nvfp4_inductor.kernels import gemm_splitk as sk
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    plain = sk._splitk_kernel
    sms = torch.cuda.get_device_properties().multi_processor_count
    l2 = torch.cuda.get_device_properties().L2_cache_size
    # (maxnreg, programs per SM planned (splits rounded up), at most this many an SM or None)
    variants = [(None, 8, None), (None, 8, 10), (None, 10, 10), (None, 8, 8), (80, 12, 12), (80, 12, None),
                (72, 14, 14), (None, 6, None)]

    def config_of(n, k, per_sm, max_per_sm):
        return gemm_configs._skinny_config(16, n, k, sms, 64, 64, per_sm, 2, 1, 8, max_per_sm)

    # correctness with each ceiling
    for maxnreg, per_sm, max_per_sm in variants:
        sk._splitk_kernel = plain if maxnreg is None else _WithMaxnreg(plain, maxnreg)
        for n, k in [(192, 4160), (4096, 4096)]:
            q, w = tiled_weight(n, k)
            x = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
            config = config_of(n, k, per_sm, max_per_sm)
            got = gemm_splitk(x, w[0], w[1], w[2], None, torch.float32, False, config=config, tiled_n=n,
                              reg_mma=True)
            err = rel_err(got, x, q)
            assert err < 1e-4, (maxnreg, per_sm, n, k, err)
    print("correct at every ceiling")
    print(f"{'K':>6} {'N':>6} " + " ".join(f"{f'{r}/{p}/{c}':>12}" for r, p, c in variants)
          + "  (maxnreg / per SM rounded up / at most: us (splits))")
    for k, n in SHAPES:
        w_b, w_q, w_t = weight_copies(k, n, l2)
        x = torch.randn(16, k, dtype=torch.bfloat16, device="cuda")
        cells = []
        for maxnreg, per_sm, max_per_sm in variants:
            sk._splitk_kernel = plain if maxnreg is None else _WithMaxnreg(plain, maxnreg)
            config = config_of(n, k, per_sm, max_per_sm)
            t = stream_us(lambda w: gemm_splitk(x, w[0], w[1], w[2], None, torch.bfloat16, False,
                                                config=config, tiled_n=n, reg_mma=True), w_t)
            cells.append(f"{t:7.1f} ({config[3]:>2})")
        sk._splitk_kernel = plain
        print(f"{k:>6} {n:>6} " + " ".join(f"{c:>12}" for c in cells), flush=True)
        del w_b, w_q, w_t


def dot_waves():
    """M = 32 / 64 (tiled weights: the tl.dot skinny kernel, 148 / 210 registers on sm_90, so 6 / 4
    programs of 2 warps fit an SM): the eager launcher's splits (~8 an SM, rounded up) against
    splits rounded down to at most P an SM."""
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    sms = torch.cuda.get_device_properties().multi_processor_count
    l2 = torch.cuda.get_device_properties().L2_cache_size
    bn, bk, _, warps, stages = gemm_configs.TILED_CONFIG
    per_sm = {32: (6, 8, 12), 64: (4, 8)}

    def config_of(m, n, k, p):
        return gemm_configs._skinny_config(m, n, k, sms, bn, bk, p, warps, stages,
                                           gemm_configs.MIN_STEPS_PER_SPLIT, max_per_sm=p)

    for n, k in [(192, 4160), (4096, 4096)]:
        q, w = tiled_weight(n, k)
        for m in (32, 64):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            for p in per_sm[m]:
                got = gemm_splitk(x, w[0], w[1], w[2], None, torch.float32, False, config=config_of(m, n, k, p),
                                  tiled_n=n, reg_mma=False)
                err = rel_err(got, x, q)
                assert err < 1e-3, (n, k, m, p, err)
    print("correct")
    print(f"{'K':>6} {'N':>6} {'M':>3} {'bf16':>7} {'shipped':>12} " + "  ".join(f"{'<= ' + str(p) + ' an SM'}" for p in per_sm[32]))
    for k, n in SHAPES:
        w_b, w_q, w_t = weight_copies(k, n, l2)
        for m in (32, 64):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            shipped = gemm_configs.splitk_config(m, n, k, sms, tiled=True, min_steps=gemm_configs.MIN_STEPS_PER_SPLIT)
            cells = [f"{stream_us(lambda w: x @ w.T, w_b):7.1f}"]
            for config in [shipped] + [config_of(m, n, k, p) for p in per_sm[m]]:
                t = stream_us(lambda w: gemm_splitk(x, w[0], w[1], w[2], None, torch.bfloat16, False,
                                                    config=config, tiled_n=n, reg_mma=False), w_t)
                cells.append(f"{t:7.1f} ({config[3]:>2})")
            print(f"{k:>6} {n:>6} {m:>3} " + " ".join(f"{c:>12}" for c in cells), flush=True)
        del w_q, w_t, w_b


if __name__ == "__main__":
    if "--ncu" in sys.argv:
        ncu()
    elif "--occ" in sys.argv:
        occupancy()
    elif "--dot" in sys.argv:
        dot_waves()
    else:
        main()
