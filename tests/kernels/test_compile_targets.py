"""Every Triton kernel variant compiles without a GPU, and its PTX has what the design relies on:
for sm_90 (Hopper, run on the device too) 16-byte loads, no shared-memory round trip in the
quantize element path, mma.sync from registers in the decode GEMMs, wgmma in the serving-batch one; for sm_100 (Blackwell, no
machine here) tcgen05 block-scaled MMA (kind::mxf4nvf4, scale_vec::4X: one scale per 16
elements) in every shipped tile of the split-K GEMM's block-scaled mainloop, and for sm_120
(consumer Blackwell, no tcgen05) the same MMA as a warp-level mma.sync. A compile error
(a constexpr branch returning two types, say) fails here in CI, not on the device."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).parents[1] / "helpers" / "compile_kernels.py"


def _compile_all(sm: int) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPT.parents[2]), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, str(SCRIPT), str(sm)], env=env, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads(line) for line in run.stdout.splitlines()]


@pytest.fixture(scope="module", params=[90, 100, 120], ids=["sm90", "sm100", "sm120"])
def compiled(request):
    return request.param, _compile_all(request.param)


def test_every_kernel_variant_compiles(compiled):
    sm, results = compiled
    # every family of kernels is there (a case generator going empty is noticed)
    families = (["splitk-dot-scaled-"] if sm >= 100 else
                ["splitk-", "splitk-tiled-", "splitk-wgmma-", "splitk-reg-mma-", "splitk-reg-mma-rows-", "mma-mainloop-pdl",
                 "quantize-", "quantize-values-", "rms-norm-quantize-values-", "amax-partials-", "row-g-",
                 "dequantize-", "dequantize-tiles-", "dequantize-bf16-tiled", "kv-write-", "kv-attention-",
                 "kv-combine"])
    missing = [f for f in families if not any(r["case"].startswith(f) for r in results)]
    assert not missing, missing
    failed = {r["case"]: r["error"] for r in results if not r["ok"]}
    assert not failed, failed


def test_ptx_properties(compiled):
    _, results = compiled
    bad = {r["case"]: r["ptx_checks"] for r in results if not all(r["ptx_checks"].values())}
    assert not bad, bad
    if compiled[0] >= 100:
        assert all(r["ptx_checks"] for r in results)  # every case checked the block-scaled MMA
