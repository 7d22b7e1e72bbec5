"""kernels/cublaslt.py on the CPU: its planning, plan cache and library lookup, with libcublasLt
stood in for by tests/fake_cublaslt.py (which also runs the GEMM from the pointers and layouts
it is given). The GPU tests of the real library are in test_gemm.py."""

import io

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


def test_the_library_is_the_one_of_torchs_cuda(monkeypatch):
    """The libcublasLt torch loaded (its CUDA's major version), not the first one mapped: another
    library of the process (a JAX or CuPy of another CUDA) can map one first (/proc/self/maps is
    in address order)."""
    maps = ["7f0000000000-7f0000100000 r-xp 00000000 08:01 11 /opt/jax/nvidia/cublas/lib/libcublasLt.so.12\n",
            "7f1000000000-7f1000100000 r-xp 00000000 08:01 12 /env/nvidia/cu13/lib/libcublasLt.so.13\n",
            "7f2000000000-7f2000100000 rw-p 00000000 00:00 0 \n"]
    opened = []

    class Library:  # what the loader returns: entry points that take argtypes and restype
        def __getattr__(self, name):
            entry = lambda *args: 0  # noqa: E731
            setattr(self, name, entry)
            return entry

    def cdll(path):
        opened.append(path)
        return Library()

    monkeypatch.setattr(lt, "open", lambda path: io.StringIO("".join(maps)), raising=False)
    monkeypatch.setattr(lt.ctypes, "CDLL", cdll)
    monkeypatch.setattr(lt, "_lib", None)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    lt._library()
    assert opened == ["/env/nvidia/cu13/lib/libcublasLt.so.13"]
    monkeypatch.setattr(lt, "_lib", None)  # none of torch's mapped yet: the loader finds its soname
    maps[1:2] = []
    lt._library()
    assert opened[-1] == "libcublasLt.so.13"
