"""Which kernel serves an NVFP4 linear: one decision, taken here, for the eager launchers
(kernels/gemm.py, kernels/gemm_splitk.py) and the Inductor lowering (lowerings/linear.py) alike.

    plan_gemm(M, N, K, weight layout, activation, device) -> GemmPlan(kernel, mainloop, x_format,
                                                                       launch, configs)

kernel      "splitk"          the split-K GEMM for decode sizes: K split so that every SM streams
                              weights, the last split of each output tile sums the partials and
                              runs the epilogue (eager: gemm_splitk; compiled: the template); on
                              sm_90 with tiled W also serving batch sizes (mainloop "wgmma")
            "tile"            compiled only, above the decode sizes: the template with one program
                              per output tile, K not split
            "hopper"          sm_90, tiled W, a bf16 operand x, the rows where it measured fastest
                              (gemm_configs.HOPPER_GEMM_M): the Gluon GEMM of kernels/hopper_gemm.py,
                              register-A form (hopper_launch), eager and compiled alike (the
                              lowering calls the op)
            "dequant_cublas"  W decoded to bf16 (e2m1 * block scale: exact), then one cuBLASLt GEMM
                              that reads the global scale on the device as alpha and adds the bias
mainloop    "mma"             the register-fed mainloop (device/mma.py: mma.sync on operands decoded
                              in registers; CUDA only, inline PTX)
            "dot"             the tl.dot mainloop (sm_90 mma.sync on 2 warps; also what the Triton
                              interpreter runs)
            "wgmma"           sm_90, tiled W, serving batch sizes (WGMMA_MIN_M..WGMMA_MAX_M rows):
                              x's tile as wgmma's first operand, whole weight tiles decoded as the
                              second; K split only where the output tiles are fewer than the SMs
            "dot_scaled"      sm_100 block-scaled MMA (tl.dot_scaled -> tcgen05.mma ... block_scale)
            ""                no mainloop of ours (dequant_cublas)
x_format    "bf16"            x, or for W4A4 its quantized values (e2m1 * block scale, exact in bf16),
                              multiplied as bf16; the global scales go to the epilogue
            "nvfp4"           W4A4 on sm_100 with tiled weights: x's codes and block scales (for
                              dequant_cublas the eager op multiplies their values, e2m1 * scale,
                              and the compiled extern choice decodes the codes: the same operand)

launch      eager "splitk": the whole launch (SplitKLaunch: tiles, splits, warps, stages, grid);
            "hopper": HopperLaunch
configs     compiled: the template's configurations, the default pick first (for "dequant_cublas"
            those that join it under max-autotune)

The grouped GEMM of mixture-of-experts layers is planned here too (plan_grouped -> GroupedLaunch).
The thresholds are measured choices; docs/gemm.md has the numbers behind each. The tables of tile
sizes and split counts they read live in kernels/gemm_configs.py.
"""

import functools
from typing import NamedTuple

import torch

from nvfp4_inductor import capability
from nvfp4_inductor.format import BLOCK_SIZE
from nvfp4_inductor.kernels import gemm_configs
from nvfp4_inductor.reference.tiled import TILE_N

# Up to these rows of x the split-K GEMM serves the linear (decode); above them dequantize + cuBLAS
# (eager) or the template without split K (compiled). On row-major weights the split-K kernel
# loses to dequantize + cuBLAS sooner than on the tiled layout, whose reads are contiguous per tile.
SPLITK_MAX_M = 32
SPLITK_MAX_M_TILED = 64
# Up to these rows the register-fed mainloop replaces tl.dot (x rows in 1, 2 or 4 mma blocks of 8):
# on tiled weights tl.dot is as fast or faster from 17 rows on.
MMA_MAX_M = 32
MMA_MAX_M_TILED = 16
# The register-fed mainloop addresses tiled codes with int32 offsets in uint32 words.
MMA_MAX_CODE_BYTES = 2**33
# sm_90 with tiled weights: from WGMMA_MIN_M to WGMMA_MAX_M rows the wgmma mainloop (blocks of 64
# rows, K split only where M <= 64) replaces the tl.dot mainloop and dequantize + cuBLAS: it
# measured faster on every benchmark shape at 64 and 128 rows, slower at 256.
WGMMA_MIN_M = 33
WGMMA_MAX_M = 128
# Compiled, above SPLITK_MAX_M_TILED: the template (one program per output tile) is the default
# pick up to this many rows where it has at least a program per SM; dequantize + cuBLAS otherwise.
TEMPLATE_MAX_M = 256
TEMPLATE_TILE_M = 128  # BLOCK_M of the template's default configuration above the decode sizes


class SplitKLaunch(NamedTuple):
    """One launch of the split-K kernel (kernels/gemm_splitk.py), everything its launcher reads."""
    mainloop: str  # "mma", "dot", "wgmma" or "dot_scaled"
    layout: str  # "tiled", "row_major", "swizzled" or "grouped" (device/common.LAYOUTS)
    block_m: int
    block_n: int
    block_k: int
    splits: int  # K ranges (1: not split)
    steps_per_split: int  # K-steps of block_k a range (grouped layout: whole groups of 4)
    num_warps: int
    num_stages: int
    grid: tuple[int, int, int]  # (N tiles, splits, 1); wgmma: (blocks of M rows, splits, N tiles)
    tiles: int  # output tiles along N: the split sum's counters
    reg_mma: int  # blocks of 8 x rows of the register-fed mainloop (0: another mainloop)
    sum_rows: int  # the in-kernel split sum's tile (gemm_configs.split_sum_tile)
    sum_splits: int
    pdl: bool  # launched with programmatic dependent launch
    even: bool  # no masks along K (and, row-major W, along N)


class GemmPlan(NamedTuple):
    kernel: str  # "splitk", "tile", "hopper" or "dequant_cublas"
    mainloop: str  # "mma", "dot", "wgmma", "dot_scaled", or "" (dequant_cublas, hopper)
    x_format: str  # "bf16" or "nvfp4"
    launch: "SplitKLaunch | HopperLaunch | None" = None  # eager "splitk"; "hopper" (eager and compiled)
    configs: tuple = ()  # compiled: gemm_configs.TemplateConfig, the default pick first


def x_format(activation: str, device: torch.device, tiled: bool = True) -> str:
    """How x enters the GEMM: "nvfp4" (codes and scales) only for W4A4 on hardware that multiplies
    NVFP4 (sm_100+) with tiled weights; otherwise "bf16" (W4A4: x's quantized values)."""
    return "nvfp4" if activation == "nvfp4" and tiled and capability.block_scaled_mma(device) else "bf16"


def template_is_default(m: int, n: int, num_sms: int, block_n: int = TILE_N) -> bool:
    """Above the decode sizes: whether the template (rather than dequantize + cuBLAS) is the
    default pick: up to TEMPLATE_MAX_M rows, with at least one program per SM."""
    programs = -(-n // block_n) * -(-m // TEMPLATE_TILE_M)
    return m <= TEMPLATE_MAX_M and programs >= num_sms


def plan_gemm(m: int, n: int, k: int, *, tiled: bool, activation: str, device: torch.device,
              compiled: bool = False, mma_operands_fit: bool = True, code_bytes: int = 0,
              swizzled: bool = False, scale_word_aligned: bool = True) -> GemmPlan:
    """The kernel for (M, K) x @ (N, K) NVFP4 W^T, and for an eager split-K launch its whole launch.

    tiled: W in the tiled layout (nvfp4_inductor.reference.tiled) rather than row-major; activation: "bf16"
    (W4A16) or "nvfp4" (W4A4); compiled: for the Inductor lowering (the template may serve every
    M) rather than an eager launch; mma_operands_fit: x's rows start on 4-byte boundaries and W's
    rows (row-major) or codes (tiled) on 8, as the register-fed mainloop's word loads need (the
    caller knows: pointers eagerly, layouts when compiling); code_bytes: W's code bytes; swizzled:
    row-major W's scales swizzled; scale_word_aligned: W's scales start on 4 bytes."""
    x_fmt = x_format(activation, device, tiled)
    if hopper_gemm_runs(m, tiled=tiled, x_format=x_fmt, device=device):
        return GemmPlan("hopper", "", x_fmt, hopper_launch(m, n, k, device))
    if m <= (SPLITK_MAX_M_TILED if tiled else SPLITK_MAX_M) or wgmma_runs(m, tiled=tiled, x_format=x_fmt,
                                                                         device=device):
        kernel = "splitk"
    elif compiled and template_is_default(m, n, capability.sm_count(device),
                                          2 * TILE_N if x_fmt == "nvfp4" else TILE_N):
        kernel = "tile"
    else:
        kernel = "dequant_cublas"
    if kernel == "dequant_cublas":
        mainloop = ""
    elif kernel == "tile":
        mainloop = tile_mainloop(x_fmt)
    else:
        mainloop = splitk_mainloop(m, tiled=tiled, x_format=x_fmt, device=device,
                                   mma_operands_fit=mma_operands_fit, code_bytes=code_bytes)
    if compiled:  # the template's configs; with dequantize + cuBLAS picked, those of "tile" join it
        template = ("tile", tile_mainloop(x_fmt)) if kernel == "dequant_cublas" else (kernel, mainloop)
        configs = gemm_configs.template_configs(m, n, k, capability.sm_count(device), *template)
        return GemmPlan(kernel, mainloop, x_fmt, None, tuple(_with_split_sum(c, m) for c in configs))
    launch = None
    if kernel == "splitk":
        launch = splitk_launch(m, n, k, tiled=tiled, swizzled=swizzled, x_format=x_fmt, device=device,
                               mainloop=mainloop, mma_operands_fit=mma_operands_fit,
                               codes_fit=code_bytes < MMA_MAX_CODE_BYTES, scale_word_aligned=scale_word_aligned)
    return GemmPlan(kernel, mainloop, x_fmt, launch)


# A deferred RMSNorm (lowerings/passes/norms.py): W4A16 linears of up to this many rows of h
# (decode) take it into their template, which reads h's rows whole (gemm_configs.rms_in_template).
DEFER_NORM_MAX_ROWS = 16


def norm_deferred(rows: int, k: int) -> bool:
    """Whether the linears reading a norm's output h (rows of k) take the norm into their GEMM."""
    return rows <= DEFER_NORM_MAX_ROWS and gemm_configs.rms_in_template(rows, k)


def norm_in_template(m: int, k: int, activation: str, configs=()) -> bool:
    """Whether the template applies a deferred norm to M rows of h of K (W4A16, h's rows read whole:
    by the last split of a tile, or with K not split by every program, its BLOCK_M rows), for
    each of `configs` (plan_gemm's); otherwise the eager op does."""
    return (activation != "nvfp4" and gemm_configs.rms_in_template(m, k)
            and all(c.split > 1 or gemm_configs.rms_in_template(c.block_m, k) for c in configs))


def _with_split_sum(config: gemm_configs.TemplateConfig, m: int) -> gemm_configs.TemplateConfig:
    """A template config that splits K, with its in-kernel split sum's tile for M rows."""
    if config.split == 1:
        return config
    rows, splits = gemm_configs.split_sum_tile(m, config.split, config.block_n, config.num_warps)
    return config._replace(sum_rows=rows, sum_splits=splits)


def tile_mainloop(x_format: str) -> str:
    """The template's mainloop above the decode sizes (one program per output tile)."""
    return "dot_scaled" if x_format == "nvfp4" else "dot"


def splitk_mainloop(m: int, *, tiled: bool, x_format: str, device: torch.device,
                    mma_operands_fit: bool = True, code_bytes: int = 0) -> str:
    """The split-K GEMM's mainloop for M rows (plan_gemm's arguments): the block-scaled MMA for an
    NVFP4 x, else the wgmma mainloop where it serves (wgmma_runs), else the register-fed mainloop
    where it runs (CUDA, few rows, operands it can load as words), else tl.dot."""
    if x_format == "nvfp4":
        return "dot_scaled"
    if wgmma_runs(m, tiled=tiled, x_format=x_format, device=device):
        return "wgmma"
    fits = mma_runs(m, tiled=tiled, device=device, mma_operands_fit=mma_operands_fit, code_bytes=code_bytes)
    return "mma" if fits and (not tiled or m <= MMA_MAX_M_TILED) else "dot"


def mma_runs(m: int, *, tiled: bool, device: torch.device, mma_operands_fit: bool = True,
             code_bytes: int = 0) -> bool:
    """Whether the register-fed mainloop can run at all (whether it is chosen: splitk_mainloop)."""
    return (device.type == "cuda" and mma_operands_fit and m <= MMA_MAX_M
            and (not tiled or code_bytes < MMA_MAX_CODE_BYTES))


def wgmma_runs(m: int, *, tiled: bool, x_format: str, device: torch.device) -> bool:
    """Whether the wgmma mainloop serves M rows (sm_90, tiled W, a bf16 operand x)."""
    return tiled and x_format == "bf16" and WGMMA_MIN_M <= m <= WGMMA_MAX_M and capability.wgmma(device)


def hopper_gemm_runs(m: int, *, tiled: bool, x_format: str, device: torch.device) -> bool:
    """Whether the Hopper GEMM (kernels/hopper_gemm.py) serves M rows: sm_90, tiled W, a bf16
    operand x, M in the range where it measured fastest (gemm_configs.HOPPER_GEMM_M), and the Gluon
    API it is written against (capability.gluon_hopper)."""
    return (tiled and x_format == "bf16" and gemm_configs.hopper_gemm_planned(m) and capability.wgmma(device)
            and capability.gluon_hopper())


def mma_operands_aligned(x, w_data, w_scale, tiled: bool) -> bool:
    """x's rows start on 4-byte boundaries (even row stride); W's codes on 8 bytes (row-major: every
    row), tiled scales on 4: the register-fed mainloop's word loads."""
    if tiled:
        w_ok = w_data.data_ptr() % 8 == 0 and w_scale.data_ptr() % 4 == 0
    else:
        w_ok = w_data.data_ptr() % 8 == 0 and w_data.stride(0) % 8 == 0
    return w_ok and x.stride(0) % 2 == 0 and x.data_ptr() % 4 == 0


def operand_facts(x, w_data, w_scale, tiled: bool) -> dict:
    """plan_gemm's keyword arguments that the operands themselves decide: the register-fed
    mainloop's alignments, W's code bytes, whether W's scales start on a word."""
    return dict(mma_operands_fit=mma_operands_aligned(x, w_data, w_scale, tiled), code_bytes=w_data.numel(),
                scale_word_aligned=w_scale.data_ptr() % 4 == 0)


def splitk_grid(mainloop: str, m_blocks, splits, n_tiles) -> tuple:
    """The split-K grid (eager kernel and template alike): with the wgmma mainloop the blocks of
    rows first, so that the programs reading one weight tile run together (it comes from HBM
    once); otherwise the weight tiles first."""
    return (m_blocks, splits, n_tiles) if mainloop == "wgmma" else (n_tiles, splits, m_blocks)


@functools.lru_cache(maxsize=4096)
def splitk_launch(m: int, n: int, k: int, *, tiled: bool, swizzled: bool, x_format: str, device: torch.device,
                  mainloop: str | None = None, mma_operands_fit: bool = True, codes_fit: bool = True,
                  scale_word_aligned: bool = True) -> SplitKLaunch:
    """The split-K kernel's launch for (M, K) x @ (N, K) W^T (plan_gemm's arguments; codes_fit: W's
    code bytes below MMA_MAX_CODE_BYTES): the mainloop (splitk_mainloop's choice where None; a given
    one is checked against what it needs), its tiles, the split of K, warps, stages and grid.
    Cached: an eager decode step asks the same question for every layer, at every step, and
    working it out costs more host time than the GEMM takes on the GPU."""
    code_bytes = 0 if codes_fit else MMA_MAX_CODE_BYTES
    if mainloop is None:
        mainloop = splitk_mainloop(m, tiled=tiled, x_format=x_format, device=device,
                                   mma_operands_fit=mma_operands_fit, code_bytes=code_bytes)
    elif mainloop == "mma" and not mma_runs(m, tiled=tiled, device=device, mma_operands_fit=mma_operands_fit,
                                            code_bytes=code_bytes):
        raise ValueError(f"the register-fed mainloop needs inline PTX (CUDA), at most {MMA_MAX_M} rows "
                         f"of x, x rows at even element offsets, weight rows on 8-byte boundaries (tiled "
                         f"weights: codes on 8 bytes, scales on 4) and fewer than {MMA_MAX_CODE_BYTES} "
                         f"tiled code bytes (int32 word offsets)")
    elif mainloop not in ("mma", "dot", "dot_scaled", "wgmma") or (mainloop == "dot_scaled") != (x_format == "nvfp4"):
        raise ValueError(f"mainloop {mainloop!r} does not multiply an x of format {x_format!r}")
    elif mainloop == "wgmma" and not tiled:
        raise ValueError("the wgmma mainloop reads tiled weights")
    reg_mma = mainloop == "mma"
    # row-major W, plain scales, K % 64 == 0, M <= 8: the register-fed mainloop reads a scale word
    # per 4 K-tiles (splits of whole groups of 4); measured slower at M = 16 (docs/decisions.md).
    grouped = bool(reg_mma and not tiled and not swizzled and m <= 8 and k % (4 * BLOCK_SIZE) == 0
                   and scale_word_aligned)
    num_sms = capability.sm_count(device)
    min_steps = None if reg_mma else gemm_configs.MIN_STEPS_PER_SPLIT  # (reg_mma: its own rule)
    if mainloop == "wgmma":
        config = gemm_configs.wgmma_config(m, n, k, num_sms)
    elif mainloop == "dot_scaled":
        config = gemm_configs.dot_scaled_splitk_config(m, n, k, num_sms, min_steps)
    else:
        config = gemm_configs.splitk_config(m, n, k, num_sms, min_steps=min_steps,
                                            reg_mma=reg_mma, grouped=grouped)
    block_m, block_n, block_k, splits, warps, stages = config
    if tiled and (block_n, block_k) != gemm_configs.tiled_step(mainloop):
        raise ValueError(f"tiled weights need BLOCK_N, BLOCK_K = {gemm_configs.tiled_step(mainloop)}; "
                         f"got {block_n}, {block_k}")
    k_step = gemm_configs.MMA_GROUP * block_k if grouped else block_k
    splits, steps_per_split = gemm_configs.split_ranges(k, k_step, splits)
    if grouped:
        steps_per_split *= gemm_configs.MMA_GROUP
    sum_rows, sum_splits = gemm_configs.split_sum_tile(m, splits, block_n, warps)
    m_blocks, tiles = -(-m // block_m), -(-n // block_n)
    if m_blocks > 1 and not (mainloop == "wgmma" and splits == 1):
        raise ValueError(f"only the wgmma mainloop without split K takes blocks of rows: {m} rows, "
                         f"BLOCK_M = {block_m}, {splits} splits")
    layout = "tiled" if tiled else "swizzled" if swizzled else "grouped" if grouped else "row_major"
    return SplitKLaunch(
        mainloop, layout, block_m, block_n, block_k, splits, steps_per_split, warps, stages,
        grid=splitk_grid(mainloop, m_blocks, splits, tiles), tiles=tiles,
        reg_mma=gemm_configs.reg_mma_blocks(m) if reg_mma else 0, sum_rows=sum_rows, sum_splits=sum_splits,
        # Programmatic dependent launch on sm_90+: every program waits for the previous kernel
        # before any global access (device/mainloops.mainloop), so only the launch and the
        # programs' set-up overlap that kernel's tail (releasing the next launch after the mainloop
        # measured slower at M = 16: docs/decisions.md).
        pdl=device.type == "cuda" and capability.sm90_or_later(device),
        even=n % block_n == 0 and k % k_step == 0)


def splitk_launch_for(x, w_data, w_scale, *, swizzled: bool, tiled_n: int | None, x_format: str = "bf16",
                      mainloop: str | None = None) -> SplitKLaunch:
    """splitk_launch for these tensors (gemm_splitk.gemm_splitk's arguments): their sizes, layout and
    the alignments the register-fed mainloop needs."""
    m, k = x.shape[0], x.shape[1] * (2 if x_format == "nvfp4" else 1)
    tiled = tiled_n is not None
    facts = operand_facts(x, w_data, w_scale, tiled)
    return splitk_launch(m, w_data.shape[0] if tiled_n is None else tiled_n, k, tiled=tiled, swizzled=swizzled,
                         x_format=x_format, device=x.device, mainloop=mainloop,
                         mma_operands_fit=facts["mma_operands_fit"],
                         codes_fit=facts["code_bytes"] < MMA_MAX_CODE_BYTES,
                         scale_word_aligned=facts["scale_word_aligned"])



class HopperLaunch(NamedTuple):
    """One launch of the Hopper GEMM (kernels/hopper_gemm.py)."""
    config: gemm_configs.HopperConfig
    splits: int  # K ranges (1: not split)
    steps_per_split: int  # K-steps of config.block_k a range
    tiles: int  # output tiles (weight rows x tokens): the split sum's counters
    grid: tuple[int]


def hopper_launch(m: int, n: int, k: int, device: torch.device, config: gemm_configs.HopperConfig | None = None,
                  splits: int | None = None, tiled: bool = True) -> HopperLaunch:
    """The Hopper GEMM's launch for (M, K) x @ (N, K) W^T: its tiles (gemm_configs.hopper_config
    where not given; tiled: W in the tiled layout, else reference.hopper's) and the split of K
    (gemm_configs.hopper_splits where not given; a given one is checked); plan_gemm's kernel
    "hopper"."""
    config = config or gemm_configs.hopper_config(m, n, k, tiled)
    if config.rows % 64 or config.num_warps * 16 != config.rows or config.block_k % 64:
        raise ValueError(f"{config}: rows a multiple of 64, num_warps = rows / 16, block_k a multiple of 64")
    if config.register_a and (not tiled or config.block_k != 64):
        raise ValueError(f"{config}: register A reads tiled weights in K-steps of 64")
    tiles = -(-n // config.rows) * -(-m // config.block_t)
    steps = -(-k // config.block_k)
    if splits is None:
        splits = gemm_configs.hopper_splits(tiles, steps, capability.sm_count(device))
    if not 1 <= splits <= steps:
        raise ValueError(f"splits must be 1 .. {steps} (K-steps of {config.block_k}), got {splits}")
    splits, per_split = gemm_configs.split_ranges(k, config.block_k, splits)  # no split without a K-step
    return HopperLaunch(config, splits, per_split, tiles, (tiles * splits, ))


# The grouped GEMM (kernels/grouped.py). Prefill: from this many rows an expert on average (T / E),
# decoding each expert's weights once into bf16 and one torch._grouped_mm is about even with the
# tl.dot kernel, which decodes them again in every row tile, and ahead above; on sm_90 the wgmma
# mainloop keeps the rows up to WGMMA_MAX_M (docs/backend.md, the experts' kernel).
GROUPED_DEQUANT_MIN_ROWS = 64


class GroupedLaunch(NamedTuple):
    """One launch of the grouped GEMM, everything kernels/grouped.py reads. mainloop "" is the
    dequantize form: every expert decoded to bf16, torch._grouped_mm, the epilogue kernel."""
    mainloop: str  # "mma", "wgmma", "dot", "dot_scaled" or ""
    block_m: int  # x rows a program
    block_n: int
    block_k: int
    splits: int
    steps_per_split: int
    num_warps: int
    num_stages: int | None  # None: Triton's default
    m_tiles: int  # row tiles of the work list (grouped.py's docstring, 1.)
    n_tiles: int
    reg_mma: int  # blocks of 8 x rows of the register-fed mainloop (0: another mainloop)
    acc_m: int  # the mainloop's columns (the register-fed one: 8 * max(reg_mma, 2))
    use_asm: bool = False  # the decode's inline PTX (sm_90+)
    even: bool = False  # no masks along K


def grouped_row_tiles(t: int, e: int, block_m: int) -> int:
    """The row tiles of a work-list launch: each expert's rows over block_m, at most
    t // block_m + min(e, t) in all (each expert with rows adds at most one partial tile)."""
    return t // block_m + min(e, t)


def grouped_mma_blocks(t: int, e: int) -> int:
    """Blocks of 8 x rows a program of the register-fed mainloop takes (1, 2 or 4), or 0 (tl.dot):
    about twice the rows an expert gets where the t rows spread evenly over the e experts, so
    that an expert's rows rarely need a second program, which reads its weights again."""
    rows = 2 * -(-t // e)
    return next((nb for nb in (1, 2, 4) if rows <= 8 * nb), 0)


def plan_grouped(t: int, e: int, n_pad: int, k: int, *, device: torch.device, x_codes: bool = False,
                 mma_operands_fit: bool = True, splits: int | None = None,
                 dequant: bool | None = None) -> GroupedLaunch:
    """The grouped GEMM's launch for T rows of x (bf16, or with x_codes sm_100's NVFP4 codes) over E
    experts of n_pad stored rows and K columns, by the rows an expert gets on average (the counts
    stay on the device). mma_operands_fit: x and W as the register-fed mainloop loads them (bf16 x,
    plan.mma_operands_fit, an expert's tiles addressed with 32-bit offsets). splits, dequant: a
    caller's own split of K / choice of the dequantize form (checked), else this plan's."""
    cuda = device.type == "cuda"
    if dequant is None:
        dequant = grouped_dequant_runs(t, e, k, device) and not x_codes
    elif dequant and (x_codes or k % 16):
        raise ValueError("the dequantize form multiplies a bf16 x, with K a multiple of 16")
    num_sms = capability.sm_count(device)
    if dequant:
        block_m, block_n, warps = gemm_configs.GROUPED_EPILOGUE_CONFIG
        return GroupedLaunch("", block_m, block_n, 0, 1, 0, warps, None, grouped_row_tiles(t, e, block_m),
                             -(-n_pad // block_n), 0, block_m)
    nb = grouped_mma_blocks(t, e) if not x_codes and cuda and mma_operands_fit and capability.sm90_or_later(device) \
        else 0
    stages = None
    if nb:  # 64 weight rows by 8 * nb x rows, 64-k steps, two warps
        mainloop, (block_n, block_k, _, warps, _) = "mma", gemm_configs.REG_MMA_CONFIG
        block_m, acc_m = 8 * nb, 8 * max(nb, 2)
        min_steps = gemm_configs.REG_MMA_MIN_STEPS[nb > 1]
    elif not x_codes and cuda and capability.wgmma(device) and t <= WGMMA_MAX_M * e:
        mainloop, (block_m, block_k, warps, stages) = "wgmma", gemm_configs.WGMMA_CONFIG  # x's tile first
        block_n, acc_m, min_steps = TILE_N, block_m, None
    else:
        mainloop = "dot_scaled" if x_codes else "dot"
        decode = t <= 16 * e
        if not cuda:
            config = gemm_configs.GROUPED_INTERPRET_CONFIG
        elif x_codes:
            config = (gemm_configs.GROUPED_DOT_SCALED_DECODE_CONFIG if decode
                      else gemm_configs.GROUPED_DOT_SCALED_PREFILL_CONFIG)
        else:
            config = gemm_configs.GROUPED_DECODE_CONFIG if decode else gemm_configs.GROUPED_PREFILL_CONFIG
        block_m, block_n, block_k, warps = config
        acc_m = block_m
        min_steps = gemm_configs.GROUPED_MIN_STEPS if decode or not cuda else None
    m_tiles, n_tiles = grouped_row_tiles(t, e, block_m), -(-n_pad // block_n)
    steps = -(-k // block_k)
    if splits is None:
        splits = 1 if min_steps is None else gemm_configs.grouped_splits(min(t, e) * n_tiles, steps, num_sms,
                                                                         min_steps)
    splits, per_split = gemm_configs.split_ranges(k, block_k, max(1, min(splits, steps)))
    return GroupedLaunch(mainloop, block_m, block_n, block_k, splits, per_split, warps, stages, m_tiles, n_tiles,
                         nb, acc_m, use_asm=cuda and capability.sm90_or_later(device), even=k % block_k == 0)


def grouped_dequant_runs(t: int, e: int, k: int, device: torch.device) -> bool:
    """Whether the dequantize + torch._grouped_mm form serves T rows over E experts (CUDA, sm_90 and
    up, the GEMM's operands 16-byte aligned: K a multiple of 16)."""
    if device.type != "cuda" or not capability.sm90_or_later(device) or k % 16:
        return False
    return t > WGMMA_MAX_M * e if capability.wgmma(device) else t >= GROUPED_DEQUANT_MIN_ROWS * e
