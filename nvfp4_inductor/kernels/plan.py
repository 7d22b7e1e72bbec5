"""Which kernel serves an NVFP4 linear: one decision, taken here, for the eager launchers
(kernels/gemm.py, kernels/gemm_splitk.py) and the Inductor lowering (lowerings/linear.py) alike.

    plan_gemm(M, N, K, weight layout, activation, device) -> GemmPlan(kernel, mainloop, x_format)

kernel      "splitk"          the split-K GEMM for decode sizes: K split so that every SM streams
                              weights, the last split of each output tile sums the partials and
                              runs the epilogue (eager: gemm_splitk; compiled: the template); on
                              sm_90 with tiled W also serving batch sizes (mainloop "wgmma")
            "tile"            compiled only, above the decode sizes: the template with one program
                              per output tile, K not split
            "dequant_cublas"  W decoded to bf16 (e2m1 * block scale: exact), then one cuBLASLt GEMM
                              that reads the global scale on the device as alpha and adds the bias
mainloop    "mma"             the register-fed mainloop (gemm_mma.py: mma.sync on operands decoded
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

The thresholds are measured choices; docs/gemm.md has the numbers behind each. Tile sizes and
split counts are not decided here: kernels/gemm_configs.py holds those tables.
"""

from typing import NamedTuple

import torch

from nvfp4_inductor import capability
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


class GemmPlan(NamedTuple):
    kernel: str  # "splitk", "tile" or "dequant_cublas"
    mainloop: str  # "mma", "dot", "wgmma", "dot_scaled", or "" (dequant_cublas)
    x_format: str  # "bf16" or "nvfp4"


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
              compiled: bool = False, mma_operands_fit: bool = True, code_bytes: int = 0) -> GemmPlan:
    """The kernel for (M, K) x @ (N, K) NVFP4 W^T.

    tiled: W in the tiled layout (nvfp4_inductor.reference.tiled) rather than row-major; activation: "bf16"
    (W4A16) or "nvfp4" (W4A4); compiled: for the Inductor lowering (the template may serve every
    M) rather than an eager launch; mma_operands_fit: x's rows start on 4-byte boundaries and W's
    rows (row-major) or codes (tiled) on 8, as the register-fed mainloop's word loads need (the
    caller knows: pointers eagerly, layouts when compiling); code_bytes: W's code bytes."""
    x_fmt = x_format(activation, device, tiled)
    if m <= (SPLITK_MAX_M_TILED if tiled else SPLITK_MAX_M) or wgmma_runs(m, tiled=tiled, x_format=x_fmt,
                                                                         device=device):
        kernel = "splitk"
    elif compiled and template_is_default(m, n, capability.sm_count(device),
                                          2 * TILE_N if x_fmt == "nvfp4" else TILE_N):
        kernel = "tile"
    else:
        kernel = "dequant_cublas"
    if kernel == "dequant_cublas":
        return GemmPlan(kernel, "", x_fmt)
    if kernel == "tile":
        return GemmPlan(kernel, tile_mainloop(x_fmt), x_fmt)
    return GemmPlan(kernel, splitk_mainloop(m, tiled=tiled, x_format=x_fmt, device=device,
                                            mma_operands_fit=mma_operands_fit, code_bytes=code_bytes), x_fmt)


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
