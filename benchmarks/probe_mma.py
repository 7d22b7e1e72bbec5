"""The register-fed skinny GEMM (kernels/gemm_mma.py) against the tl.dot skinny kernel and bf16
cuBLAS at decode sizes, same run: correctness first (float64 reference), then CUDA-graph times
over weight copies beyond L2. Not a benchmark of record (bench_gemm.py is).

    python benchmarks/probe_mma.py
    python benchmarks/probe_mma.py --min-steps   # the decoder block's shapes: K-steps a split runs at least
    python benchmarks/probe_mma.py --rows        # the register-fed mainloop on row-major weights
    python benchmarks/probe_mma.py --per-sm [P ...]  # programs per SM at M = 9..16 (two x-row blocks)
    python benchmarks/probe_mma.py --m32         # four x-row blocks (M = 17..32) against what ran there
    python benchmarks/probe_mma.py --splits [--rows]  # K-steps a split at M = 1 and 16 (the default marked *)
    python benchmarks/probe_mma.py --sum         # partials the split sum loads at once: 8 a thread vs the table
"""

import math
import sys

import torch
import triton
from bench_gemm import weight_copies
from bench_quantize import copy_bandwidth_gbs, stream_us

import nvfp4_inductor as nv
from nvfp4_inductor.kernels import gemm_configs, gemm_mma
from nvfp4_inductor.kernels.gemm_splitk import gemm_splitk

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672), (4096, 1024)]  # (K, N)
ops = torch.ops.nvfp4
PER_SM = (8, 16, 24)  # programs per SM of the register-fed kernel


def check(layouts=("tiled",)) -> None:
    """The register-fed kernel against float64 at M <= 16 on each weight layout: "tiled",
    "rows" (row-major, plain scales), "rows-swizzled"."""
    worst = 0.0
    for n, k in [(64, 64), (80, 176), (4096, 4096), (1000, 14336), (192, 4160)]:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for layout in layouts:
            q = nv.quantize(w, swizzle=layout == "rows-swizzled")
            if layout == "tiled":
                data, scale, tiled_n = *ops.tile_weight(q.data, q.scale.view(torch.uint8)), n
            else:
                data, scale, tiled_n = q.data, q.scale.view(torch.uint8), None
            w_ref = q.dequantize(torch.float32).double()
            for m in (1, 3, 8, 9, 16):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
                ref = x.double() @ w_ref.T + bias.double()
                for splits in (None, 1, 3):
                    config = None if splits is None else (16, 64, 64, splits, gemm_mma.WARPS, 1)
                    y = gemm_splitk(x, data, scale, q.global_scale, bias, torch.float32, q.swizzled,
                                    config=config, tiled_n=tiled_n, reg_mma=True)
                    err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
                    worst = max(worst, err)
                    assert err < 1e-4, (n, k, m, layout, splits, err)
    print(f"correct ({', '.join(layouts)}): worst relative error {worst:.2e} (fp32 out vs float64)")


def _print_header(cols, width: int) -> None:
    """Times in the given columns, then each one's speed-up over the first (bf16 cuBLAS)."""
    print(f"{'K':>6} {'N':>6} {'M':>3} " + " ".join(f"{c:>{width}}" for c in cols) + " | x bf16: "
          + " ".join(f"{c:>{width}}" for c in cols[1:]))


def _print_row(k: int, n: int, m: int, times, width: int) -> None:
    print(f"{k:>6} {n:>6} {m:>3} " + " ".join(f"{t:{width}.1f}" for t in times) + " | x bf16: "
          + " ".join(f"{times[0] / t:{width}.2f}" for t in times[1:]), flush=True)


def main() -> None:
    torch.manual_seed(0)
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    check()
    copy = copy_bandwidth_gbs()
    l2 = torch.cuda.get_device_properties().L2_cache_size
    print(f"device copy: {copy:.0f} GB/s")
    cols = ["bf16", "tiled"] + [f"mma{p}" for p in PER_SM] + ["floor"]
    sms = torch.cuda.get_device_properties().multi_processor_count
    _print_header(cols, 7)
    for k, n in SHAPES:
        copies = max(2, math.ceil(3 * l2 / (n * k * 2)))
        w_bf16 = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for _ in range(copies)]
        w_q = [nv.quantize(w) for w in w_bf16]
        w_tiled = [(*ops.tile_weight(q.data, q.scale.view(torch.uint8)), q.global_scale) for q in w_q]
        for m in (1, 4, 16):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            old = gemm_configs.splitk_config(m, n, k, sms, tiled=True, min_steps=8)
            times = [stream_us(lambda w: x @ w.T, w_bf16),
                     stream_us(lambda w: gemm_splitk(x, w[0], w[1], w[2], None, torch.bfloat16, False,
                                                     config=old, tiled_n=n, reg_mma=False), w_tiled)]
            for per_sm in PER_SM:
                _, _, _, splits, _, _ = gemm_configs._skinny_config(m, n, k, sms, 64, 64, per_sm, 4, 1, 8)
                config = (16, 64, 64, splits, gemm_mma.WARPS, 1)
                times.append(stream_us(lambda w: gemm_splitk(x, w[0], w[1], w[2], None, torch.bfloat16, False,
                                                             config=config, tiled_n=n, reg_mma=True), w_tiled))
            times.append((n * k * 0.5625 + 2 * m * k + 2 * m * n) / copy / 1e3)
            _print_row(k, n, m, times, 7)
        del w_bf16, w_q, w_tiled


def min_steps_sweep() -> None:
    """The register-fed kernel with the default programs per SM, splits of at least 1 / 2 / 4 / 8
    K-steps (the template's rule is 1, the eager launcher's 8), on the decoder block's GEMMs
    (q / k / v merged, o, gate / up merged, down) at M = 1 and 16."""
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    l2 = torch.cuda.get_device_properties().L2_cache_size
    sms = torch.cuda.get_device_properties().multi_processor_count
    steps = (1, 2, 4, 8)
    print(f"{'K':>6} {'N':>6} {'M':>3} " + " ".join(f"{'min ' + str(s):>12}" for s in steps) + "  (us, splits)")
    for k, n in [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]:
        copies = max(2, math.ceil(3 * l2 / (n * k * 0.5625)))
        w_q = [nv.quantize(torch.randn(n, k, dtype=torch.bfloat16, device="cuda")) for _ in range(copies)]
        w_tiled = [(*ops.tile_weight(q.data, q.scale.view(torch.uint8)), q.global_scale) for q in w_q]
        for m in (1, 16):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            cells = []
            for min_steps in steps:
                config = gemm_configs.splitk_config(m, n, k, sms, reg_mma=True, min_steps=min_steps)
                t = stream_us(lambda w: gemm_splitk(x, w[0], w[1], w[2], None, torch.bfloat16, False,
                                                   config=config, tiled_n=n, reg_mma=True), w_tiled)
                cells.append(f"{t:7.1f} ({config[3]:>2})")
            print(f"{k:>6} {n:>6} {m:>3} " + " ".join(f"{c:>12}" for c in cells), flush=True)
        del w_q, w_tiled


BLOCK_SHAPES = SHAPES[:4] + [(4096, 6144), (4096, 28672)]  # and the decoder block's merged q / k / v, gate / up


def _reg_mma_us(x, n: int, k: int, sms: int, per_sm: int, w_tiled) -> tuple[float, int]:
    """-> (us, splits) of the register-fed kernel above M = 8 with per_sm programs per SM planned."""
    config = gemm_configs._skinny_config(x.shape[0], n, k, sms, 64, 64, per_sm, gemm_mma.WARPS, 1,
                                         gemm_configs.REG_MMA_MIN_STEPS[1])
    return stream_us(lambda w: gemm_splitk(x, w[0], w[1], w[2], None, torch.bfloat16, False, config=config,
                                           tiled_n=n, reg_mma=True), w_tiled), config[3]


def per_sm_sweep() -> None:
    """The register-fed kernel at M = 16 (two x-row blocks, 80 registers: at most 12 programs of
    64 threads fit an SM) with P (default 8 / 10 / 12 / 16) programs per SM planned, on bench_gemm's shapes
    and the decoder block's merged ones; M = 1 at its shipped 16 for reference."""
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    l2 = torch.cuda.get_device_properties().L2_cache_size
    sms = torch.cuda.get_device_properties().multi_processor_count
    per_sm = tuple(int(a) for a in sys.argv[sys.argv.index("--per-sm") + 1:]) or (8, 10, 12, 16)
    print(f"{'K':>6} {'N':>6} {'M':>3} {'bf16':>7} " + " ".join(f"{'per SM ' + str(p):>14}" for p in per_sm)
          + "  (us, splits)")
    for k, n in BLOCK_SHAPES:
        w_bf16, w_q, w_tiled = weight_copies(k, n, l2)
        for m in (9, 16):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            cells = []
            for p in per_sm:
                t, splits = _reg_mma_us(x, n, k, sms, p, w_tiled)
                cells.append(f"{t:7.1f} ({splits:>3})")
            bf16 = stream_us(lambda w: x @ w.T, w_bf16)
            print(f"{k:>6} {n:>6} {m:>3} {bf16:7.1f} " + " ".join(f"{c:>14}" for c in cells), flush=True)
        del w_bf16, w_q, w_tiled


def m32_compare() -> None:
    """M = 17..32: the register-fed mainloop with four x-row blocks (142 registers) against what
    ran there before, same run: tiled weights, the tl.dot skinny kernel (eager config); row-major
    weights, dequantize + cuBLASLt (nv.linear above SPLITK_MAX_M = 16); bf16 cuBLAS."""
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    for n, k, m in [(64, 64, 17), (208, 1040, 32), (4096, 4096, 24), (1000, 14336, 32)]:
        q = nv.quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
        data, scale = ops.tile_weight(q.data, q.scale.view(torch.uint8))
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = x.double() @ q.dequantize(torch.float32).double().T
        for got in (gemm_splitk(x, data, scale, q.global_scale, None, torch.float32, False, tiled_n=n,
                                reg_mma=True),
                    gemm_splitk(x, q.data, q.scale.view(torch.uint8), q.global_scale, None, torch.float32,
                                False, reg_mma=True)):
            err = ((got.double() - ref).abs().max() / ref.abs().max()).item()
            assert err < 1e-4, (n, k, m, err)
    print("correct")
    l2 = torch.cuda.get_device_properties().L2_cache_size
    sms = torch.cuda.get_device_properties().multi_processor_count
    per_sm = (4, 6, 7)
    cols = ["bf16", "tiled-dot"] + [f"reg{p}" for p in per_sm] + ["rows-reg", "rows-deq"]
    _print_header(cols, 9)
    for k, n in BLOCK_SHAPES:
        w_bf16, w_q, w_tiled = weight_copies(k, n, l2)
        for m in (17, 32):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            old = gemm_configs.splitk_config(m, n, k, sms, tiled=True, min_steps=gemm_configs.MIN_STEPS_PER_SPLIT)
            times = [stream_us(lambda w: x @ w.T, w_bf16),
                     stream_us(lambda w: gemm_splitk(x, w[0], w[1], w[2], None, torch.bfloat16, False,
                                                     config=old, tiled_n=n, reg_mma=False), w_tiled)]
            times += [_reg_mma_us(x, n, k, sms, p, w_tiled)[0] for p in per_sm]
            times.append(stream_us(lambda q: gemm_splitk(x, q.data, q.scale.view(torch.uint8), q.global_scale,
                                                         None, torch.bfloat16, False, reg_mma=True), w_q))
            gemm_configs.FORCE_PATH = "dequant_cublas"
            times.append(stream_us(lambda q: nv.linear(x, q), w_q))
            gemm_configs.FORCE_PATH = None
            _print_row(k, n, m, times, 9)
        del w_bf16, w_q, w_tiled


def rows_compare() -> None:
    """Row-major weights (what nv.linear takes): the tl.dot skinny kernel (the eager path before
    the register-fed mainloop read this layout) against the register-fed one with plain scales
    read a byte per K-tile (bytes) or a word per 4 (rows), swizzled scales, and the tiled layout,
    same run; default configs."""
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    check(("rows", "rows-swizzled"))
    l2 = torch.cuda.get_device_properties().L2_cache_size
    sms = torch.cuda.get_device_properties().multi_processor_count
    cols = ["bf16", "rows-dot", "bytes-mma", "rows-mma", "swz-mma", "tiled-mma"]
    _print_header(cols, 9)
    for k, n in SHAPES:
        copies = max(2, math.ceil(3 * l2 / (n * k * 0.5625)))
        w_bf16 = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for _ in range(copies)]
        plain = [nv.quantize(w) for w in w_bf16]
        swz = [nv.quantize(w, swizzle=True) for w in w_bf16]
        # the same scales 1 byte off a word boundary: read a byte per K-tile, not a word per 4
        odd = [torch.empty(q.scale.numel() + 1, dtype=torch.uint8, device="cuda")[1:].view(q.scale.shape)
               .copy_(q.scale.view(torch.uint8)) for q in plain]
        w_tiled = [(*ops.tile_weight(q.data, q.scale.view(torch.uint8)), q.global_scale) for q in plain]
        for m in (1, 16):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            old = gemm_configs.splitk_config(m, n, k, sms, min_steps=gemm_configs.MIN_STEPS_PER_SPLIT)
            times = [
                stream_us(lambda w: x @ w.T, w_bf16),
                stream_us(lambda q: gemm_splitk(x, q.data, q.scale.view(torch.uint8), q.global_scale, None,
                                                torch.bfloat16, False, config=old, reg_mma=False), plain),
                stream_us(lambda qs: gemm_splitk(x, qs[0].data, qs[1], qs[0].global_scale, None,
                                                 torch.bfloat16, False, reg_mma=True), list(zip(plain, odd))),
                stream_us(lambda q: gemm_splitk(x, q.data, q.scale.view(torch.uint8), q.global_scale, None,
                                                torch.bfloat16, False, reg_mma=True), plain),
                stream_us(lambda q: gemm_splitk(x, q.data, q.scale.view(torch.uint8), q.global_scale, None,
                                                torch.bfloat16, True, reg_mma=True), swz),
                stream_us(lambda w: gemm_splitk(x, w[0], w[1], w[2], None, torch.bfloat16, False,
                                                tiled_n=n, reg_mma=True), w_tiled),
            ]
            _print_row(k, n, m, times, 9)
        del w_bf16, plain, swz, odd, w_tiled


def splits_sweep(rows: bool = False) -> None:
    """The register-fed kernel at M = 1 and 16 with P K-steps per split from 2 to the whole K
    (splits cdiv(steps, P)), against the shipped choice (marked *); programs per resident slot (16
    an SM at M <= 8, 8 above) show where a grid takes a second wave. rows: on row-major weights
    with plain scales (nv.linear's), where a split's K range is also the length of the contiguous
    piece of each row a program reads; at M = 1 the grouped mapping counts steps in groups of 4
    K-tiles (256 k)."""
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    l2 = torch.cuda.get_device_properties().L2_cache_size
    sms = torch.cuda.get_device_properties().multi_processor_count
    for k, n in BLOCK_SHAPES:
        _, w_q, w_tiled = weight_copies(k, n, l2)
        weights = [(q.data, q.scale.view(torch.uint8), q.global_scale) for q in w_q] if rows else w_tiled
        for m in (1, 16):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            step_k = 64 * (gemm_mma.GROUP if rows and m <= 8 else 1)
            steps = -(-k // step_k)
            default = gemm_configs.splitk_config(m, n, k, sms, reg_mma=True)
            shipped = gemm_configs.split_ranges(k, step_k, default[3])[1]
            slots = sms * (gemm_configs.REG_MMA_CONFIG[2] if m <= 8 else gemm_configs.REG_MMA_PROGRAMS_PER_SM_TWO_B)
            cells = []
            for per_split in sorted({1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, steps, shipped}):
                if per_split > steps or (per_split == 1 and step_k == 64):
                    continue
                splits = -(-steps // per_split)
                config = (16, 64, 64, splits, gemm_mma.WARPS, 1)
                t = stream_us(lambda w: gemm_splitk(x, w[0], w[1], w[2], None, torch.bfloat16, False, config=config,
                                                   tiled_n=None if rows else n, reg_mma=True), weights)
                mark = "*" if per_split == shipped else " "
                cells.append(f"{per_split:>3}{mark}{t:6.1f} ({splits * -(-n // 64) / slots:4.2f})")
            print(f"{k:>6} {n:>6} {m:>3}  P ({step_k} k) us (programs / slots): " + "  ".join(cells), flush=True)
        del w_q, w_tiled, weights


SUM_VARIANTS = {"8": {}, "16": {1: 16, 8: 16, 16: 32}, "32": {1: 32, 8: 16, 16: 32}}  # SPLIT_SUM_PER_THREAD_BY_ROWS


def sum_compare() -> None:
    """The last split's sum of the partials with SUM_VARIANTS' partials a thread a load ("8": the
    rule before gemm_configs.SPLIT_SUM_PER_THREAD_BY_ROWS, 8 splits at once at M = 1, 1 at M = 8
    and 16; "16": 16, 2, 2; "32": 32, 2, 2), alternating twice in one process, eager register-fed
    kernel at M = 1, 8, 16 on tiled and row-major (plain) weights, default configs. Run with an older
    tree on PYTHONPATH, every variant is that tree's own rule."""
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    l2 = torch.cuda.get_device_properties().L2_cache_size
    shipped = getattr(gemm_configs, "SPLIT_SUM_PER_THREAD_BY_ROWS", {})
    print("us, run 1 / run 2 of each variant (" + ", ".join(SUM_VARIANTS) + ")")
    for k, n in BLOCK_SHAPES:
        w_bf16, w_q, w_tiled = weight_copies(k, n, l2)
        layouts = {"tiled": (w_tiled, n), "rows": ([(q.data, q.scale.view(torch.uint8), q.global_scale) for q in w_q], None)}
        for m in (1, 8, 16):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            bf16 = stream_us(lambda w: x @ w.T, w_bf16)
            cells = []
            for name, (weights, tiled_n) in layouts.items():
                times = {}
                for rep in range(2):
                    for rule, by_rows in SUM_VARIANTS.items():
                        gemm_configs.SPLIT_SUM_PER_THREAD_BY_ROWS = by_rows
                        times.setdefault(rule, []).append(stream_us(
                            lambda w: gemm_splitk(x, w[0], w[1], w[2], None, torch.bfloat16, False, tiled_n=tiled_n),
                            weights))
                gemm_configs.SPLIT_SUM_PER_THREAD_BY_ROWS = shipped
                cells.append(f"{name} " + " | ".join(f"{t[0]:5.1f} / {t[1]:5.1f}" for t in times.values()))
            print(f"{k:>6} {n:>6} {m:>3}  bf16 {bf16:6.1f}  " + "   ".join(cells), flush=True)
        del w_bf16, w_q, w_tiled, layouts


if __name__ == "__main__":
    if "--sum" in sys.argv:
        sum_compare()
    elif "--splits" in sys.argv:
        splits_sweep(rows="--rows" in sys.argv)
    elif "--rows" in sys.argv:
        rows_compare()
    elif "--m32" in sys.argv:
        m32_compare()
    elif "--per-sm" in sys.argv:
        per_sm_sweep()
    elif "--min-steps" in sys.argv:
        min_steps_sweep()
    else:
        main()
