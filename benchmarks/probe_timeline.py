"""Where a decode GEMM's time goes, program by program: the register-fed split-K kernel
(gemm_splitk with gemm_mma's mainloop, tiled weights, M = 1 or --m) with timestamps (%globaltimer, ns,
and %clock64) taken in every program at its start, after its split's atomic (mainloop, partial
store, counter) and, in the last split of a tile, after the sum of the partials. Per shape:
the real kernel's time (CUDA-graph replays over weights beyond L2), then from the stamps of single
launches on an idle GPU: when programs start (launch ramp), how long a program's split takes, when
the last split finishes, how long the sum takes; and the same grid with empty splits (no mainloop:
launch + counters + sum alone).

    python benchmarks/probe_timeline.py [--m M] [--raw DIR]   # M <= 16; DIR: the stamps (.npz)
    python benchmarks/probe_timeline.py --dynamic     # the same grid's work handed out at run time

--dynamic: persistent programs (PER_SM a SM) take (tile row, split) units from a counter as they
finish, so that fast programs do more of them (static splits: every program one unit). GRAB 1:
tl.atomic_add (Triton broadcasts its result at once); 2: thread 0's atom through inline PTX, its
result broadcast at the end of the unit it was taken during. Checked bit for bit against the
static kernel with the same splits (same partials, same sum order).
"""

import math
import sys

import numpy as np
import torch
import triton
import triton.language as tl
from bench_quantize import copy_bandwidth_gbs, graph_us, stream_us

import nvfp4_inductor as nv
from nvfp4_inductor.kernels import gemm_configs, gemm_mma
from nvfp4_inductor.kernels.gemm_splitk import _epilogue, gemm_splitk, last_split, sum_splits

SHAPES = [(4096, 4096), (4096, 6144), (14336, 4096), (4096, 14336), (4096, 28672), (8192, 28672)]  # (K, N)
ops = torch.ops.nvfp4

_STAMP_ASM: tl.constexpr = tl.constexpr(
    "{ .reg .pred p; setp.ne.s32 p, $2, -123456789;"
    " @p mov.u64 $0, %globaltimer; @!p mov.u64 $0, 0; @p mov.u64 $1, %clock64; @!p mov.u64 $1, 0; }")


@triton.jit
def _stamp(dep, ptr, i):
    """(%globaltimer, %clock64) read once dep (int32, (64,)) is available, stored by thread 0 at
    ptr, ptr + 1."""
    gt, ck = tl.inline_asm_elementwise(_STAMP_ASM, "=l,=l,r", [dep], dtype=(tl.int64, tl.int64),
                                       is_pure=False, pack=1)
    tl.store(ptr + i * 0, gt, mask=i == 0)
    tl.store(ptr + 1 + i * 0, ck, mask=i == 0)


@triton.jit
def _timed_kernel(x_ptr, w_ptr, ws_ptr, g_ptr, out_ptr, partial_ptr, counter_ptr, stamp_ptr, info_ptr,
                  M, N, K, tiles_per_split, EMPTY: tl.constexpr, NB: tl.constexpr, SUM_ROWS: tl.constexpr,
                  SUM_SPLITS: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    program = pid_k * tl.num_programs(0) + pid_n
    i = tl.arange(0, 64)
    stamps = stamp_ptr + program * 6
    _stamp(i * 0 + program, stamps, i)
    smid = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [i], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(info_ptr + program * 2 + i * 0, smid, mask=i == 0)
    tile_begin = pid_k * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, tl.cdiv(K, 64))
    if EMPTY:
        tile_end = tile_begin
    acc = gemm_mma.mma_mainloop(x_ptr, w_ptr, ws_ptr, M, K, K, pid_n, tile_begin, tile_end, NB, True)
    ms = tl.arange(0, 16)  # NB <= 2
    cols_n = pid_n * 64 + tl.arange(0, 64)
    mask = (cols_n < N)[:, None] & (ms < M)[None, :]
    tl.store(partial_ptr + (pid_k * M + ms)[None, :].to(tl.int64) * N + cols_n[:, None], acc, mask=mask)
    last = last_split(counter_ptr + pid_n, tl.num_programs(1))
    _stamp(i * 0 + last.to(tl.int32), stamps + 2, i)
    tl.store(info_ptr + program * 2 + 1 + i * 0, last.to(tl.int32), mask=i == 0)
    if last:
        total = sum_splits(partial_ptr, tl.num_programs(1), M, N, cols_n, 64, SUM_ROWS, SUM_SPLITS)
        _stamp(i * 0 + tl.sum(total).to(tl.int32, bitcast=True), stamps + 4, i)
        _epilogue(total, tl.arange(0, SUM_ROWS), cols_n, M, N, g_ptr, g_ptr, out_ptr, N, False, False, 128.0)


_GRAB_ASM: tl.constexpr = tl.constexpr(
    "{ .reg .pred p; setp.eq.s32 p, $2, 0; mov.u32 $0, 0; @p atom.global.add.u32 $0, [$1], 1; }")


@triton.jit
def _dynamic_kernel(x_ptr, w_ptr, ws_ptr, g_ptr, out_ptr, partial_ptr, counter_ptr, grab_ptr, M, N, K,
                    tiles_per_split, splits, GRAB: tl.constexpr, SUM_ROWS: tl.constexpr,
                    SUM_SPLITS: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    tiles_n = tl.cdiv(N, 64)
    units = tiles_n * splits
    i = tl.arange(0, 64)
    ms = tl.arange(0, 16)
    u = pid
    while u < units:
        if GRAB == 1:
            nxt = nprog + tl.atomic_add(grab_ptr, 1, sem="relaxed")
        else:
            taken = tl.inline_asm_elementwise(_GRAB_ASM, "=r,l,r", [grab_ptr + i * 0, i], dtype=tl.int32,
                                              is_pure=False, pack=1)
        pid_n = u % tiles_n
        pid_k = u // tiles_n
        begin = pid_k * tiles_per_split
        end = tl.minimum(begin + tiles_per_split, tl.cdiv(K, 64))
        acc = gemm_mma.mma_mainloop(x_ptr, w_ptr, ws_ptr, M, K, K, pid_n, begin, end, 1, True)
        cols_n = pid_n * 64 + tl.arange(0, 64)
        mask = (cols_n < N)[:, None] & (ms < M)[None, :]
        tl.store(partial_ptr + (pid_k * M + ms)[None, :].to(tl.int64) * N + cols_n[:, None], acc, mask=mask)
        if last_split(counter_ptr + pid_n, splits):
            total = sum_splits(partial_ptr, splits, M, N, cols_n, 64, SUM_ROWS, SUM_SPLITS)
            _epilogue(total, tl.arange(0, SUM_ROWS), cols_n, M, N, g_ptr, g_ptr, out_ptr, N, False, False, 128.0)
        if GRAB == 1:
            u = nxt
        else:
            u = nprog + tl.max(taken, 0)
    # the last program out resets the counter (every program's last take came before its exit)
    if tl.atomic_add(grab_ptr + 1, 1, sem="acq_rel") == nprog - 1:
        tl.store(grab_ptr, 0)
        tl.store(grab_ptr + 1, 0)


def _launch_dynamic(x, w, n, k, splits, per_split, counters, grab, programs, mode):
    out = torch.empty((1, n), dtype=torch.bfloat16, device="cuda")
    partial = torch.empty((splits, 1, n), dtype=torch.float32, device="cuda")
    sum_rows, sum_splits_ = gemm_configs.split_sum_tile(1, splits, 64, gemm_mma.WARPS)
    _dynamic_kernel[(programs,)](x, w[0], w[1], w[2], out, partial, counters, grab, 1, n, k, per_split, splits,
                                 GRAB=mode, SUM_ROWS=sum_rows, SUM_SPLITS=sum_splits_,
                                 num_warps=gemm_mma.WARPS, num_stages=1)
    return out


def _tiled_weights(k: int, n: int, l2: int) -> list:
    """Copies of a random (n, k) NVFP4 weight in the tiled layout, (codes, scales, g) each,
    together beyond L2."""
    weights = []
    for _ in range(max(2, math.ceil(3 * l2 / (n * k * 0.5625)))):
        q = nv.quantize(torch.randn(n, k, dtype=torch.bfloat16, device="cuda"))
        weights.append((*ops.tile_weight(q.data, q.scale.view(torch.uint8)), q.global_scale))
    return weights


def dynamic() -> None:
    torch.manual_seed(0)
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    props = torch.cuda.get_device_properties()
    sms, l2 = props.multi_processor_count, props.L2_cache_size
    print("M = 1, tiled weights; us (CUDA-graph replays over weights beyond L2). static S: the static grid "
          "with S K-steps a split; dyn G/S/P: GRAB G, units of S steps, P programs an SM")
    counters = torch.zeros(4096, dtype=torch.int32, device="cuda")
    grab = torch.zeros(2, dtype=torch.int32, device="cuda")
    for k, n in SHAPES:
        weights = _tiled_weights(k, n, l2)
        x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
        w0 = weights[0]
        row = [("shipped", stream_us(lambda w: gemm_splitk(x, w[0], w[1], w[2], None, torch.bfloat16, False,
                                                            tiled_n=n), weights))]
        for steps in (2, 4):
            splits, per_split = gemm_configs.split_ranges(k, 64, -(-(k // 64) // steps))
            config = (16, 64, 64, splits, gemm_mma.WARPS, 1)
            ref = gemm_splitk(x, w0[0], w0[1], w0[2], None, torch.bfloat16, False, config=config, tiled_n=n,
                              reg_mma=True)
            row.append((f"static {per_split}", stream_us(
                lambda w: gemm_splitk(x, w[0], w[1], w[2], None, torch.bfloat16, False, config=config,
                                      tiled_n=n, reg_mma=True), weights)))
            for mode in (1, 2):
                for per_sm in (8, 16):
                    programs = min(per_sm * sms, splits * (n // 64))
                    y = _launch_dynamic(x, w0, n, k, splits, per_split, counters, grab, programs, mode)
                    y2 = _launch_dynamic(x, w0, n, k, splits, per_split, counters, grab, programs, mode)
                    assert torch.equal(y, ref) and torch.equal(y2, ref), (k, n, steps, mode, per_sm)
                    row.append((f"dyn {mode}/{per_split}/{per_sm}", stream_us(
                        lambda w: _launch_dynamic(x, w, n, k, splits, per_split, counters, grab, programs, mode),
                        weights)))
        print(f"{k:>6} {n:>6} " + "  ".join(f"{name} {t:.2f}" for name, t in row), flush=True)
        weights = None  # free before the next shape


def _launch(x, w, n, k, splits, per_split, counters, stamps, info, empty):
    m = x.shape[0]
    out = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
    partial = torch.empty((splits, m, n), dtype=torch.float32, device="cuda")
    sum_rows, sum_splits_ = gemm_configs.split_sum_tile(m, splits, 64, gemm_mma.WARPS)
    _timed_kernel[(n // 64, splits)](x, w[0], w[1], w[2], out, partial, counters, stamps, info, m, n, k,
                                     per_split, EMPTY=empty, NB=gemm_configs.reg_mma_blocks(m),
                                     SUM_ROWS=sum_rows, SUM_SPLITS=sum_splits_,
                                     num_warps=gemm_mma.WARPS, num_stages=1)
    return out


def _stats(stamps, info):
    """Per launch: times in us from the first program's start."""
    st = stamps.cpu().numpy().astype(np.int64)
    inf = info.cpu().numpy()
    t0 = st[:, 0].min()
    start = (st[:, 0] - t0) / 1e3
    done = (st[:, 2] - t0) / 1e3
    last = inf[:, 1] == 1
    end = (st[last, 4] - t0) / 1e3
    dur = done - start
    cycles = (st[:, 3] - st[:, 1]).astype(np.float64)
    ghz = np.median(cycles[dur > np.percentile(dur, 50)] / (dur[dur > np.percentile(dur, 50)] * 1e3))
    steps = np.diff(np.unique(st[:, 0]))
    per_sm = np.bincount(inf[:, 0]).max()
    return dict(span=end.max(), start50=np.median(start), start_max=start.max(), dur10=np.percentile(dur, 10),
                dur50=np.median(dur), dur90=np.percentile(dur, 90), dur_max=dur.max(), done_max=done.max(),
                sum50=np.median(end - done[last]), second_wave=int((start > dur.min() + start.min()).sum()),
                ghz=ghz, tick=steps[steps > 0].min() if (steps > 0).any() else 0, per_sm=per_sm)


def main(m: int = 1, raw=None) -> None:
    torch.manual_seed(0)
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    copy = copy_bandwidth_gbs()
    props = torch.cuda.get_device_properties()
    sms, l2 = props.multi_processor_count, props.L2_cache_size
    print(f"device copy {copy:.0f} GB/s, {sms} SMs; M = {m}, tiled weights, the shipped split config; us")
    cols = ("kernel", "stamped", "span", "start50", "startmax", "dur10", "dur50", "dur90", "durmax",
            "donemax", "sum50", "2ndwave", "floor")
    print(f"{'K':>6} {'N':>6} {'grid':>9} {'variant':>7} " + " ".join(f"{c:>8}" for c in cols))
    counters = torch.zeros(4096, dtype=torch.int32, device="cuda")
    for k, n in SHAPES:
        weights = _tiled_weights(k, n, l2)
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        config = gemm_configs.splitk_config(m, n, k, sms, tiled=True, reg_mma=True)
        splits, per_split = gemm_configs.split_ranges(k, 64, config[3])
        programs = splits * (n // 64)
        stamps = torch.zeros((programs, 6), dtype=torch.int64, device="cuda")
        info = torch.zeros((programs, 2), dtype=torch.int32, device="cuda")
        ref = gemm_splitk(x, weights[0][0], weights[0][1], weights[0][2], None, torch.bfloat16, False, tiled_n=n)
        y = _launch(x, weights[0], n, k, splits, per_split, counters, stamps, info, False)
        assert torch.equal(y, ref), "the stamped kernel must compute what the shipped one does"
        kernel = stream_us(lambda w: gemm_splitk(x, w[0], w[1], w[2], None, torch.bfloat16, False, tiled_n=n),
                           weights)
        floor = n * k * 0.5625 / copy / 1e3
        for empty in (False, True):
            stamped = stream_us(lambda w: _launch(x, w, n, k, splits, per_split, counters, stamps, info, empty),
                                weights)
            runs, kept = [], {}
            for rep in range(7):
                torch.cuda.synchronize()
                _launch(x, weights[rep % len(weights)], n, k, splits, per_split, counters, stamps, info, empty)
                torch.cuda.synchronize()
                runs.append(_stats(stamps, info))
                kept[f"stamps{rep}"], kept[f"info{rep}"] = stamps.cpu().numpy(), info.cpu().numpy()
            if raw and not empty:
                np.savez(f"{raw}/{k}x{n}_m{m}.npz", tiles_n=n // 64, splits=splits,
                         per_split=per_split, **kept)
            s = {key: float(np.median([r[key] for r in runs])) for key in runs[0]}
            vals = (kernel, stamped, s["span"], s["start50"], s["start_max"], s["dur10"], s["dur50"], s["dur90"],
                    s["dur_max"], s["done_max"], s["sum50"], s["second_wave"], floor)
            print(f"{k:>6} {n:>6} {n // 64:>4}x{splits:<4} {'empty' if empty else 'gemm':>7} "
                  + " ".join(f"{v:8.2f}" for v in vals), flush=True)
        # back to back in a CUDA graph, a stamp buffer per launch: from one launch's last stamp to the next's first
        bufs = [(torch.zeros_like(stamps), torch.zeros_like(info)) for _ in weights]
        graph_us(lambda: [_launch(x, w, n, k, splits, per_split, counters, b[0], b[1], False)
                          for w, b in zip(weights, bufs)], calls=1, reps=3)
        firsts = [b[0][:, 0].min().item() for b in bufs]
        lasts = [b[0][b[1][:, 1] == 1, 4].max().item() for b in bufs]
        gaps = [(f - l) / 1e3 for l, f in zip(lasts[:-1], firsts[1:])]
        spans = [(l - f) / 1e3 for f, l in zip(firsts, lasts)]
        print(f"{'':>6} {'':>6} in a graph: span {np.median(spans):.2f} us, last sum -> next launch's first program "
              f"{np.median(gaps):.2f} us (median of {len(gaps)})")
        print(f"{'':>6} {'':>6} {per_split:>4} steps a split; SM clock ~{s['ghz']:.2f} GHz, globaltimer tick "
              f"{s['tick']:.0f} ns, at most {s['per_sm']:.0f} programs on an SM", flush=True)
        weights = None  # free before the next shape


if __name__ == "__main__":
    if "--dynamic" in sys.argv:
        dynamic()
    else:
        main(int(sys.argv[sys.argv.index("--m") + 1]) if "--m" in sys.argv else 1,
             sys.argv[sys.argv.index("--raw") + 1] if "--raw" in sys.argv else None)
