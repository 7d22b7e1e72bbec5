"""`python -m nvfp4_inductor check` (nvfp4_inductor/selfcheck.py): on the CPU through the Triton
interpreter (set by conftest before any kernel is defined) it passes and prints every check and
the GEMM plan; a kernel that is wrong or raises makes it fail; the entry point parses its options;
on a GPU (marked gpu) the full check passes."""

import os
import subprocess
import sys
from unittest import mock

import pytest
import torch

from nvfp4_inductor import __main__, selfcheck
from nvfp4_inductor.kernels import dequantize as dequantize_kernels
from nvfp4_inductor.kernels import quantize as quantize_kernels

on_cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the gpu test runs the check on CUDA")


def _check(capsys, *options) -> tuple[int, str]:
    status = __main__.main(["check", "--device", "cpu", "--seed", "5", *options])
    return status, capsys.readouterr().out


@on_cpu_only
def test_quick_check_passes_and_prints_each_check_and_the_plan(capsys):
    assert os.environ.get("TRITON_INTERPRET") == "1"
    status, out = _check(capsys, "--quick", "--shape", "4096", "1024")
    assert status == 0, out
    assert "FAIL" not in out and "SKIP" not in out
    for check in selfcheck.CHECKS:
        assert f"PASS {check.name}: " in out, check.name
    assert "seed 5 (rerun with --seed 5)" in out and "Triton interpreter" in out
    lines = out.splitlines()
    table = lines.index(next(line for line in lines if line.startswith("GEMM path by M")))
    assert "N=4096 K=1024" in lines[table]
    rows = [line.split() for line in lines[table + 2:table + 2 + len(selfcheck.PLAN_MS)]]
    assert [int(row[0]) for row in rows] == list(selfcheck.PLAN_MS)
    assert rows[0][1] == "splitk/dot" and rows[-1][1] == "dequant_cublas"  # (the plan on the CPU)
    assert "Times: CUDA only, skipped" in out
    assert f"{len(selfcheck.CHECKS)} checks passed, 0 failed" in out


@on_cpu_only
def test_a_wrong_or_crashing_kernel_fails_the_check(capsys):
    """One code bit flipped by the quantize kernel fails each quantize check; a kernel that raises
    is a FAIL with its error, and the checks after it still run."""
    real_quantize = quantize_kernels.quantize

    def flipped(*args, **kwargs):
        data, scale, g = real_quantize(*args, **kwargs)
        data = data.clone()
        data.view(-1)[-1] ^= 1
        return data, scale, g

    def raises(*args, **kwargs):
        raise RuntimeError("no kernel image is available")

    with mock.patch.object(quantize_kernels, "quantize", flipped), \
            mock.patch.object(dequantize_kernels, "dequantize", raises):
        status, out = _check(capsys, "--quick", "--only", "quantize", "dequantize")
    assert status == 1, out
    for name in ("per-tensor", "per-row", "swizzled"):
        assert f"FAIL quantize {name}: Mismatch: codes of (1, 16) torch.bfloat16: 1 of 8 elements differ" in out
    assert "FAIL dequantize: RuntimeError: no kernel image is available" in out
    assert "FAIL dequantize_rows: RuntimeError: no kernel image is available" in out
    assert "PASS scale search mse" not in out  # (not named by --only)
    assert "0 checks passed, 5 failed" in out


@on_cpu_only
def test_without_the_interpreter_the_kernels_are_skipped_not_failed(capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    status, out = _check(capsys, "--only", "quantize per-tensor", "linear W4A16")
    assert status == 0, out
    assert "NOTE the Triton kernels were not exercised" in out
    assert "SKIP quantize per-tensor: " in out and "SKIP linear W4A16: " in out
    assert "0 checks passed, 0 failed" in out


def test_nvfp4_calls_reads_code_not_comments():
    code = ("# torch.ops.nvfp4.linear_tiled.default(arg0_1)\n"
            "buf0 = torch.ops.nvfp4.quantize_values.default(arg0_1)\n"
            "from nvfp4_inductor.kernels.device.epilogue import last_split\n"
            "extern_kernels.nvfp4_scaled_mm_tiled(buf0)\n")
    assert selfcheck.nvfp4_calls(code) == ["quantize_values", "template", "nvfp4_scaled_mm_tiled"]
    assert selfcheck.nvfp4_calls("# torch.ops.nvfp4.linear_tiled.default(x)\nbuf = mm(x, w)") == []


def test_entry_point_parses_the_check_options():
    run = subprocess.run([sys.executable, "-m", "nvfp4_inductor", "check", "--help"], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    for option in ("--device", "--seed", "--quick", "--shape", "--only"):
        assert option in run.stdout


@pytest.mark.gpu
def test_full_check_passes_on_cuda():
    run = subprocess.run([sys.executable, "-m", "nvfp4_inductor", "check"], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "FAIL" not in run.stdout and "SKIP" not in run.stdout
    assert f"{len(selfcheck.CHECKS)} checks passed, 0 failed" in run.stdout
    assert "GEMM path by M" in run.stdout and "W4A16 x" in run.stdout  # the plan, the times
