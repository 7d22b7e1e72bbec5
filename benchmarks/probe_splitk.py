"""Probe for the skinny (split-K, word-decode) NVFP4 GEMM: correctness of the inline-PTX decode on
the GPU, then a config sweep against bf16 cuBLAS, same run. Not a benchmark of record
(bench_gemm.py is): it picks the configurations that go into the heuristic table.

    python benchmarks/probe_splitk.py [--no-decode]

--no-decode also times the default configuration with the weight decode replaced by one
conversion a byte (row-major and tiled weights): what the loads, MMAs and split-K cost alone.
"""

import math
import sys

import torch
import triton
from bench_quantize import copy_bandwidth_gbs, stream_us

import nvfp4_inductor as nv
from nvfp4_inductor import tiled as tiled_layout
from nvfp4_inductor.kernels import gemm_splitk as gs

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672)]  # (K, N)


def rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm()).item()


def check() -> None:
    gen = torch.Generator().manual_seed(1)
    worst = 0.0
    for m, n, k in [(1, 4096, 4096), (7, 1056, 1024), (16, 80, 160), (33, 520, 512), (64, 256, 4096)]:
        for swizzled in (False, True):
            for x_scale in (1.0, 3e4, 1e-6):
                x = (torch.randn(m, k, generator=gen) * x_scale).to(torch.bfloat16)
                w = torch.randn(n, k, generator=gen) * torch.logspace(-3, 3, k)[None, :].sqrt()
                q = nv.quantize(w, swizzle=swizzled, per_row=(x_scale == 1.0))
                bias = torch.randn(n, generator=gen)
                want = x.double() @ q.dequantize(torch.float32).double().T + bias.double()
                y = gs.gemm_splitk(x.cuda(), q.data.cuda(), q.scale.view(torch.uint8).cuda(),
                                   q.global_scale.cuda(), bias.cuda(), torch.float32, swizzled)
                e = rel(y, want)
                worst = max(worst, e)
                if e > 1e-5:
                    print(f"FAIL m={m} n={n} k={k} swizzled={swizzled} x_scale={x_scale}: rel {e:.2e}")
    # the tiled layout (tile_weight), padded N and K
    for m, n, k in [(1, 4096, 4096), (7, 1056, 1040)]:
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        q = nv.quantize(torch.randn(n, k, generator=gen))
        cfg = (16, 64, 64, 3, 2, 4)
        td, ts = tiled_layout.tile(q.data.cuda(), q.scale.view(torch.uint8).cuda())
        y = gs.gemm_splitk(x.cuda(), td, ts, q.global_scale.cuda(), None, torch.float32, False, config=cfg,
                           tiled_n=n)
        e = rel(y, x.double() @ q.dequantize(torch.float32).double().T)
        worst = max(worst, e)
        if e > 1e-5:
            print(f"FAIL tiled m={m} n={n} k={k}: rel {e:.2e}")
    # a NaN block makes exactly its row's outputs NaN
    x = torch.randn(3, 256, generator=gen).to(torch.bfloat16)
    w = torch.randn(64, 256, generator=gen)
    w[5, 17] = float("nan")
    q = nv.quantize(w)
    y = gs.gemm_splitk(x.cuda(), q.data.cuda(), q.scale.view(torch.uint8).cuda(), q.global_scale.cuda(),
                       None, torch.float32, False).cpu()
    nan_ok = bool(y[:, 5].isnan().all() and not y[:, torch.arange(64) != 5].isnan().any())
    print(f"check: worst rel error {worst:.2e} (fp32 out vs float64 reference); NaN block local: {nan_ok}")


def no_decode_module():
    """The same kernel with the weight decode replaced by one conversion a byte: what the loads,
    the MMAs and the split-K cost without the decode arithmetic."""
    import importlib.util
    import inspect

    source = inspect.getsource(gs).replace(
        "low, high = _decode_words(packed, scale)", "low = packed.to(tl.bfloat16) * scale\n            high = low")
    source = source.replace("from ..", "from nvfp4_inductor.").replace(
        "from . import", "from nvfp4_inductor.kernels import").replace(
        "from ._common import", "from nvfp4_inductor.kernels._common import")
    path = "/tmp/gemm_splitk_nodecode.py"
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("gemm_splitk_nodecode", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    check()
    copy = copy_bandwidth_gbs()
    sms = torch.cuda.get_device_properties().multi_processor_count
    l2 = torch.cuda.get_device_properties().L2_cache_size
    print(f"copy {copy:.0f} GB/s, {sms} SMs")
    configs = [(64, 64, 8, 2, 4), (128, 64, 8, 2, 4), (64, 128, 8, 2, 4), (128, 128, 4, 2, 4),
               (64, 64, 16, 2, 4), (64, 256, 4, 2, 3)]
    print("configs (BLOCK_N, BLOCK_K, programs per SM, warps, stages):", configs)
    nd = no_decode_module() if "--no-decode" in sys.argv else None
    for k, n in SHAPES:
        copies = max(2, math.ceil(3 * l2 / (n * k * 2)))
        w_bf16 = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for _ in range(copies)]
        w_fp4 = [nv.quantize(w) for w in w_bf16]
        parts = [(q.data, q.scale.view(torch.uint8), q.global_scale) for q in w_fp4]
        tiled = [(*tiled_layout.tile(p[0], p[1]), p[2]) for p in parts]
        for m in (1, 16):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            bf16 = stream_us(lambda w: x @ w.T, w_bf16, rounds=2)
            floor = (n * k * 0.5625) / copy / 1e3
            row = []
            for bn, bk, f, warps, stages in configs:
                bm = max(16, triton.next_power_of_2(m))
                tiles = triton.cdiv(k, bk)
                splits = max(1, min(tiles, triton.cdiv(f * sms, triton.cdiv(n, bn))))
                cfg = (bm, bn, bk, splits, warps, stages)
                try:
                    t = stream_us(lambda p: gs.gemm_splitk(x, p[0], p[1], p[2], None, torch.bfloat16, False,
                                                           config=cfg), parts, rounds=2)
                    if (bn, bk) == (tiled_layout.TILE_N, tiled_layout.TILE_K):
                        t_tiled = stream_us(lambda p: gs.gemm_splitk(x, p[0], p[1], p[2], None, torch.bfloat16,
                                                                     False, config=cfg, tiled_n=n), tiled, rounds=2)
                        row.append((t_tiled, ("tiled", cfg)))
                except Exception as exc:  # noqa: BLE001 - a config that does not compile is reported
                    print(f"  config {cfg} failed: {type(exc).__name__}: {str(exc)[:200]}")
                    t = math.nan
                row.append((t, cfg))
            if nd is not None:
                for layout, ws, tiled_n in (("row-major", parts, None), ("tiled", tiled, n)):
                    t_nd = stream_us(lambda p: nd.gemm_splitk(x, p[0], p[1], p[2], None, torch.bfloat16,
                                                              False, tiled_n=tiled_n), ws, rounds=2)
                    print(f"  no-decode probe, {layout} weights, default config: {t_nd:.1f} us")
            best = min(row, key=lambda r: r[0] if r[0] == r[0] else 1e9)
            cells = " ".join(f"{t:7.1f}" for t, _ in row)
            print(f"K={k:>5} N={n:>5} M={m:>3} bf16 {bf16:7.1f} floor {floor:6.1f} | {cells} | best {best[0]:.1f} us"
                  f" = {bf16 / best[0]:.2f}x bf16 ({best[1]})")
            sys.stdout.flush()
        del w_bf16, w_fp4, parts


if __name__ == "__main__":
    main()
