"""Every Triton kernel variant compiles without a GPU, and its PTX has what the design relies on:
for sm_90 (Hopper, run on the device too) 16-byte loads, no shared-memory round trip in the
quantize element path, wgmma in the GEMM's 64-row and larger tiles; for sm_100 (Blackwell, no
machine here) tcgen05 block-scaled MMA (kind::mxf4nvf4, scale_vec::4X: one scale per 16
elements) in every shipped GEMM tile. A compile
error (seen once: a constexpr branch returning two types) fails here in CI, not on the device."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).with_name("compile_kernels.py")


def _compile_all(sm: int) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPT.parents[1]), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, str(SCRIPT), str(sm)], env=env, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads(line) for line in run.stdout.splitlines()]


@pytest.fixture(scope="module", params=[90, 100], ids=["sm90", "sm100"])
def compiled(request):
    return request.param, _compile_all(request.param)


def test_every_kernel_variant_compiles(compiled):
    sm, results = compiled
    # sm_90: 24 quantize + 2 quantize_values + 6 fused norm + 6 amax / row-g + 26 dequantize + 6 GEMM
    # + 30 skinny (tl.dot, tiled, register-fed, eager PDL) + 2 register-fed mainloop under PDL = 102;
    # sm_100: 2 GEMM tiles + 3 tiles of the skinny kernel's block-scaled mainloop (the template's
    # sm_100 path). Exact, so that a case generator going empty is noticed.
    assert len(results) == (102 if sm == 90 else 5)
    failed = {r["case"]: r["error"] for r in results if not r["ok"]}
    assert not failed, failed


def test_ptx_properties(compiled):
    _, results = compiled
    bad = {r["case"]: r["ptx_checks"] for r in results if not all(r["ptx_checks"].values())}
    assert not bad, bad
    if compiled[0] == 100:
        assert all(r["ptx_checks"] for r in results)  # every sm_100 case checked tcgen05
