"""kernels/cublaslt.py on the CPU: its planning, plan cache and library lookup, with libcublasLt
stood in for by tests/fake_cublaslt.py (which also runs the GEMM from the pointers and layouts
it is given). The GPU tests of the real library are in test_gemm.py."""

import pytest
import torch

from fake_cublaslt import FakeLib, cuda, on_fake_cuda
from nvfp4_inductor.kernels import cublaslt as lt


def _operands(m=40, n=48, k=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    alpha = torch.rand((), generator=gen) + 0.5
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    return x, w, alpha, bias


@pytest.mark.parametrize("fail", ["cublasLtMatrixLayoutCreate", "cublasLtMatmulPreferenceSetAttribute",
                                  "cublasLtMatmulAlgoGetHeuristic"])
def test_a_failed_plan_destroys_its_descriptors(monkeypatch, fail):
    """A shape cuBLASLt cannot take is planned again at every call: each failed step must destroy
    the descriptor and layouts made before it (they leaked), and no algorithm (the heuristic's
    CUBLAS_STATUS_NOT_SUPPORTED, as cuBLAS 13 reports it) names the GEMM."""
    lib = FakeLib(fail=fail, status=15)  # CUBLAS_STATUS_NOT_SUPPORTED
    on_fake_cuda(monkeypatch, lib)
    x, w, alpha, bias = _operands()
    for _ in range(3):
        with pytest.raises(lt.CublasLtError) as error:
            lt.scaled_mm(cuda(x), cuda(w), cuda(alpha), cuda(bias), torch.bfloat16)
        assert lib.live() == 0
    assert not lt._plans
    if fail == "cublasLtMatmulAlgoGetHeuristic":
        assert "no algorithm for x (40, 64) @ w (48, 64)^T" in str(error.value)
    lib.fail = None  # the shape works now: one plan, kept
    got = lt.scaled_mm(cuda(x), cuda(w), cuda(alpha), cuda(bias), torch.bfloat16)
    want = (x.float() @ w.float().T * alpha + bias.float()).to(torch.bfloat16)
    assert torch.allclose(got.float(), want.float(), rtol=2**-7, atol=0)
    assert len(lt._plans) == 1 and lib.live() == 4
