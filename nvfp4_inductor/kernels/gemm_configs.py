"""Tile configurations of the NVFP4 GEMMs and the choice of path, kept apart from the kernels.
The skinny-kernel tables were swept on an H200 (benchmarks/probe_splitk.py); the first GEMM's
(gemm.py) are correctness-oriented values, not tuned."""

import functools
from typing import NamedTuple

from ..tiled import TILE_K, TILE_N

MMA_DEQUANT = 0
MMA_DOT_SCALED = 1

# sm_100: tcgen05 block-scaled MMA wants 128-row tiles.
DOT_SCALED_CONFIGS = [(128, 128, 128, 4, 3), (128, 256, 128, 8, 3)]

# sm_90 in-kernel dequant, by M bucket (upper bound, inclusive).
DEQUANT_CONFIGS = [
    (16, (16, 64, 128, 4, 3)),    # decode: mma.sync tiles, many programs along N
    (64, (64, 64, 128, 4, 3)),
    (None, (128, 128, 64, 8, 3)),  # prefill: wgmma tiles
]


def gemm_config(m: int, n: int, k: int, mma: int) -> tuple[int, int, int, int, int]:
    if mma == MMA_DOT_SCALED:
        return DOT_SCALED_CONFIGS[0]
    for bound, config in DEQUANT_CONFIGS:
        if bound is None or m <= bound:
            return config
    raise AssertionError("unreachable")


# Skinny (split-K, word-decode) kernel for small M, gemm_splitk.py: (BLOCK_N, BLOCK_K, programs
# per SM, num_warps, num_stages). Two warps make Triton use mma.sync (both operands in registers):
# measured on an H200 (benchmarks/probe_splitk.py), 2-warp tiles beat every 4- and 8-warp wgmma
# tile by 1.3-1.7x at M <= 16; small K-tiles (64) and 8 programs per SM beat larger ones (the
# kernel is bound by the L1/shared-memory pipe that stages the packed tile, see benchmarks/NOTES.md);
# 16 programs per SM win on the widest weight (N = 28672).
SPLITK_CONFIG = (64, 64, 8, 2, 4)
SPLITK_CONFIG_WIDE_N = (64, 64, 16, 2, 4)
# Row-major weights up to here take the skinny kernel: the register-fed mainloop up to M = 32 at
# 1.0-1.4x bf16 against 0.40-0.52x for dequantize + cuBLASLt at M = 17 / 32 (H100, six shapes,
# benchmarks/probe_mma.py --m32, results/probe_mma_m32_session16_h100.txt); at M = 64 the tl.dot
# skinny kernel measured 0.31-0.41x bf16 against 0.44x (H200, session 2), so 64 stays dequantize.
SPLITK_MAX_M = 32


# The same kernel on weights in the tiled layout (nvfp4_inductor/tiled.py, BLOCK_N x BLOCK_K =
# TILE_N x TILE_K = 64 x 64), measured on an H200 at M = 1: 8 programs per SM 1.25-1.59x bf16
# cuBLAS; 16 per SM best on the widest weight (67.5 vs 74.0 us at N = 28672).
TILED_CONFIG = (64, 64, 8, 2, 4)
TILED_CONFIG_WIDE_N = (64, 64, 16, 2, 4)


# The register-fed mainloop (gemm_mma.py, M <= 32, tiled or row-major weights): a warp per 32 rows
# of the 64 x 64 tile, so 2 warps; it prefetches in registers itself (no Triton pipelining: num_stages 1).
# Measured on an H100 (benchmarks/probe_mma.py, eager, results/probe_mma_session9_h100.txt): at
# M <= 8, 16 programs per SM (4096 x 14336, M = 1: 17.2 us vs 18.3 / 17.4 with 8 / 24; 8192 x 28672:
# 51.0 vs 55.7 / 55.8); at M = 16 (80 registers) 8 per SM (20.2 vs 24.1 us; 60.4 vs 69.3).
REG_MMA_CONFIG = (64, 64, 16, 2, 1)
REG_MMA_PROGRAMS_PER_SM_TWO_B = 8  # M > 8
# ... and at most this many: at M = 9..16 the kernel holds 88 registers (sm_90, Triton 3.6's ptxas),
# so 10 programs of 64 threads fit an SM. Rounded up to ~8 an SM, the splits of the N = 28672
# weights planned 10.2 an SM and the last 24 programs ran as a second wave. H100, eager, M = 16
# (benchmarks/probe_m16.py --occ, session 30, three runs): 4096 x 28672 38.1 / 38.6 / 38.7 -> 32.0 /
# 32.6 / 32.4 us, 8192 x 28672 71.3 / 71.4 / 71.0 -> 59.2 / 59.8 / 59.4 (2 splits); rounding down
# to 8 an SM instead cost the mid shapes 0.1-0.5 us (4096 x 14336, 4 splits against 5), to 10 an SM
# 0.8 (14336 x 4096, 20 against 17); a ceiling of 80 registers (12 an SM, 20 bytes spilled) was no
# faster.
REG_MMA_MAX_PER_SM_TWO_B = 10
REG_MMA_PROGRAMS_PER_SM_FOUR_B = 6  # M > 16 (142 registers: 7 programs of 64 threads fit an SM;
# 4 / 6 / 7 each best on two of six shapes, probe_mma.py --m32)
REG_MMA_MAX_M = 32  # x rows in 1, 2 or 4 blocks of 8 (an mma each)
# The default for tiled weights (eager and template) up to here: at M = 17 / 32 the tl.dot skinny
# kernel was as fast or faster on 4 of 6 shapes (H100, probe_mma.py --m32: 4096 x 14336 29.5 vs
# 27.1 us, 14336 x 4096 29.6 vs 31.5, 8192 x 28672 89.3 vs 91.6-113), so it keeps 17..64.
REG_MMA_MAX_M_TILED = 16

# K-steps a split of it runs at least, M <= 8 and M > 8 (eager and template alike): same kernel,
# splits of at least 1 / 2 / 4 / 8 steps (probe_mma.py --min-steps, results/probe_mma_session9_h100.txt):
# 4096 x 4096, M = 1: 9.4 / 9.4 / 8.6 / 9.9 us; 6144 x 4096: 10.2 / 10.1 / 9.7 / 11.2; M = 16:
# 12.6 / 12.7 / 12.6 / 11.5 and 13.0 / 13.1 / 13.2 / 12.9; longer K or wider N: no change.
REG_MMA_MIN_STEPS = (4, 8)
# Row-major weights with plain scales at M <= 8 (the grouped k-mapping, gemm_mma LAYOUT 3): a
# split's K range is also the contiguous piece of each of its 64 rows a program reads, and longer
# pieces measured faster than more programs (H100, M = 1, benchmarks/probe_mma.py --splits --rows,
# results/probe_mma_splits_rows_session17_h100.txt; 16 programs per SM and 4 K-steps -> this:
# 4096^2 10.1 -> 9.9 us, 4096 x 6144 13.5 -> 12.1, 4096 x 14336 22.8 -> 21.9, 14336 x 4096 23.8 ->
# 21.8, 4096 x 28672 39.3 -> 36.8; 8192 x 28672 68.6, against 65.5 at 12 groups a split, this
# rule's 11 not probed; bench_gemm, alternating runs: 14336 x 4096 25.2 -> 23.1, 8192 x 28672
# 70.1 / 69.4 -> 66.3 / 67.5).
REG_MMA_GROUPED_PER_SM = 8
REG_MMA_GROUPED_MIN_STEPS = 8  # two groups of 4 K-tiles
# It addresses tiled codes with int32 offsets in uint32 words: fewer than 2^31 words of 4 bytes
# (row-major codes through a 64-bit pointer per row).
REG_MMA_MAX_CODE_BYTES = 2**33


def reg_mma_blocks(m: int) -> int:
    """Blocks of 8 x rows the register-fed mainloop multiplies for M rows (M <= REG_MMA_MAX_M)."""
    return 1 if m <= 8 else 2 if m <= 16 else 4


def splitk_config(m: int, n: int, k: int, num_sms: int, tiled: bool = False,
                  min_steps: int | None = None, reg_mma: bool = False, grouped: bool = False
                  ) -> tuple[int, int, int, int, int, int]:
    """-> (BLOCK_M, BLOCK_N, BLOCK_K, num_splits, num_warps, num_stages) of the skinny kernel;
    min_steps: K-steps a split runs at least (the eager launcher: MIN_STEPS_PER_SPLIT; None: 1, or
    REG_MMA_MIN_STEPS for the register-fed mainloop); reg_mma: the register-fed mainloop (tiled
    weights, M <= 16; row-major, M <= 32); grouped: its grouped k-mapping (row-major weights, plain
    scales, M <= 8: REG_MMA_GROUPED_*)."""
    wide = n >= 16384
    max_per_sm = None
    if reg_mma:
        block_n, block_k, per_sm, warps, stages = REG_MMA_CONFIG
        if m > 8:
            per_sm = REG_MMA_PROGRAMS_PER_SM_TWO_B if m <= 16 else REG_MMA_PROGRAMS_PER_SM_FOUR_B
        elif grouped:
            per_sm = REG_MMA_GROUPED_PER_SM
        if min_steps is None:
            min_steps = REG_MMA_GROUPED_MIN_STEPS if grouped else REG_MMA_MIN_STEPS[m > 8]
        if 8 < m <= 16:
            max_per_sm = REG_MMA_MAX_PER_SM_TWO_B
    elif tiled:
        block_n, block_k, per_sm, warps, stages = TILED_CONFIG_WIDE_N if wide else TILED_CONFIG
    else:
        block_n, block_k, per_sm, warps, stages = SPLITK_CONFIG_WIDE_N if wide else SPLITK_CONFIG
    return _skinny_config(m, n, k, num_sms, block_n, block_k, per_sm, warps, stages, min_steps or 1,
                          max_per_sm)


# The eager launcher splits K into ranges of at least this many K-steps. Measured when a separate
# reduce kernel (N / 128 programs looping over the splits) summed the partials, many short splits
# were slow (H200, benchmarks/probe_skinny.py --min-steps, tiled weights, kernel + reduce: N x K =
# 1024 x 4096 took 14.1 us at M = 1 and 35.5 us at M = 16 with 64 one-step splits, 7.4 and 10.1 us
# with 8 splits of 8 steps (bf16 cuBLAS: 6.9, 7.2 us); 4096 x 4096: 11.4 -> 10.1 us and 16.5 ->
# 12.6 us; shapes that already ran >= 8 steps a split unchanged). The Inductor template's tl.dot
# mainloop keeps one step as the minimum: there the 8-step rule measured 4.5% fewer tokens/s in
# bench_decode.py (W4A16 999 vs 1046, W4A4 864 vs 906 at batch 1). The register-fed mainloop, in
# both, has its own rule (REG_MMA_MIN_STEPS, measured with the split sum in the GEMM kernel).
MIN_STEPS_PER_SPLIT = 8


def _skinny_config(m, n, k, num_sms, block_n, block_k, per_sm, warps, stages, min_steps=1,
                   max_per_sm=None):
    """M padded to a power of two >= 16; K split so that about per_sm programs run on each SM
    (rounded up; at most max_per_sm, what fits an SM: one wave), in ranges of at least min_steps
    K-steps."""
    block_m = max(16, 1 << (m - 1).bit_length())
    steps = -(-k // block_k)
    tiles_n = -(-n // block_n)
    splits = -(-per_sm * num_sms // tiles_n)
    if max_per_sm is not None:
        splits = min(splits, max_per_sm * num_sms // tiles_n)
    splits = max(1, min(steps // min_steps, splits))
    return block_m, block_n, block_k, splits, warps, stages


# The last split of an output tile sums the tile's partials in the GEMM kernel itself
# (gemm_splitk.sum_splits): SPLITS partials of BLOCK_N x ROWS at a time, SPLIT_SUM_PER_THREAD a
# thread (by ROWS, M rounded up to a power of two; 8 where not listed). Each round is an L2 round
# trip after the tile's slowest split (at M = 16, one split a round: 4.5 us for the 16 of 14336 x
# 4096, H100, benchmarks/probe_timeline.py --m 16), so more at once where that measured faster:
# 32 splits at M = 1, 2 at M = 9..16 (the decoder block with PDL, GPU busy, against 8 / 1 in the
# same call: M = 1 W4A16 74.4 -> 71.3-71.8 us, W4A4 78.0-78.2 -> 74.6-74.7; M = 16 W4A16 108.7-112.9
# -> 107.3; a decode step 758.9 -> 733.2 us; eager: benchmarks/probe_mma.py --sum). M = 2..8 keep
# 8 a thread (1 split a round at M = 8: 2 measured no faster). None of these adds registers to the
# register-fed kernel's (sm_90 compiles: 56 at M = 1, 80 at 16); 4 at M = 16 would take 88-214.
SPLIT_SUM_PER_THREAD = 8
SPLIT_SUM_PER_THREAD_BY_ROWS = {1: 32, 16: 32}


def split_sum_tile(m: int, splits: int, block_n: int, num_warps: int) -> tuple[int, int]:
    """-> (ROWS, SPLITS) of the in-kernel split sum for M rows and that many splits."""
    rows = 1 << (m - 1).bit_length()
    per_thread = SPLIT_SUM_PER_THREAD_BY_ROWS.get(rows, SPLIT_SUM_PER_THREAD)
    at_once = per_thread * 32 * num_warps // (block_n * rows)
    return rows, max(1, min(1 << (splits - 1).bit_length(), at_once))


# A deferred RMSNorm's h, read whole by the last split of each tile (the template's RMS), up to this
# many elements (rows padded to a power of two, times K so padded): 64 fp32 registers a thread at
# 2 warps. Each split summing its own K range instead (any size) cost every program an L2 round
# trip after its products: W4A16 decode step 680 us against 671, and at 16 rows the decoder block
# 1.75x bf16 against 2.00x with the norm's own kernel (H100, benchmarks/NOTES.md, session 25).
RMS_MAX_ELEMENTS = 4096


def rms_in_template(m: int, k: int) -> bool:
    """Whether the template's last split can read h's m rows of k whole (gemm_splitk.load_rows)."""
    return (1 << (m - 1).bit_length()) * (1 << (k - 1).bit_length()) <= RMS_MAX_ELEMENTS


def split_ranges(k: int, block_k: int, splits: int) -> tuple[int, int]:
    """-> (splits, K-steps per split) covering cdiv(k, block_k) steps with no empty split."""
    steps = -(-k // block_k)
    per_split = -(-steps // splits)
    return -(-steps // per_split), per_split


# sm_100, W tiled and x NVFP4 (gemm_splitk.dot_scaled_mainloop): tcgen05 block-scaled MMA needs
# 128 x 128 weight steps (compiled for sm_100 only: no Blackwell machine here, so not timed).
DOT_SCALED_SPLITK = (128, 128, 8, 4, 3)  # BLOCK_N, BLOCK_K, programs per SM, warps, stages


def dot_scaled_splitk_config(m: int, n: int, k: int, num_sms: int, min_steps: int = 1
                             ) -> tuple[int, int, int, int, int, int]:
    """-> (BLOCK_M, BLOCK_N, BLOCK_K, num_splits, num_warps, num_stages) of the sm_100 skinny GEMM."""
    return _skinny_config(m, n, k, num_sms, *DOT_SCALED_SPLITK, min_steps)


# Which implementation nvfp4::linear uses on CUDA:
#   "splitk": the skinny kernel above, for M <= SPLITK_MAX_M (decode). Measured on an H200 at M = 1:
#       0.77-0.88x of bf16 cuBLAS, against 0.34-0.48x for dequantize + cuBLAS.
#   "dequant_cublas": dequantize W to bf16 with the Triton dequantize kernel (W4A4: x quantized to
#       its bf16 values first), then one cuBLASLt GEMM that reads the global scales on the device
#       and adds the bias (kernels/cublaslt.py): 0.84-0.94x bf16 at M = 4096 (H100, W4A16; it was
#       0.63-0.82x with an fp32 product and a second pass, same call).
#       Whatever x's dtype: W4A16 multiplies x rounded to bf16 (reference.linear), and the GEMM
#       writes fp32 where the output is fp16 / fp32, rounded once after.
#   "triton": the first NVFP4 GEMM kernel (gemm.py), 2.3-16x slower than bf16 cuBLAS on sm_90; not
#       chosen (it served fp16 / fp32 x above SPLITK_MAX_M until the GEMM above could write fp32
#       with the scales applied), reachable through FORCE_PATH; its sm_100 block-scaled MMA is
#       compiled in CI.
# FORCE_PATH overrides the choice (benchmarks and tests use it to measure each).
FORCE_PATH = None
PATHS = ("splitk", "dequant_cublas", "triton")


# On the tiled layout the skinny kernel wins further: at M = 64 it took 16-158 us against 28-329 us
# for dequantize + cuBLAS (H200, benchmarks/probe_template.py, N x K = 4096^2 .. 28672 x 8192).
TILED_SPLITK_MAX_M = 64


def linear_path(m: int, n: int, k: int, x_dtype, activation: str, tiled: bool = False) -> str:
    """The path for an (M, K) x and an (N, K) weight (the table's keys; M alone decides today)."""
    if FORCE_PATH is not None:
        return FORCE_PATH
    if m <= (TILED_SPLITK_MAX_M if tiled else SPLITK_MAX_M):
        return "splitk"
    return "dequant_cublas"


class TemplateConfig(NamedTuple):
    """One choice of the Inductor NVFP4 GEMM template (templates/nvfp4_tiled_gemm.py.jinja); the
    tiled layout fixes BLOCK_N, BLOCK_K = TILE_N, TILE_K (twice each for sm_100's dot_scaled)."""
    block_m: int
    split: int  # K ranges; > 1: the template stores (split, M, N) partial sums
    tiles_per_split: int  # K-steps of block_k per range
    num_warps: int
    num_stages: int
    block_n: int = TILE_N
    block_k: int = TILE_K
    reg_mma: int = 0  # 1, 2 or 4: the register-fed mainloop for x rows up to 8 * reg_mma (gemm_mma.py)


TEMPLATE_MAX_SPLIT_M = TILED_SPLITK_MAX_M  # up to here the template splits K like the eager kernel
# Above TEMPLATE_MAX_SPLIT_M the template runs one program per (BLOCK_M, 64) output tile, no split K.
# Measured on an H200 against the extern choice, dequantize + cuBLAS (benchmarks/probe_template.py,
# results/probe_template_h200.txt): it wins where it has at least a program per SM (M = 128: 66 vs
# 99 us at N x K = 14336 x 4096, 172 vs 344 us at 28672 x 8192; M = 256: 84 vs 112, 330 vs 404 us)
# and loses where it has fewer (N = 4096, 64-128 programs: 44-254 us vs 33-108 us), and from
# M = 512 on (e.g. 614 vs 555 us, M = 1024 1198 vs 925 us at 28672 x 8192; a decoder block at
# M = 4096: 0.51x bf16 vs 0.85x). The default pick follows that (template_is_default).
TEMPLATE_MAX_M = 256


def template_is_default(m: int, n: int, config: "TemplateConfig", num_sms: int) -> bool:
    """Whether the template (rather than dequantize + cuBLAS) is the default pick."""
    if m <= TEMPLATE_MAX_SPLIT_M:  # the skinny kernel's range (split 1 only for a single K-step)
        return True
    programs = -(-n // config.block_n) * -(-m // config.block_m)
    return m <= TEMPLATE_MAX_M and programs >= num_sms


# Above TEMPLATE_MAX_SPLIT_M, one program per (BLOCK_M, BLOCK_N) output tile; untuned starting
# points (the first is the default pick, the rest join under mode="max-autotune").
TEMPLATE_WIDE_CONFIGS = [(128, 4, 3), (64, 4, 4), (128, 8, 3), (256, 8, 3)]


def template_configs(m: int, n: int, k: int, num_sms: int, dot_scaled: bool = False,
                     reg_mma: bool = False) -> list[TemplateConfig]:
    """The template's configs for an (M, K) x (N, K)^T product, default pick first. dot_scaled:
    sm_100 with x NVFP4 (128 x 128 weight steps; compiled for sm_100, never run here); reg_mma:
    the register-fed mainloop may run (CUDA): up to REG_MMA_MAX_M_TILED it is the default pick,
    the tl.dot mainloop's configs follow for max-autotune."""
    if reg_mma and m <= REG_MMA_MAX_M_TILED and not dot_scaled:
        block_m, block_n, block_k, splits, warps, stages = splitk_config(m, n, k, num_sms, reg_mma=True)
        splits, per_split = split_ranges(k, block_k, splits)
        first = TemplateConfig(block_m, splits, per_split, warps, stages, block_n, block_k,
                               reg_mma=reg_mma_blocks(m))
        # every choice must store the same (split, M, N) partials
        return [first] + [c._replace(split=splits, tiles_per_split=per_split)
                          for c in template_configs(m, n, k, num_sms)]
    if m <= TEMPLATE_MAX_SPLIT_M:
        if dot_scaled:
            block_m, block_n, block_k, splits, warps, stages = dot_scaled_splitk_config(m, n, k, num_sms)
            variants = [(warps, stages), (4, 4), (8, 3)]
        else:
            block_m, block_n, block_k, splits, warps, stages = splitk_config(m, n, k, num_sms, tiled=True)
            variants = [(warps, stages)] + [(w, s) for w in (2, 4) for s in (3, 4, 5) if (w, s) != (warps, stages)]
        splits, per_split = split_ranges(k, block_k, splits)
        return [TemplateConfig(block_m, splits, per_split, w, s, block_n, block_k) for w, s in variants]
    block_n, block_k = (2 * TILE_N, 2 * TILE_K) if dot_scaled else (TILE_N, TILE_K)
    steps = -(-k // block_k)
    return [TemplateConfig(block_m, 1, steps, w, s, block_n, block_k)
            for block_m, w, s in TEMPLATE_WIDE_CONFIGS]
