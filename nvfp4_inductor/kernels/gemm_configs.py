"""Tile configurations of the NVFP4 GEMMs, kept apart from the kernels and from the choice of
kernel (plan.py). Each value is a measured choice: docs/gemm.md has the sweeps behind them."""

from typing import NamedTuple

from nvfp4_inductor.reference.tiled import TILE_K, TILE_N

# The split-K GEMM's tl.dot mainloop (device/mainloops.dot_mainloop): (BLOCK_N, BLOCK_K, programs per SM,
# num_warps, num_stages). Two warps make Triton use mma.sync (both operands in registers), which
# beats every 4- and 8-warp wgmma tile at decode sizes; small K-tiles and 8 programs per SM keep
# the L1 / shared-memory pipe that stages the packed tile from being the limit; the widest weights
# (N >= WIDE_N) want 16 programs per SM. Row-major and tiled weights alike (tiled: BLOCK_N x
# BLOCK_K = TILE_N x TILE_K).
SPLITK_CONFIG = (TILE_N, TILE_K, 8, 2, 4)
SPLITK_CONFIG_WIDE_N = (TILE_N, TILE_K, 16, 2, 4)
WIDE_N = 16384

# The wgmma mainloop (sm_90, tiled W, plan.WGMMA_MIN_M..WGMMA_MAX_M rows): (BLOCK_M, BLOCK_K, warps,
# stages); a K-step is two whole tiles. The best of 64 / 128 rows, one or two tiles a step, 4 or 8
# warps, 3 or 4 stages on every benchmark shape at 64 and 128 rows.
WGMMA_CONFIG = (64, 2 * TILE_K, 4, 3)


def wgmma_config(m: int, n: int, k: int, num_sms: int) -> tuple[int, int, int, int, int, int]:
    """-> (BLOCK_M, BLOCK_N, BLOCK_K, num_splits, num_warps, num_stages) of the wgmma mainloop:
    blocks of BLOCK_M rows; K cut in two where the output tiles are fewer than the SMs and all
    rows fit one block (the split sum's condition); otherwise not split (that measured faster)."""
    block_m, block_k, warps, stages = WGMMA_CONFIG
    tiles = -(-n // TILE_N) * -(-m // block_m)
    splits = 2 if m <= block_m and tiles < num_sms and -(-k // block_k) >= 2 else 1
    return block_m, TILE_N, block_k, splits, warps, stages


def tiled_step(mainloop: str) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) by which a mainloop steps through tiled weights: whole tiles; two along K
    a wgmma step; 2 x 2 for sm_100's block-scaled MMA."""
    if mainloop == "dot_scaled":
        return 2 * TILE_N, 2 * TILE_K
    return (TILE_N, WGMMA_CONFIG[1]) if mainloop == "wgmma" else (TILE_N, TILE_K)


# The register-fed mainloop's grouped k-mapping (row-major W, plain scales, M <= 8: device/mma.py,
# LAYOUT_GROUPED): K-tiles whose scales a lane reads as one word; splits cover whole groups.
MMA_GROUP = 4

# The register-fed mainloop (device/mma.py): a warp per 32 rows of the 64 x 64 tile, so 2 warps; it
# prefetches in registers itself (no Triton pipelining: num_stages 1). 16 programs per SM at
# M <= 8, 8 at M = 9..16 (more registers a thread), 6 above.
REG_MMA_CONFIG = (64, 64, 16, 2, 1)
REG_MMA_PROGRAMS_PER_SM_TWO_B = 8  # M = 9..16
# ... and at most this many at M = 9..16: the kernel holds 88 registers a thread there (sm_90), so
# 10 programs of 64 threads fit an SM; more splits would run as a second wave.
REG_MMA_MAX_PER_SM_TWO_B = 10
REG_MMA_PROGRAMS_PER_SM_FOUR_B = 6  # M = 17..32 (142 registers: 7 programs fit an SM)
# K-steps a split runs at least, M <= 8 and M > 8.
REG_MMA_MIN_STEPS = (4, 8)
# Row-major weights with plain scales at M <= 8 (the grouped k-mapping, gemm_mma LAYOUT 3): a
# split's K range is also the contiguous piece of each of its 64 rows a program reads, and longer
# pieces beat more programs.
REG_MMA_GROUPED_PER_SM = 8
REG_MMA_GROUPED_MIN_STEPS = 8  # two groups of 4 K-tiles


def reg_mma_blocks(m: int) -> int:
    """Blocks of 8 x rows the register-fed mainloop multiplies for M rows (M <= plan.MMA_MAX_M)."""
    return 1 if m <= 8 else 2 if m <= 16 else 4


def splitk_config(m: int, n: int, k: int, num_sms: int,
                  min_steps: int | None = None, reg_mma: bool = False, grouped: bool = False
                  ) -> tuple[int, int, int, int, int, int]:
    """-> (BLOCK_M, BLOCK_N, BLOCK_K, num_splits, num_warps, num_stages) of the split-K kernel;
    min_steps: K-steps a split runs at least (the eager launcher: MIN_STEPS_PER_SPLIT; None: 1, or
    REG_MMA_MIN_STEPS for the register-fed mainloop); reg_mma: the register-fed mainloop; grouped:
    its grouped k-mapping (row-major weights, plain scales, M <= 8: REG_MMA_GROUPED_*)."""
    wide = n >= WIDE_N
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
    else:
        block_n, block_k, per_sm, warps, stages = SPLITK_CONFIG_WIDE_N if wide else SPLITK_CONFIG
    return _skinny_config(m, n, k, num_sms, block_n, block_k, per_sm, warps, stages, min_steps or 1,
                          max_per_sm)


# The eager launcher's tl.dot mainloop splits K into ranges of at least this many K-steps (many
# one-step splits were slow to sum); the Inductor template keeps one step as its minimum (it
# measured faster at decode: docs/gemm.md); the register-fed mainloop has its own rule in both.
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
# (device/epilogue.sum_splits): SPLITS partials of BLOCK_N x ROWS at a time, SPLIT_SUM_PER_THREAD a
# thread (by ROWS, M rounded up to a power of two; 8 where not listed). Each round is an L2 round
# trip after the tile's slowest split, so more at once where that measured faster (M = 1 and
# 9..16); none of these adds registers to the register-fed kernel's, 4 at M = 16 would.
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
# 2 warps. (Each split summing its own K range instead costs every program an L2 round trip.)
RMS_MAX_ELEMENTS = 4096


def rms_in_template(m: int, k: int) -> bool:
    """Whether the template's last split can read h's m rows of k whole (device/epilogue.load_rows)."""
    return (1 << (m - 1).bit_length()) * (1 << (k - 1).bit_length()) <= RMS_MAX_ELEMENTS


def split_ranges(k: int, block_k: int, splits: int) -> tuple[int, int]:
    """-> (splits, K-steps per split) covering cdiv(k, block_k) steps with no empty split."""
    steps = -(-k // block_k)
    per_split = -(-steps // splits)
    return -(-steps // per_split), per_split


# sm_100, W tiled and x NVFP4 (device/mainloops.dot_scaled_mainloop): tcgen05 block-scaled MMA needs
# 128 x 128 weight steps (compiled for sm_100 only, never timed).
DOT_SCALED_SPLITK = (128, 128, 8, 4, 3)  # BLOCK_N, BLOCK_K, programs per SM, warps, stages


def dot_scaled_splitk_config(m: int, n: int, k: int, num_sms: int, min_steps: int = 1
                             ) -> tuple[int, int, int, int, int, int]:
    """-> (BLOCK_M, BLOCK_N, BLOCK_K, num_splits, num_warps, num_stages) of the sm_100 skinny GEMM."""
    return _skinny_config(m, n, k, num_sms, *DOT_SCALED_SPLITK, min_steps)


class TemplateConfig(NamedTuple):
    """One choice of the Inductor NVFP4 GEMM template (inductor/templates/nvfp4_tiled_gemm.py.jinja);
    the tiled layout fixes BLOCK_N, BLOCK_K = TILE_N, TILE_K (twice each for sm_100's dot_scaled)."""
    block_m: int
    split: int  # K ranges; > 1: the template stores (split, M, N) partial sums
    tiles_per_split: int  # K-steps of block_k per range
    num_warps: int
    num_stages: int
    block_n: int = TILE_N
    block_k: int = TILE_K
    mainloop: str = "dot"  # plan.py's names: "dot", "mma", "wgmma" or "dot_scaled"
    reg_mma: int = 0  # 1, 2 or 4: the register-fed mainloop for x rows up to 8 * reg_mma (device/mma.py)
    sum_rows: int = 0  # split > 1: the in-kernel split sum's tile (split_sum_tile; plan.plan_gemm sets them)
    sum_splits: int = 0


# Above the decode sizes, one program per (BLOCK_M, BLOCK_N) output tile: (BLOCK_M, warps, stages),
# untuned starting points (the first is the default pick, the rest join under mode="max-autotune";
# plan.TEMPLATE_TILE_M is the first's BLOCK_M).
TEMPLATE_WIDE_CONFIGS = [(128, 4, 3), (64, 4, 4), (128, 8, 3), (256, 8, 3)]


def template_configs(m: int, n: int, k: int, num_sms: int, kernel: str, mainloop: str) -> list[TemplateConfig]:
    """The template's configs for an (M, K) x (N, K)^T product, default pick first, for the plan's
    kernel ("splitk" or "tile") and mainloop ("mma", "dot", "wgmma" or "dot_scaled"). With the
    register-fed mainloop first, the tl.dot mainloop's configs follow for max-autotune, splitting K
    alike; the wgmma mainloop's alternatives differ in their stages."""
    if mainloop == "wgmma":
        block_m, block_n, block_k, splits, warps, stages = wgmma_config(m, n, k, num_sms)
        splits, per_split = split_ranges(k, block_k, splits)
        return [TemplateConfig(block_m, splits, per_split, warps, s, block_n, block_k, "wgmma")
                for s in (stages, stages + 1)]
    if mainloop == "mma":
        block_m, block_n, block_k, splits, warps, stages = splitk_config(m, n, k, num_sms, reg_mma=True)
        splits, per_split = split_ranges(k, block_k, splits)
        first = TemplateConfig(block_m, splits, per_split, warps, stages, block_n, block_k, "mma",
                               reg_mma_blocks(m))
        # every choice must store the same (split, M, N) partials
        return [first] + [c._replace(split=splits, tiles_per_split=per_split)
                          for c in template_configs(m, n, k, num_sms, kernel, "dot")]
    if kernel == "splitk":
        if mainloop == "dot_scaled":
            block_m, block_n, block_k, splits, warps, stages = dot_scaled_splitk_config(m, n, k, num_sms)
            variants = [(warps, stages), (4, 4), (8, 3)]
        else:
            block_m, block_n, block_k, splits, warps, stages = splitk_config(m, n, k, num_sms)
            variants = [(warps, stages)] + [(w, s) for w in (2, 4) for s in (3, 4, 5)
                                            if (w, s) != (warps, stages)]
        splits, per_split = split_ranges(k, block_k, splits)
        return [TemplateConfig(block_m, splits, per_split, w, s, block_n, block_k, mainloop) for w, s in variants]
    block_n, block_k = tiled_step(mainloop)
    steps = -(-k // block_k)
    return [TemplateConfig(block_m, 1, steps, w, s, block_n, block_k, mainloop)
            for block_m, w, s in TEMPLATE_WIDE_CONFIGS]


# The grouped GEMM of mixture-of-experts layers (kernels/grouped.py), its tl.dot mainloop: BLOCK_M 16
# (tl.dot's least) where most experts get a few tokens (decode where the register-fed mainloop does
# not fit), 64 where they get many (up to the dequantize form, or where it does not apply); two
# warps keep the dot on mma.sync at BLOCK_M 16, as the dense split-K kernel. (BLOCK_M, BLOCK_N,
# BLOCK_K, num_warps)
GROUPED_DECODE_CONFIG = (16, TILE_N, TILE_K, 2)
GROUPED_PREFILL_CONFIG = (64, TILE_N, TILE_K, 4)
# sm_100's block-scaled MMA (tcgen05 mxf4nvf4) takes 128 x 128 weight steps, as the dense kernel's.
GROUPED_DOT_SCALED_DECODE_CONFIG = (16, 2 * TILE_N, 2 * TILE_K, 4)
GROUPED_DOT_SCALED_PREFILL_CONFIG = (64, 2 * TILE_N, 2 * TILE_K, 4)
# Under the interpreter a program costs per operation, not per element: few, small programs.
GROUPED_INTERPRET_CONFIG = (16, TILE_N, TILE_K, 1)
# Decode: K split so that the programs of the tiles that can have rows (at most one per expert
# with rows, and there are at most min(T, E) of those) fill every SM GROUPED_PROGRAMS_PER_SM
# times, each split at least GROUPED_MIN_STEPS K-steps of the tl.dot mainloop (the register-fed
# one: REG_MMA_MIN_STEPS), as the dense split-K kernel does (docs/gemm.md).
GROUPED_PROGRAMS_PER_SM = 8
GROUPED_MIN_STEPS = 4
# The prefill form's epilogue kernel (grouped.grouped_epilogue_kernel): (BLOCK_M, BLOCK_N, num_warps)
GROUPED_EPILOGUE_CONFIG = (32, 128, 4)


def grouped_splits(tiles: int, steps: int, num_sms: int, min_steps: int = GROUPED_MIN_STEPS) -> int:
    """How many ranges K's `steps` steps are split into (1: no split) for `tiles` output tiles
    that have rows."""
    wanted = -(-GROUPED_PROGRAMS_PER_SM * num_sms // tiles)
    return max(1, min(wanted, steps // min_steps))


class HopperConfig(NamedTuple):
    """The Hopper W4A16 GEMM's tiles (hopper_gemm.py): weight rows (wgmma M),
    tokens (wgmma N) and K a step, TMA ring slots, the mma partition's warps (one warpgroup per 64
    rows: rows / 16), weight tiles a program group, decoded-A ring slots, and the registers a
    thread of the load and decode partitions (setmaxnreg; the mma partition gets the rest), and the
    form: register A (the mma warps decode into wgmma's A registers; no decode partition or A
    ring) or warp-specialized."""
    rows: int = 64
    block_t: int = 128
    block_k: int = 128
    stages: int = 4
    num_warps: int = 4
    group_n: int = 8
    a_stages: int = 2
    load_regs: int = 24
    decode_regs: int = 152
    register_a: bool = False  # the mma warps decode into wgmma's A registers (tiled weights only)

    @property
    def decode_warps(self) -> int:
        """The decode partition's warps: one per 16 weight rows (the A-fragment layout's)."""
        return self.rows // 16


# The planned form, register A on tiled weights: (largest M, config), first match; the last serves
# every larger M. Best of bench_gemm's --hopper-sweep at 128 and 512 rows on its four shapes (H100,
# docs/gemm.md); register A takes K-steps of 64 only (steps of 128 gave wrong results on an H100).
HOPPER_CONFIGS = (
    # M <= 256: two warpgroups of 64 weight rows share each x tile
    (256, HopperConfig(rows=128, block_t=128, block_k=64, stages=4, num_warps=8, register_a=True)),
    # M > 256: the widest wgmma of one warpgroup (128 x 256 fp32 sums run out of registers)
    (None, HopperConfig(rows=64, block_t=256, block_k=64, stages=4, num_warps=4, register_a=True)),
)
# M <= 256 on a weight of at most this many elements: 64 weight rows a program (twice the output
# tiles, so K is split fewer ways; measured faster there: docs/gemm.md)
HOPPER_SMALL_WEIGHT = 4096 * 4096
HOPPER_SMALL_CONFIG = HopperConfig(rows=64, block_t=128, block_k=64, stages=4, num_warps=4, register_a=True)
# The warp-specialized form (a decode partition hands bf16 tiles to the mma warps through shared
# memory), for reference.hopper's layout: the best of its sweep (H100). decode_regs is at most
# 65536 / the program's threads, its warps rounded up to warpgroups: 8 + 4 + 8 warps leave 102
# (96 used), 4 + 4 + 4 leave 170.
HOPPER_WS_CONFIGS = (
    (256, HopperConfig(rows=128, block_t=128, block_k=128, stages=3, num_warps=8, decode_regs=96)),
    (None, HopperConfig(rows=64, block_t=256, block_k=64, stages=4, num_warps=4, decode_regs=152)),
)


def hopper_config(m: int, n: int, k: int, tiled: bool = True) -> HopperConfig:
    """The Hopper W4A16 GEMM's tiles for (M, K) x @ (N, K) W^T: register A on tiled weights
    (HOPPER_CONFIGS), the warp-specialized form on reference.hopper's layout."""
    if not tiled:
        return next(config for limit, config in HOPPER_WS_CONFIGS if limit is None or m <= limit)
    if m <= 256 and n * k <= HOPPER_SMALL_WEIGHT:
        return HOPPER_SMALL_CONFIG
    return next(config for limit, config in HOPPER_CONFIGS if limit is None or m <= limit)


# Where plan_gemm takes the Hopper GEMM (sm_90, tiled weights, a bf16 operand): first and last M.
# bench_gemm's --hopper-sweep measured it faster than the path planned without it on all four
# shapes at both ends, slower than dequantize + cuBLASLt at 4096 rows (docs/gemm.md).
HOPPER_GEMM_M = (128, 512)


def hopper_gemm_planned(m: int) -> bool:
    """Whether the Hopper GEMM serves M rows of x (HOPPER_GEMM_M)."""
    return HOPPER_GEMM_M[0] <= m <= HOPPER_GEMM_M[1]


HOPPER_MIN_STEPS = 4  # K-steps a split at least: a ring of 3-4 slots filled before it drains


def hopper_splits(tiles: int, steps: int, num_sms: int) -> int:
    """Ways to split K for `tiles` output tiles of `steps` K-steps: with fewer tiles than SMs (one
    program an SM: its shared memory), as many splits as keep the programs within one wave."""
    return max(1, min(num_sms // max(tiles, 1), steps // HOPPER_MIN_STEPS))
