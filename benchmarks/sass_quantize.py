"""SASS instructions per element of the quantize kernel, compiled for sm_90 without a GPU (ptxas and
nvdisasm from Triton's own bundle). The large-x kernel is straight-line code, so the count of its
instructions over the elements a thread quantizes is close to what it issues per element (the
division slow-path calls, which never run on finite input, are left out). The H200 runs the large
shapes at the SMs' issue rate (README, "Quantize"): this is the number that moves them.

    python benchmarks/sass_quantize.py
"""

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from compile_kernels import QUANTIZE_SIGNATURE, compile_for  # noqa: E402

from nvfp4_inductor.kernels import quantize as qk  # noqa: E402

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
INSTRUCTION = re.compile(r"\s*/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?[A-Z]")


def count(mode: int, swizzle: bool, dtype: str, tile=qk.LARGE_TILE) -> tuple[int, int, float]:
    """-> (registers, SASS instructions of the kernel body, per element) for one variant."""
    block_m, block_k, warps = tile
    kernel = compile_for(
        qk._quantize_kernel, {**QUANTIZE_SIGNATURE, "x_ptr": f"*{dtype}"},
        {"GLOBAL": mode, "WRITE_G": True, "SWIZZLE": swizzle, "VALUES": False, "USE_ASM": True,
         "OPERAND": tl.bfloat16, "BLOCK_M": block_m, "BLOCK_K": block_k, "FUSED_M": 1, "FUSED_K": 4096,
         "PARTIALS_BLOCK": 1024, "NORM": 0, "PDL": True},
        GPUTarget("cuda", 90, 32), warps, 1)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        Path(cubin).write_bytes(kernel.asm["cubin"])
        sass = subprocess.run([BIN / "nvdisasm", "-c", cubin], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([BIN / "cuobjdump", "--dump-resource-usage", cubin], capture_output=True,
                               text=True, check=True).stdout
    body = sass.split(".weak           $__internal")[0]  # the division slow path is a function after it
    lines = [line for line in body.splitlines() if INSTRUCTION.match(line) and " NOP" not in line]
    n = len(lines) - 4 * body.count("CALL.REL")  # each slow-path call site: 3 moves and the call
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    return registers, n, n / (block_m * block_k / (warps * 32))


def main() -> None:
    print(f"triton {triton.__version__}, sm_90, tile {qk.LARGE_TILE}")
    print(f"{'x':>5} {'global scale':>14} {'scales':>9} {'registers':>9} {'instructions':>12} {'per element':>11}")
    for dtype in ("bf16", "fp16", "fp32"):
        for mode, name in ((qk.G_STATIC, "static"), (qk.G_PARTIALS, "dynamic")):
            for swizzle in (False, True):
                regs, n, per = count(int(mode), swizzle, dtype)
                print(f"{dtype:>5} {name:>14} {'swizzled' if swizzle else 'plain':>9} {regs:9d} {n:12d} {per:11.2f}")


if __name__ == "__main__":
    main()
