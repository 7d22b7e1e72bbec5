"""kernels/hopper_gemm.py, the Hopper W4A16 GEMM (Gluon). Without a GPU: every shipped config
compiles for sm_90 and keeps one wgmma group in flight through the K loop (PTX `wgmma.wait_group 1`
in the loop, SASS `WARPGROUP.DEPBAR.LE gsb0, 0x1`, no ptxas serialization warning). On a GPU: the
kernel against the reference linear on fresh random inputs and odd shapes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import nvfp4_inductor as nv
from nvfp4_inductor import reference

pytest.importorskip("triton.experimental.gluon")

SCRIPT = Path(__file__).parents[1] / "helpers" / "compile_hopper.py"


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPT.parents[2]), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads(line) for line in run.stdout.splitlines()]


def test_every_config_compiles_for_sm90(compiled):
    from nvfp4_inductor.kernels import gemm_configs

    assert len(compiled) == 2 * len({config for _, config in gemm_configs.HOPPER_CONFIGS})
    failed = {r["case"]: r["error"] for r in compiled if not r["ok"]}
    assert not failed, failed


def test_wgmma_stays_in_flight_through_the_k_loop(compiled):
    for r in compiled:
        assert r["mma"] and all(".bf16.bf16" in mma for mma in r["mma"]), r
        assert r["loop_wait_counts"] == [1], r  # the loop never drains the wgmma groups
        assert not r["ptxas_serialized"], r  # ptxas did not serialize the wgmmas (C7515)
        assert 1 in r["sass_depbar_counts"], r
        assert r["spills"] == ["0"], r


def _rel(got, want):
    got, want = got.double().cpu(), want.double().cpu()
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("m", [17, 33, 128, 200, 512, 1000])
@pytest.mark.parametrize("n, k", [(200, 320), (1024, 512), (96, 1040)])
def test_against_the_reference_linear(m, n, k):
    """Fresh random x over a wide range, per-tensor and per-row global scales, weights with blocks
    spanning the e4m3 range (subnormal scales included), bias; M, N, K not multiples of the tiles."""
    from nvfp4_inductor.kernels.hopper_gemm import hopper_linear
    from nvfp4_inductor.reference import hopper

    gen = torch.Generator().manual_seed(m * 131 + n * 7 + k)
    x = (torch.randn(m, k, generator=gen) * 10).to(torch.bfloat16)
    w = torch.randn(n, k, generator=gen) * torch.logspace(-3, 2, n)[:, None]
    per_row = m % 2 == 1
    data, scale, g = reference.quantize(w, per_row=per_row)
    bias = torch.randn(n, generator=gen)
    codes, scales = hopper.pack(data, scale)
    want = x.double() @ reference.dequantize(data, scale, g).double().T + bias.double()
    args = [t.cuda() for t in (x, codes, scales, g, bias)]
    y = hopper_linear(*args, out_dtype=torch.float32, n=n)
    assert y.shape == (m, n)
    assert _rel(y, want) <= 2e-3
    y16 = hopper_linear(*args, out_dtype=torch.bfloat16, n=n)
    assert _rel(y16, want) <= 1e-2


@pytest.mark.gpu
def test_every_shipped_config_and_special_blocks():
    """Each config of the table on one shape, with a NaN block (poisons its row's outputs only)
    and an all-zero row."""
    from nvfp4_inductor.kernels import gemm_configs
    from nvfp4_inductor.kernels.hopper_gemm import hopper_linear
    from nvfp4_inductor.reference import hopper

    gen = torch.Generator().manual_seed(11)
    m, n, k = 300, 192, 768
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    q = nv.quantize(torch.randn(n, k, generator=gen))
    data, scale = q.data.clone(), q.scale.clone()
    scale.view(torch.uint8)[5, 3] = 0x7F
    data[7], scale.view(torch.uint8)[7] = 0, 0
    codes, scales = hopper.pack(data, scale)
    want = x.double() @ reference.dequantize(data, scale, q.global_scale).double().T
    for _, config in gemm_configs.HOPPER_CONFIGS:
        y = hopper_linear(x.cuda(), codes.cuda(), scales.cuda(), q.global_scale.cuda(), None,
                          torch.float32, config, n=n).cpu()
        assert torch.isnan(y[:, 5]).all() and not torch.isnan(y[:, torch.arange(n) != 5]).any(), config
        assert not y[:, 7].any(), config
        keep = torch.arange(n) != 5
        assert _rel(y[:, keep], want[:, keep]) <= 2e-3, config
