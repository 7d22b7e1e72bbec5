"""Compile the Hopper W4A16 GEMM (Gluon, warp-specialized) for sm_90 without a GPU, one case per
weight layout (reference.hopper's, reference.tiled's), shipped config and epilogue variant (the
split-K one among them).

Run as a script (in a process without TRITON_INTERPRET): prints one JSON object per case,
{"case", "config", "split", "ok", "error", "mma", "atomics", "wait_counts", "loops", "mma_loops",
"mma_loop_wait_counts", "loop_releases", "arrives_after_bar_sync", "setmaxnreg", "ptxas_serialized",
"ptxas_warnings", "spills", "sass_depbar_counts"}.
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

from nvfp4_inductor.kernels import hopper_gemm  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, run as a script
from helpers.gemm import hopper_forms  # noqa: E402

WAIT_GROUP = r"wgmma\.wait_group\.sync\.aligned (\d+)"
DEPBAR = r"WARPGROUP\.DEPBAR\.LE gsb0, 0x(\w+)"
SERIALIZED = "C7515"  # ptxas: "wgmma.mma_async instructions are serialized"
# a block label whose comment lines (LLVM's) name it an innermost loop's header
LOOP_HEADER = r"\n(\$L__BB\d+_\d+):([^\n]*(?:\n[ \t]*//[^\n]*)*)"
RELEASE = r"mbarrier\.arrive\.shared::cta"  # a consumer's arrive (not the loader's arrive.expect_tx)
SYNC_EVENTS = r"bar\.sync|barrier\.sync|" + RELEASE + r"|ld\.shared|st\.shared|wgmma\.wait_group"


def inner_loops(ptx: str) -> list[str]:
    """The bodies of the PTX's innermost loops: from the header label to the branch back to it."""
    bodies = []
    for match in re.finditer(LOOP_HEADER, ptx):
        label, comments = match.groups()
        if "Inner Loop Header" not in comments:
            continue
        back = re.search(r"bra(?:\.uni)?\s+" + re.escape(label) + ";", ptx[match.end():])
        if back:
            bodies.append(ptx[match.end():match.end() + back.start()])
    return bodies


def arrives_after_bar_sync(body: str) -> bool:
    """Every consumer arrive in the loop directly follows a bar.sync among the loop's shared-memory
    accesses, wgmma waits, barriers and arrives: all warps of the partition are done before it."""
    events = re.findall(SYNC_EVENTS, body)
    return all(i > 0 and events[i - 1] in ("bar.sync", "barrier.sync") or re.fullmatch(RELEASE, events[i - 1])
               for i, e in enumerate(events) if re.fullmatch(RELEASE, e))


def signature(config, per_row: bool, bias: bool, tiled: bool, split: bool):
    (x_layout, x_box), (codes_layout, codes_box), (scales_layout, scales_box) = \
        hopper_gemm.descriptor_layouts(config, tiled)
    constexprs = {"TILED": tiled, "SPLIT": split, "W_GLOBAL_SCALE_PER_ROW": per_row, "HAS_BIAS": bias,
                  **hopper_gemm.kernel_constexprs(config)}
    sig = {"x_desc": f"tensordesc<bf16{x_box},{x_layout!r}>",
           "codes_desc": f"tensordesc<i32{codes_box},{codes_layout!r}>",
           "scales_desc": f"tensordesc<{'i32' if tiled else 'i16'}{scales_box},{scales_layout!r}>",
           "w_global_scale_ptr": "*fp32", "bias_ptr": "*bf16", "out_ptr": "*bf16",
           "partial_ptr": "*fp32", "counter_ptr": "*i32",
           "M": "i32", "N": "i32", "stride_om": "i32", "splits": "i32", "steps_per_split": "i32",
           **{name: "constexpr" for name in constexprs}}
    names = list(sig)
    # what the JIT specializes at launch: pointers and a stride divisible by 16
    attrs = {(names.index(name),): [["tt.divisibility", 16]]
             for name in ("w_global_scale_ptr", "bias_ptr", "out_ptr", "partial_ptr", "counter_ptr", "stride_om")}
    return sig, constexprs, attrs


def compile_config(config, per_row=False, bias=True, tiled=False, split=False, sm=90):
    sig, constexprs, attrs = signature(config, per_row, bias, tiled, split)
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
    for config, tiled in hopper_forms():
        for per_row, bias, split in ((False, True, False), (True, False, True)):
            yield (f"hopper-{'tiled' if tiled else 'hopper'}-{'x'.join(map(str, config))}-rowg{int(per_row)}"
                   f"-bias{int(bias)}-split{int(split)}", config, per_row, bias, tiled, split)


def facts(compiled) -> dict:
    ptx = compiled.asm["ptx"]
    loops = inner_loops(ptx)
    mma_loops = [body for body in loops if "wgmma.mma_async" in body]
    ptxas = tool_output(knobs.nvidia.ptxas, ["-arch=sm_90a", "-v", "-o", os.devnull], ".ptx", ptx)
    sass = tool_output(knobs.nvidia.cuobjdump, ["-sass"], ".cubin", compiled.asm["cubin"])
    return {
        "mma": sorted(set(re.findall(r"wgmma\.mma_async[\w.]*", ptx))),
        # the split-K handshake: the barrier, then one acq_rel atomic on the tile's counter
        "atomics": re.findall(r"bar\.sync[^\n]*\n(?:(?!bar\.sync)[^\n]*\n)*?[^\n]*(atom[\w.]*)", ptx),
        "wait_counts": sorted({int(n) for n in re.findall(WAIT_GROUP, ptx)}),
        "loops": len(loops),
        "mma_loops": len(mma_loops),
        "mma_loop_wait_counts": sorted({int(n) for body in mma_loops for n in re.findall(WAIT_GROUP, body)}),
        "loop_releases": sum(len(re.findall(RELEASE, body)) for body in loops),
        "arrives_after_bar_sync": all(arrives_after_bar_sync(body) for body in loops),
        "setmaxnreg": sorted({int(n) for n in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}),
        "ptxas_serialized": SERIALIZED in ptxas,
        # (a program of 8 warps gets Triton's .maxnreg 65536 / 256 threads = 256, over ptxas's
        # 255: ignored, which is no cap, as meant)
        "ptxas_warnings": [ln for ln in ptxas.splitlines()
                           if "warning" in ln.lower() and "Too many maxnreg specified" not in ln],
        "spills": re.findall(r"(\d+) bytes spill stores", ptxas),
        "sass_depbar_counts": sorted({int(n, 16) for n in re.findall(DEPBAR, sass)}),
    }


def main():
    for case, config, per_row, bias, tiled, split in cases():
        result = {"case": case, "config": list(config), "split": split, "ok": False, "error": None}
        try:
            result.update(facts(compile_config(config, per_row, bias, tiled, split)))
            result["ok"] = True
        except Exception as e:  # noqa: BLE001 - reported per case
            result["error"] = f"{type(e).__name__}: {e}"[:2000]
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    sys.exit(main())
