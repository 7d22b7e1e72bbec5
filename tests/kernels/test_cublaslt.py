"""kernels/cublaslt.py on the CPU: its planning, plan cache and library lookup, with libcublasLt
stood in for by tests/helpers/fake_cublaslt.py (which also runs the GEMM from the pointers and
layouts it is given); and, marked gpu, scaled_mm on the real library."""

import io

import pytest
import torch

from helpers.fake_cublaslt import STREAM, FakeLib, cuda, on_fake_cuda
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


def _x_layouts(m, k, gen):
    """x (M, K) bf16 as scaled_mm may get it: contiguous, rows of a wider matrix (16-byte aligned,
    used in place), 2 bytes into its storage, column-major, one row broadcast (stride 0)."""
    wide = torch.randn(m, k + 40, generator=gen).to(torch.bfloat16)
    return {"contiguous": wide[:, :k].contiguous(), "rows of a wider x": wide[:, 8:8 + k],
            "2-byte offset": wide[:, 1:1 + k], "column-major": wide[:, :k].T.contiguous().T,
            "broadcast row": wide[:1, :k].expand(m, k)}


@pytest.mark.parametrize("m, n, k", [(1, 48, 64), (37, 100, 96)])
def test_scaled_mm_layouts_and_dtypes(monkeypatch, m, n, k):
    """The operands scaled_mm hands cuBLASLt (read back by the stand-in from the pointers and
    layouts: ld, transposes, bias, alpha and beta in device memory) give alpha * x @ w^T + bias
    for every x layout, per-tensor and per-row alpha, bias and output dtypes, on the current
    stream. (No defect found: this holds the review's reading.)"""
    lib = FakeLib()
    on_fake_cuda(monkeypatch, lib)
    gen = torch.Generator().manual_seed(m * n + k)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    for name, x in _x_layouts(m, k, gen).items():
        for per_row in (False, True):
            alpha = torch.rand(n if per_row else (), generator=gen) + 0.5
            for bias_dtype in (None, torch.bfloat16, torch.float32, torch.float16):
                bias = None if bias_dtype is None else torch.randn(n, generator=gen).to(bias_dtype)
                for out_dtype in (torch.bfloat16, torch.float16, torch.float32):
                    got = lt.scaled_mm(cuda(x), cuda(w), cuda(alpha), cuda(bias), out_dtype)
                    want = x.float() @ w.float().T * alpha
                    want = (want if bias is None else want + bias.float()).to(out_dtype)
                    assert got.dtype == out_dtype and got.shape == (m, n) and got.is_contiguous()
                    # one rounding each (the stand-in's sums are in another order: fp32 ulps)
                    tol = {torch.float32: 2e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}[out_dtype]
                    assert torch.allclose(got.float(), want.float(), rtol=tol, atol=1e-5), (
                        name, per_row, bias_dtype, out_dtype)
    assert lib.matmuls and all(stream == STREAM for *_, stream in lib.matmuls)


def _at_alignment(numel: int, align: int) -> torch.Tensor:
    """numel bf16 elements whose address is a multiple of align bytes and of no larger power of 2."""
    buf = torch.empty(numel + 512, dtype=torch.bfloat16)
    start = (-buf.data_ptr() % 512 + align) // 2
    return buf[start:start + numel]


def test_a_plan_serves_only_calls_of_its_key(monkeypatch):
    """Calls that differ from a planned one only in x's row stride, its alignment, the bias or the
    output dtype get plans of their own (a stale plan reads x's rows with the wrong stride, or
    runs an algorithm for more alignment than x has: the stand-in refuses it)."""
    lib = FakeLib()
    on_fake_cuda(monkeypatch, lib)
    m, n, k = 40, 48, 64
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    alpha, bias = torch.tensor(1.5), torch.randn(n, generator=gen).to(torch.bfloat16)
    values = torch.randn(m * (k + 8), generator=gen).to(torch.bfloat16)
    calls = []
    for align, ld in ((256, k), (256, k + 8), (16, k), (16, k + 8)):
        x = _at_alignment(m * (k + 8), align).copy_(values).as_strided((m, k), (ld, 1))
        calls += [(x, None, torch.bfloat16), (x, bias, torch.bfloat16), (x, None, torch.float32)]
    for x, b, out_dtype in calls:
        assert lt._alignment(x) == (256 if x.data_ptr() % 256 == 0 else 16)
        got = lt.scaled_mm(cuda(x), cuda(w), cuda(alpha), cuda(b), out_dtype)
        want = x.float() @ w.float().T * alpha
        want = (want if b is None else want + b.float()).to(out_dtype)
        assert torch.allclose(got.float(), want.float(), rtol=2**-7, atol=1e-5), (
            x.stride(), b is None, out_dtype)
    assert lib.misaligned == 0


def test_a_misaligned_weight_is_copied_like_x(monkeypatch):
    """w is aligned to 16 bytes or copied, as x is: a contiguous w starting 2 bytes into its
    storage was handed to cuBLASLt as it was (an algorithm for 2-byte alignment; with the bias
    epilogue such an x gave many outputs off the single rounding)."""
    lib = FakeLib()
    on_fake_cuda(monkeypatch, lib)
    x, w, alpha, bias = _operands()
    w_offset = _at_alignment(w.numel(), 2).view(w.shape).copy_(w)
    assert lt._alignment(w_offset) == 2
    got = lt.scaled_mm(cuda(x), cuda(w_offset), cuda(alpha), cuda(bias), torch.bfloat16)
    (_, attrs, _), = lib.matmuls
    assert attrs["min_alignments"][0] >= 16  # A = w
    want = (x.float() @ w.float().T * alpha + bias.float()).to(torch.bfloat16)
    assert torch.allclose(got.float(), want.float(), rtol=2**-7, atol=1e-5)


# --- GPU: the real libcublasLt -------------------------------------------------------------------

def _rel(got, want):
    got, want = got.double().cpu(), want.double().cpu()
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", [(17, 48, 64), (257, 1056, 1040), (33, 64, 8192)])  # (split K)
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("bias_dtype", [None, torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cublaslt_scaled_mm_rounds_once(m, n, k, per_row, bias_dtype, out_dtype):
    """alpha * (x @ w^T) + bias in fp32, rounded once: against the fp32 product on the same GPU
    (cuBLAS; the order of the sums may differ) with alpha and bias applied by torch. x is a row
    slice (leading stride > K): 32 bytes into its storage (used in place), or 2 bytes (copied to
    an aligned buffer: with the bias epilogue cuBLAS 13.0 failed on it)."""
    from nvfp4_inductor.kernels.cublaslt import scaled_mm

    gen = torch.Generator(device="cuda").manual_seed(m * n + k)
    start = 1 if m == 17 else 16
    x = torch.randn(m, k + 32, generator=gen, device="cuda", dtype=torch.bfloat16)[:, start:start + k]
    w = torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16)
    alpha = torch.rand(n if per_row else (), generator=gen, device="cuda") + 0.5
    bias = None if bias_dtype is None else torch.randn(n, generator=gen, device="cuda").to(bias_dtype)
    got = scaled_mm(x, w, alpha, bias, out_dtype)
    want = torch.mm(x, w.T, out_dtype=torch.float32) * alpha
    if bias is not None:
        want = want + bias.float()
    assert got.dtype == out_dtype and got.shape == (m, n)
    # fp32: only the sums' order differs; bf16 / fp16: that, then at most one ulp where it
    # crosses a rounding boundary
    assert _rel(got, want) <= (1e-5 if out_dtype == torch.float32 else 2e-3)
    mismatched = (got.float() != want.to(out_dtype).float()).float().mean().item()
    assert out_dtype == torch.float32 or mismatched < 0.02


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", [(65, 1004, 1040), (40, 1, 64), (33, 13, 128)])
def test_cublaslt_scaled_mm_odd_widths_stale_output_memory(m, n, k):
    """Output rows not on 16-byte boundaries (N not a multiple of 8, N = 1: nv.linear takes any N),
    with the bias epilogue, into memory that held NaN (beta is a device zero, so cuBLAS must not
    read the output it is given): alpha * (x @ w^T) + bias, rounded once."""
    from nvfp4_inductor.kernels.cublaslt import scaled_mm

    gen = torch.Generator(device="cuda").manual_seed(m + n + k)
    x = torch.randn(m, k, generator=gen, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16)
    alpha = torch.rand((), generator=gen, device="cuda") + 0.5
    bias = torch.randn(n, generator=gen, device="cuda").to(torch.bfloat16)
    want = torch.mm(x, w.T, out_dtype=torch.float32) * alpha + bias.float()
    for out_dtype in (torch.bfloat16, torch.float32):
        stale = torch.full((m, n), float("nan"), device="cuda", dtype=out_dtype)
        del stale  # its block goes back to the caching allocator, for the output to take
        got = scaled_mm(x, w, alpha, bias, out_dtype)
        assert not got.isnan().any() and got.shape == (m, n) and got.is_contiguous()
        assert _rel(got, want) <= (1e-5 if out_dtype == torch.float32 else 2e-3)
        # rounded once: at most one ulp off where the sums' order crosses a rounding boundary
        mismatched = (got.float() != want.to(out_dtype).float()).float().mean().item()
        assert out_dtype == torch.float32 or mismatched < 0.02


@pytest.mark.gpu
def test_cublaslt_first_call_inside_a_cuda_graph_capture(monkeypatch):
    """No call before the capture: the handle and the plan are made while capturing."""
    from nvfp4_inductor.kernels import cublaslt

    monkeypatch.setattr(cublaslt, "_handles", {})
    monkeypatch.setattr(cublaslt, "_plans", type(cublaslt._plans)())
    gen = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(96, 256, generator=gen, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(80, 256, generator=gen, device="cuda", dtype=torch.bfloat16)
    alpha = torch.rand((), generator=gen, device="cuda") + 0.5
    bias = torch.randn(80, generator=gen, device="cuda").to(torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cublaslt.scaled_mm(x, w, alpha, bias, torch.bfloat16)
    x.copy_(torch.randn(96, 256, generator=gen, device="cuda", dtype=torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    want = torch.mm(x, w.T, out_dtype=torch.float32) * alpha + bias.float()
    assert _rel(out, want) <= 2e-3


@pytest.mark.gpu
def test_cublaslt_scaled_mm_layouts_and_bad_arguments():
    from nvfp4_inductor.kernels.cublaslt import scaled_mm

    x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(48, 64, device="cuda", dtype=torch.bfloat16)
    g = torch.ones((), device="cuda")
    want = scaled_mm(x, w, g, None, torch.float32)
    # column-major x, rows broadcast (stride 0), a column-major weight: copied, same result
    assert torch.equal(scaled_mm(x.T.contiguous().T, w.T.contiguous().T, g, None, torch.float32), want)
    row = x[:1].expand(32, 64)
    assert torch.equal(scaled_mm(row, w, g, None, torch.float32), want[:1].expand(32, 48))
    with pytest.raises(ValueError, match="bf16 on one CUDA device"):
        scaled_mm(x.half(), w, g, None, torch.bfloat16)
    with pytest.raises(ValueError, match="bf16 on one CUDA device"):
        scaled_mm(x, w.cpu(), g, None, torch.bfloat16)
    with pytest.raises(ValueError, match="alpha must be fp32"):
        scaled_mm(x, w, g.cpu(), None, torch.bfloat16)
    with pytest.raises(ValueError, match="alpha must be fp32"):
        scaled_mm(x, w, torch.ones(32, device="cuda"), None, torch.bfloat16)
    with pytest.raises(ValueError, match="bias must be"):
        scaled_mm(x, w, g, torch.ones(32, device="cuda"), torch.bfloat16)
