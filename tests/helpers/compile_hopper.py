"""Compile the Hopper W4A16 GEMM (Gluon) for sm_90 without a GPU, one case per shipped config.

Run as a script (in a process without TRITON_INTERPRET): prints one JSON object per case,
{"case", "ok", "error", "mma", "wait_counts", "loop_wait_counts", "ptxas_serialized", "spills",
"sass_depbar_counts"}.
    python tests/helpers/compile_hopper.py
"""

import json
import os
import re
import subprocess
import sys
import tempfile

assert "TRITON_INTERPRET" not in os.environ, "compile without the interpreter"

import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from nvfp4_inductor.kernels import gemm_configs  # noqa: E402
from nvfp4_inductor.kernels import hopper_gemm  # noqa: E402

WAIT_GROUP = r"wgmma\.wait_group\.sync\.aligned (\d+)"
DEPBAR = r"WARPGROUP\.DEPBAR\.LE gsb0, 0x(\w+)"
LOOP = r"(?s)\n(\$L__BB\d+_\d+):[^\n]*Inner Loop Header(.*?)bra(?:\.uni)?\s+\1;"  # the K loop's body
SERIALIZED = "C7515"  # ptxas: "wgmma.mma_async instructions are serialized"


def signature(config, per_row: bool, bias: bool):
    (x_layout, x_box), (codes_layout, codes_box), (scales_layout, scales_box) = \
        hopper_gemm.descriptor_layouts(config)
    sig = {"x_desc": f"tensordesc<bf16{x_box},{x_layout!r}>",
           "codes_desc": f"tensordesc<i32{codes_box},{codes_layout!r}>",
           "scales_desc": f"tensordesc<i16{scales_box},{scales_layout!r}>",
           "w_global_scale_ptr": "*fp32", "bias_ptr": "*bf16", "out_ptr": "*bf16",
           "M": "i32", "N": "i32", "stride_om": "i32",
           **{name: "constexpr" for name in ("W_GLOBAL_SCALE_PER_ROW", "HAS_BIAS", "STAGES", "GROUP_N",
                                             "num_warps")}}
    constexprs = {"W_GLOBAL_SCALE_PER_ROW": per_row, "HAS_BIAS": bias, "STAGES": config.stages,
                  "GROUP_N": config.group_n, "num_warps": config.num_warps}
    names = list(sig)
    # what the JIT specializes at launch: pointers and a stride divisible by 16
    attrs = {(names.index(name),): [["tt.divisibility", 16]]
             for name in ("w_global_scale_ptr", "bias_ptr", "out_ptr", "stride_om")}
    return sig, constexprs, attrs


def compile_config(config, per_row=False, bias=True, sm=90):
    sig, constexprs, attrs = signature(config, per_row, bias)
    source = GluonASTSource(hopper_gemm.hopper_w4a16_kernel, sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", sm, 32), options={"num_warps": config.num_warps})


def tool_output(tool, args, suffix, data):
    """Run a CUDA tool Triton ships on data written to a temporary file -> its stdout + stderr."""
    with tempfile.NamedTemporaryFile(suffix=suffix, mode="wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)
        f.flush()
        run = subprocess.run([tool.path, *args, f.name], capture_output=True, text=True)
    return run.stdout + run.stderr


def cases():
    configs = {config for _, config in gemm_configs.HOPPER_CONFIGS}
    for config in sorted(configs):
        for per_row, bias in ((False, True), (True, False)):
            yield f"hopper-{'x'.join(map(str, config))}-rowg{int(per_row)}-bias{int(bias)}", config, per_row, bias


def main():
    for case, config, per_row, bias in cases():
        result = {"case": case, "ok": False, "error": None}
        try:
            compiled = compile_config(config, per_row, bias)
            ptx = compiled.asm["ptx"]
            result["mma"] = sorted(set(re.findall(r"wgmma\.mma_async[\w.]*", ptx)))
            result["wait_counts"] = sorted({int(n) for n in re.findall(WAIT_GROUP, ptx)})
            loops = re.findall(LOOP, ptx)
            result["loop_wait_counts"] = sorted({int(n) for _, body in loops for n in re.findall(WAIT_GROUP, body)})
            ptxas = tool_output(knobs.nvidia.ptxas, ["-arch=sm_90a", "-v", "-o", os.devnull], ".ptx", ptx)
            result["ptxas_serialized"] = SERIALIZED in ptxas
            result["spills"] = re.findall(r"(\d+) bytes spill stores", ptxas)
            sass = tool_output(knobs.nvidia.cuobjdump, ["-sass"], ".cubin", compiled.asm["cubin"])
            result["sass_depbar_counts"] = sorted({int(n, 16) for n in re.findall(DEPBAR, sass)})
            result["ok"] = True
        except Exception as e:  # noqa: BLE001 - reported per case
            result["error"] = f"{type(e).__name__}: {e}"[:2000]
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    sys.exit(main())
