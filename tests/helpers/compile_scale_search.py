"""Compile the scale-search kernel variants for sm_90 without a GPU (run as a script, in a process
without TRITON_INTERPRET); prints one JSON object per case: {"case", "ok", "error", "ptx_checks",
"ptx"} (ptx: the PTX's size and its fp32 fma count, for the record).
    python tests/helpers/compile_scale_search.py [sm] [dtype ...]   (bf16 fp16 fp32; default all)
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

from nvfp4_inductor.kernels import scale_search as sk  # noqa: E402

SIGNATURE = {
    "x_ptr": None, "data_ptr": "*u8", "scale_ptr": "*u8", "err_ptr": "*fp32", "g_ptr": "*fp32",
    "u_ptr": "*fp32", "lam_ptr": "*fp32", "M": "i32", "K": "i32", "stride_xm": "i32",
    **{name: "constexpr" for name in ("HESSIAN", "PRUNE", "WRITE_ERR", "BLOCK_R")},
}
DIVISIBLE = {"K", "stride_xm"}
# The error arithmetic must round exactly as the reference: no contracted multiply-adds.
NO_FMA = r"!fma\.rn\.f32"


def main() -> None:
    sm = int(sys.argv[1]) if len(sys.argv) > 1 else 90
    target = GPUTarget("cuda", sm, 32)
    dtypes = sys.argv[2:] or ["bf16", "fp16", "fp32"]
    for dtype, hessian, prune in itertools.product(dtypes, [False, True],
                                                   [True, False]):
        name = f"scale-search-{dtype}-{'hessian' if hessian else 'mse'}-{'prune' if prune else 'full'}"
        result = {"case": name, "ok": True, "error": "", "ptx_checks": {}}
        signature = {**SIGNATURE, "x_ptr": f"*{dtype}"}
        attrs = {(i,): [["tt.divisibility", 16]] for i, (arg, kind) in enumerate(signature.items())
                 if kind != "constexpr" and (kind.startswith("*") or arg in DIVISIBLE)}
        constexprs = {"HESSIAN": hessian, "PRUNE": prune, "WRITE_ERR": True, "BLOCK_R": sk.BLOCK_R}
        try:
            source = ASTSource(fn=sk._scale_search_kernel, signature=signature,
                               constexprs=constexprs, attrs=attrs)
            compiled = triton.compile(source, target=target, options={
                "num_warps": sk.NUM_WARPS, "num_stages": 1, "enable_fp_fusion": False})
            ptx = compiled.asm["ptx"]
            result["ptx_checks"][NO_FMA] = re.search(NO_FMA[1:], ptx) is None
            result["ptx"] = {"chars": len(ptx), "mul_f32": len(re.findall(r"mul\.rn\.f32", ptx))}
        except Exception as exc:  # reported, not raised: the test names the failing case
            result.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[-2000:]}")
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
