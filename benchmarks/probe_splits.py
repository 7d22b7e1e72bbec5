"""The eager register-fed decode GEMM (gemm_splitk, tiled W4A16) with its split-K changed (session
35): the splits' K ranges (gemm_splitk.split_tiles) or the last split's sum. Each variant runs in its
own process: the JIT picks up a replaced function at its first compile.

    python benchmarks/probe_splits.py base     # the shipped kernel
    python benchmarks/probe_splits.py even     # the same splits, sizes differing by at most 1 (the
        shipped ranges: tiles_per_split each, the last split the remainder)
    python benchmarks/probe_splits.py 0.2      # split p of S begins at tile T * F(p / S),
        F(u) = u + a u (1 - u): earlier splits (launched first, older on their SM) take more tiles,
        the first (1 + a) / (1 - a) times the last (session 20 tried this in the template)
    python benchmarks/probe_splits.py tail1    # one split more than planned, launched last (the
        highest pid_k, the youngest programs on their SMs), with 1 tile (tail2: 2); the planned
        splits share the rest, sizes differing by at most 1
    python benchmarks/probe_splits.py nosum    # bound: no program sums (last_split False; the
        partials stored, no epilogue: wrong outputs)
    python benchmarks/probe_splits.py onesum   # bound: the last split sums split 0 alone (one
        round of loads; wrong outputs)
    python benchmarks/probe_splits.py sum4     # M = 9..16: the last split loads 4 (sum8, sum16:
        8, 16) partials a round instead of 2 (gemm_configs.SPLIT_SUM_PER_THREAD_BY_ROWS)
    python benchmarks/probe_splits.py piped3   # M >= 2 (session 36): one partial a loop step, the
        loop pipelined by Triton (tl.range num_stages 3; piped5: 5): the next partials' loads in
        flight through cp.async into shared memory, not registers; acc's (BLOCK_N, ROWS) layout
        (16-byte cp.async.cg where N % 16 == 0; sm_90: 89 registers at M = 16 against 96, shared
        memory 8 / 16 KB against 4)
    python benchmarks/probe_splits.py nreg96   # M = 9..16: the kernel compiled with maxnreg 96
        (ptxas then issues the next tile's loads at the loop's top; 10 programs an SM still fit);
        nreg104c9: maxnreg 104 and at most 9 programs an SM (gemm_configs.REG_MMA_MAX_PER_SM_TWO_B)
PROBE_DUMP=DIR: write the compiled kernels' cubins there (what the JIT specialized at launch).

Checked against float64 first (not the bounds); CUDA-graph times over weight copies beyond L2.
Results: benchmarks/results/probe_splits_session35_h100.txt, benchmarks/NOTES.md (session 35)."""
import os
import sys

import triton
import triton.language as tl
from bench_gemm import time_tiled_w4a16

from nvfp4_inductor.kernels import gemm_splitk

VARIANT = sys.argv[1] if len(sys.argv) > 1 else "base"
_D: tl.constexpr = tl.constexpr(256)  # a = _A / _D
_TAIL: tl.constexpr = tl.constexpr(int(VARIANT[4:]) if VARIANT.startswith("tail") else 0)
_A: tl.constexpr = tl.constexpr(round(float(VARIANT) * 256) if VARIANT[0].isdigit() else 0)
_STAGES: tl.constexpr = tl.constexpr(int(VARIANT[-1]) if VARIANT.startswith("piped") else 1)
CHECKED = VARIANT not in ("nosum", "onesum")
if VARIANT.startswith("sum"):
    from nvfp4_inductor.kernels import gemm_configs
    gemm_configs.SPLIT_SUM_PER_THREAD_BY_ROWS[16] = 16 * int(VARIANT[3:])  # 16 values a partial a thread


@triton.jit
def _balanced(pid_k, tiles_per_split, tiles):
    splits = tl.num_programs(1)
    den = splits * splits * _D
    begin = tiles * pid_k * (splits * _D + _A * (splits - pid_k)) // den
    p1 = pid_k + 1
    end = tiles * p1 * (splits * _D + _A * (splits - p1)) // den
    return begin, end


@triton.jit
def _tail(pid_k, tiles_per_split, tiles):
    splits = tl.num_programs(1) - 1  # the planned ones; split `splits` is the tail
    rest = tiles - _TAIL
    begin = tl.where(pid_k == splits, rest, rest * pid_k // splits)
    end = tl.where(pid_k == splits, tiles, rest * (pid_k + 1) // splits)
    return begin, end


def _with_tail(k, block_k, splits):
    steps = -(-k // block_k)
    return splits + 1, -(-steps // splits)


@triton.jit
def _never_last(counter_ptr, num_splits):
    return tl.program_id(1) < 0


_shipped_sum = gemm_splitk.sum_splits


@triton.jit
def _sum_first(partial_ptr, num_splits, M, N, cols_n, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
               SPLITS: tl.constexpr):
    return _shipped_sum(partial_ptr, 1, M, N, cols_n, BLOCK_N, ROWS, SPLITS)


@triton.jit
def _sum_piped(partial_ptr, num_splits, M, N, cols_n, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
               SPLITS: tl.constexpr):
    if ROWS < 8:
        acc = _shipped_sum(partial_ptr, num_splits, M, N, cols_n, BLOCK_N, ROWS, SPLITS)
    else:
        ms = tl.arange(0, ROWS)
        mask = (cols_n < N)[:, None] & (ms < M)[None, :]
        tile = partial_ptr + ms[None, :].to(tl.int64) * N + cols_n[:, None]
        split_stride = tl.cast(M, tl.int64) * N
        acc = tl.zeros((BLOCK_N, ROWS), tl.float32)
        for s in tl.range(0, num_splits, num_stages=_STAGES):
            acc += tl.load(tile + s * split_stride, mask=mask, other=0.0, cache_modifier=".cg")
    return acc


if VARIANT.startswith("nreg"):
    from nvfp4_inductor.kernels import gemm_configs
    _MAXNREG = int(VARIANT[4:].split("c")[0])
    if "c" in VARIANT:
        gemm_configs.REG_MMA_MAX_PER_SM_TWO_B = int(VARIANT.split("c")[1])
    _run = gemm_splitk._splitk_kernel.run

    def _run_capped(*args, **kwargs):
        if kwargs.get("REG_MMA") == 2:
            kwargs["maxnreg"] = _MAXNREG
        return _run(*args, **kwargs)
    gemm_splitk._splitk_kernel.run = _run_capped


def dump_cubins(directory):
    """The compiled _splitk_kernel variants' cubins and register counts into directory."""
    os.makedirs(directory, exist_ok=True)
    for cache in gemm_splitk._splitk_kernel.device_caches.values():
        for i, kernel in enumerate(cache[0].values()):
            name = f"{VARIANT}_{i}_regs{kernel.n_regs}_spills{kernel.n_spills}"
            with open(os.path.join(directory, name + ".cubin"), "wb") as f:
                f.write(kernel.asm["cubin"])
            print("dumped", name, {k: v for k, v in kernel.src.constants.items()
                                   if isinstance(v, (int, bool))} if hasattr(kernel, "src") else "")


if VARIANT == "nosum":
    gemm_splitk.last_split = _never_last
elif VARIANT == "onesum":
    gemm_splitk.sum_splits = _sum_first
elif VARIANT.startswith("piped"):
    gemm_splitk.sum_splits = _sum_piped
elif VARIANT.startswith("tail"):
    from nvfp4_inductor.kernels import gemm_configs
    gemm_splitk.split_tiles = _tail
    gemm_configs.split_ranges = _with_tail
elif VARIANT[0].isdigit() or VARIANT == "even":
    gemm_splitk.split_tiles = _balanced


def main():
    time_tiled_w4a16(VARIANT, CHECKED)
    if os.environ.get("PROBE_DUMP"):
        dump_cubins(os.environ["PROBE_DUMP"])


if __name__ == "__main__":
    main()
