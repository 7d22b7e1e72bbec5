"""Compile every Triton kernel variant the launchers use for a GPU target, without a GPU.

Run as a script (in a process without TRITON_INTERPRET, which turns kernels into interpreted
functions): prints one JSON object per case, {"case", "ok", "error", "ptx_checks"}.
    python tests/compile_kernels.py [sm]
"""

import itertools
import json
import os
import re
import sys

assert "TRITON_INTERPRET" not in os.environ, "compile without the interpreter"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from nvfp4_inductor.kernels import dequantize as dk  # noqa: E402
from nvfp4_inductor.kernels import quantize as qk  # noqa: E402

# What the JIT specializes at launch: pointers and these integer sizes divisible by 16.
DIVISIBLE = {"K", "stride_xm", "stride_xm_pairs", "scale_cols_pad"}
DTYPES = ["bf16", "fp16", "fp32"]
LOAD_16B = r"ld\.global(\.\w+)*\.v(4\.b32|2\.b64|4\.f32|4\.b16|8\.b16)"  # 16-byte vector loads

QUANTIZE_SIGNATURE = {
    "x_ptr": None, "data_ptr": "*u8", "scale_ptr": "*u8", "g_in_ptr": "*fp32", "g_out_ptr": "*fp32",
    "partials_ptr": "*fp32", "M": "i32", "K": "i32", "num_partials": "i32", "scale_rows_pad": "i32",
    "scale_cols_pad": "i32", "tiles_k": "i32", "stride_xm": "i32", "stride_xm_pairs": "i32",
    **{name: "constexpr" for name in ("GLOBAL", "WRITE_G", "SWIZZLE", "BLOCK_M", "BLOCK_K",
                                      "FUSED_M", "FUSED_K", "PARTIALS_BLOCK")},
}
AMAX_SIGNATURE = {"x_ptr": None, "partials_ptr": "*fp32", "M": "i32", "K": "i32", "stride_xm": "i32",
                  "num_programs": "i32", "BLOCK_M": "constexpr", "BLOCK_K": "constexpr"}
ROW_G_SIGNATURE = {"x_ptr": None, "g_ptr": "*fp32", "M": "i32", "K": "i32", "stride_xm": "i32",
                   "BLOCK_M": "constexpr", "BLOCK_K": "constexpr"}
DEQUANTIZE_SIGNATURE = {
    "data_ptr": "*u8", "scale_ptr": "*u8", "g_ptr": "*fp32", "index_ptr": "*i64", "out_ptr": None,
    "M": "i32", "K": "i32", "src_rows": "i32", "scale_cols_pad": "i32",
    **{name: "constexpr" for name in ("PER_ROW", "SWIZZLE", "GATHER", "BLOCK_M", "BLOCK_K")},
}


def compile_for(fn, signature, constexprs, target, num_warps=4):
    attrs = {(i,): [["tt.divisibility", 16]] for i, (name, kind) in enumerate(signature.items())
             if kind != "constexpr" and (kind.startswith("*") or name in DIVISIBLE)}
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=target, options={"num_warps": num_warps})


def cases():
    block_m, block_k, num_warps = qk.LARGE_TILE
    for dtype, mode, swizzle in itertools.product(DTYPES, range(4), [False, True]):
        yield (f"quantize-{dtype}-g{mode}-swizzle{int(swizzle)}", qk._quantize_kernel,
               {**QUANTIZE_SIGNATURE, "x_ptr": f"*{dtype}"},
               {"GLOBAL": mode, "WRITE_G": True, "SWIZZLE": swizzle, "BLOCK_M": block_m,
                "BLOCK_K": block_k, "FUSED_M": 1, "FUSED_K": 4096, "PARTIALS_BLOCK": 1024},
               num_warps,
               # the element path never goes through shared memory (the dynamic modes reduce the
               # global amax across warps and the swizzled scale store re-lays out 1/16 of a tile)
               [LOAD_16B] + ([] if mode >= 2 or swizzle else ["!bar.sync"]))
    amax_m, amax_k = qk.AMAX_TILE
    for dtype in DTYPES:
        yield (f"amax-partials-{dtype}", qk._amax_partials_kernel, {**AMAX_SIGNATURE, "x_ptr": f"*{dtype}"},
               {"BLOCK_M": amax_m, "BLOCK_K": amax_k}, 4, [LOAD_16B])
        yield (f"row-g-{dtype}", qk._row_g_kernel, {**ROW_G_SIGNATURE, "x_ptr": f"*{dtype}"},
               {"BLOCK_M": amax_m, "BLOCK_K": amax_k}, 4, [LOAD_16B])
    for dtype, per_row, swizzle, gather in itertools.product(DTYPES, *[[False, True]] * 3):
        yield (f"dequantize-{dtype}-row{int(per_row)}-swizzle{int(swizzle)}-gather{int(gather)}",
               dk._dequantize_kernel, {**DEQUANTIZE_SIGNATURE, "out_ptr": f"*{dtype}"},
               {"PER_ROW": per_row, "SWIZZLE": swizzle, "GATHER": gather,
                "BLOCK_M": dk.BLOCK_M, "BLOCK_K": dk.BLOCK_K}, dk.NUM_WARPS, [])


def main() -> None:
    sm = int(sys.argv[1]) if len(sys.argv) > 1 else 90
    target = GPUTarget("cuda", sm, 32)
    for name, fn, signature, constexprs, num_warps, checks in cases():
        result = {"case": name, "ok": True, "error": "", "ptx_checks": {}}
        try:
            ptx = compile_for(fn, signature, constexprs, target, num_warps).asm["ptx"]
            for check in checks:
                present = re.search(check.lstrip("!"), ptx) is not None
                result["ptx_checks"][check] = present != check.startswith("!")
        except Exception as exc:  # reported, not raised: the test names the failing case
            result.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[-2000:]}")
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
