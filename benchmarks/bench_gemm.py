"""NVFP4 linear (y = x @ W^T) vs bf16 cuBLAS, same run.

    python benchmarks/bench_gemm.py [--ms 4096]
    python benchmarks/bench_gemm.py --hopper-sweep --ms 32 64 128 256 512   # sm_90: the Gluon kernel's tiles

Times are CUDA-graph replays cycling through weight copies, each format's set 3x the L2 (each call
reads its weights from HBM, as in a real model), at least 32 calls a replay. W4A4 includes
quantizing x. The floor is the
NVFP4 bytes (weights 0.5625 B/element, x and y in bf16) over the copy bandwidth measured here.
"""

import argparse
import math

import torch
import triton
from bench_quantize import copy_bandwidth_gbs, stream_us

import nvfp4_inductor as nv
from nvfp4_inductor.kernels import gemm_configs, plan
from nvfp4_inductor.kernels.gemm import scaled_mm_tiled
from nvfp4_inductor.kernels.gemm_splitk import gemm_splitk
from nvfp4_inductor.kernels.hopper_gemm import hopper_linear
from nvfp4_inductor.reference import hopper

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672)]  # (K, N)
MS = [1, 16, 32, 64, 128, 256, 512, 4096]


def weight_copies(k: int, n: int, l2: int):
    """-> (bf16 (N, K) weights, NVFP4 weights, their tiled parts + global scale, on sm_90 their
    reference.hopper parts + global scale): fresh random copies, each format's set 3x the L2 in its
    own bytes (the NVFP4 set needs 3.56x more copies)."""
    def copies(nbytes):
        return max(2, math.ceil(3 * l2 / nbytes))

    w_bf16 = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for _ in range(copies(n * k * 2))]
    w_fp4 = [nv.quantize(torch.randn(n, k, dtype=torch.bfloat16, device="cuda"))
             for _ in range(copies(n * k * 0.5625))]
    w_tiled = [(*torch.ops.nvfp4.tile_weight(q.data, q.scale.view(torch.uint8)), q.global_scale) for q in w_fp4]
    w_hopper = [(*hopper.pack(q.data, q.scale), q.global_scale) for q in w_fp4] if _sm90() else None
    return w_bf16, w_fp4, w_tiled, w_hopper


def _sm90() -> bool:
    return torch.cuda.get_device_capability() == (9, 0)


def hopper_candidates() -> list[gemm_configs.HopperConfig]:
    """The Hopper kernel's tiles worth timing: the shipped warp-specialized ones (the best of its
    earlier sweep, docs/gemm.md), and the register-A form at weight rows 64 / 128 (one warpgroup a
    64 rows) by tokens 64..256, 4 slots of 64 k (the K-step plan.hopper_launch takes for it)."""
    shipped = [config for _, config in gemm_configs.HOPPER_WS_CONFIGS]
    grid = [gemm_configs.HopperConfig(rows=rows, block_t=block_t, block_k=64, stages=4, num_warps=rows // 16,
                                      register_a=True)
            for rows in (64, 128) for block_t in (64, 128, 256)
            if not (rows == 128 and block_t == 256)]  # 128 x 256 fp32 sums: more registers than a warpgroup has
    return shipped + grid


def hopper_sweep(ms: list[int], l2: int) -> None:
    """Each candidate tile of the Hopper kernel on the tiled weights (K split as
    plan.hopper_launch splits it), us; configs that do not compile or fit are skipped ("-"), and
    one whose output is off the dequantized product (relative error over 1e-2) is not timed ("bad");
    tiled16: what nvfp4::linear_tiled dispatches (plan.plan_gemm's kernel), and other: what it
    dispatches without the Hopper GEMM (gemm_configs.HOPPER_GEMM_M empty), in the same run."""
    candidates = hopper_candidates()
    print("hopT16 sweep: the Hopper Gluon kernel on tiled weights, us per config (rows x tokens x K-step x"
          " slots); best: the fastest and its speed-up over bf16 cuBLAS; tiled16: nvfp4::linear_tiled as"
          " dispatched, other: as dispatched without the Hopper GEMM, and their speed-ups")
    for i, c in enumerate(candidates):
        print(f"  c{i}: {c.rows}x{c.block_t}x{c.block_k}x{c.stages}{' register A' if c.register_a else ''}")
    print(f"{'K':>6} {'N':>6} {'M':>5} {'bf16':>8} " + " ".join(f"{f'c{i}':>7}" for i in range(len(candidates)))
          + f" {'best':>5} {'x':>5} {'tiled16':>8} {'x':>5} {'other':>8} {'x':>5}")
    for k, n in SHAPES:
        w_bf16, w_fp4, w_tiled, _ = weight_copies(k, n, l2)
        w0 = nv.dequantize(w_fp4[0], torch.float32)
        for m in ms:
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            want = x.float() @ w0.T
            bf16 = stream_us(lambda w: x @ w.T, w_bf16)
            shipped = stream_us(lambda w: torch.ops.nvfp4.linear_tiled(x, *w, None, n, "bf16"), w_tiled)
            planned, gemm_configs.HOPPER_GEMM_M = gemm_configs.HOPPER_GEMM_M, (1, 0)
            try:
                other = stream_us(lambda w: torch.ops.nvfp4.linear_tiled(x, *w, None, n, "bf16"), w_tiled)
            finally:
                gemm_configs.HOPPER_GEMM_M = planned
            times = []
            for c in candidates:
                try:
                    y = hopper_linear(x, *w_tiled[0][:2], w_tiled[0][2], n=n, tiled=True, config=c)
                    if ((y.float() - want).norm() / want.norm()).item() > 1e-2:
                        times.append(math.nan)
                        continue
                    times.append(stream_us(lambda w: hopper_linear(x, *w[:2], w[2], n=n, tiled=True, config=c),
                                           w_tiled))
                except Exception:  # noqa: BLE001 - out of shared memory or registers: not a candidate
                    times.append(math.inf)
            timed = [i for i, t in enumerate(times) if t < math.inf]
            best = min(timed, key=times.__getitem__) if timed else None
            cells = [f"{t:7.1f}" if t < math.inf else f"{'-':>7}" if t == math.inf else f"{'bad':>7}" for t in times]
            print(f"{k:>6} {n:>6} {m:>5} {bf16:8.1f} " + " ".join(cells)
                  + (f" {f'c{best}':>5} {bf16 / times[best]:5.2f}" if best is not None else f" {'-':>5} {'-':>5}")
                  + f" {shipped:8.1f} {bf16 / shipped:5.2f} {other:8.1f} {bf16 / other:5.2f}", flush=True)
        del w_bf16, w_fp4, w_tiled


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ms", type=int, nargs="+", default=MS, help="rows of x (default: all)")
    parser.add_argument("--hopper-sweep", action="store_true",
                        help="sm_90: time the warp-specialized kernel's candidate tiles instead of the table")
    args = parser.parse_args()
    ms = args.ms
    torch.manual_seed(0)
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    copy = copy_bandwidth_gbs()
    l2 = torch.cuda.get_device_properties().L2_cache_size
    print(f"device copy: {copy:.0f} GB/s")
    if args.hopper_sweep:
        hopper_sweep(ms, l2)
        return
    print("W4A16 / W4A4: nvfp4_inductor.linear on row-major weights; tiled16 / tiled4: nvfp4::linear_tiled,"
          " the eager form of what backend='nvfp4' compiles (weights in the tiled layout); both take"
          " plan.plan_gemm's kernel (split-K at decode sizes; on sm_90 the wgmma mainloop at 33-127 rows and"
          " for tiled W the Hopper GEMM at 128-512, else dequantize + cuBLASLt); deq16: tiled W4A16 through dequantize + cuBLASLt at every M;"
          " dot16: tiled W4A16 through the split-K kernel's tl.dot mainloop (M <= 64; what 33-64 rows"
          " take without wgmma); hop16 (sm_90): W4A16 through kernels.hopper_gemm, the warp-specialized"
          " Gluon kernel, on weights in reference.hopper's layout; hopT16 (sm_90): its register-A form on the"
          " tiled weights. x: speed-up over bf16 cuBLAS (>1 is faster); floor: NVFP4 bytes at the"
          " copy bandwidth.")
    print(f"\n{'K':>6} {'N':>6} {'M':>5} {'bf16 us':>8} {'W4A16':>7} {'W4A4':>7} {'tiled16':>8} {'tiled4':>7}"
          f" {'deq16':>7} {'dot16':>7} {'hop16':>7} {'hopT16':>7} {'floor':>6} | {'W4A16 x':>7} {'W4A4 x':>6}"
          f" {'tiled16 x':>9} {'tiled4 x':>8} {'deq16 x':>7} {'dot16 x':>7} {'hop16 x':>7} {'hopT16 x':>8}"
          f" {'floor x':>7}")
    ops = torch.ops.nvfp4
    for k, n in SHAPES:
        w_bf16, w_fp4, w_tiled, w_hopper = weight_copies(k, n, l2)
        for m in ms:
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            bf16 = stream_us(lambda w: x @ w.T, w_bf16)
            w4a16 = stream_us(lambda w: nv.linear(x, w), w_fp4)
            w4a4 = stream_us(lambda w: nv.linear(x, w, activations="nvfp4"), w_fp4)
            t16 = stream_us(lambda w: ops.linear_tiled(x, *w, None, n, "bf16"), w_tiled)
            t4 = stream_us(lambda w: ops.linear_tiled(x, *w, None, n, "nvfp4"), w_tiled)
            deq16 = stream_us(lambda w: scaled_mm_tiled(x, *w[:2], w[2], None, n, torch.bfloat16), w_tiled)
            dot = (plan.splitk_launch_for(x, *w_tiled[0][:2], swizzled=False, tiled_n=n, mainloop="dot")
                   if m <= plan.SPLITK_MAX_M_TILED else None)
            dot16 = (stream_us(lambda w: gemm_splitk(x, *w[:3], None, torch.bfloat16, False, tiled_n=n,
                                                     launch=dot), w_tiled)
                     if dot is not None else math.nan)
            hop16 = (stream_us(lambda w: hopper_linear(x, *w, n=n), w_hopper)
                     if w_hopper is not None else math.nan)
            hopt16 = (stream_us(lambda w: hopper_linear(x, *w[:2], w[2], n=n, tiled=True), w_tiled)
                      if _sm90() else math.nan)
            floor = (n * k * 0.5625 + 2 * m * k + 2 * m * n) / copy / 1e3
            times = (w4a16, w4a4, t16, t4, deq16, dot16, hop16, hopt16, floor)
            print(f"{k:>6} {n:>6} {m:>5} {bf16:8.1f} " + " ".join(f"{t:7.1f}" for t in times) + " | "
                  + " ".join(f"{bf16 / t:7.2f}" for t in times), flush=True)
        del w_bf16, w_fp4, w_tiled, w_hopper


if __name__ == "__main__":
    main()
