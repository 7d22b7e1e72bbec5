"""The Inductor lowering of nvfp4.linear_tiled: the NVFP4 GEMM template with the linear's epilogue
(global scale, bias, activation, residual add, cast) fused by Inductor.

On the CPU, Inductor's Triton CPU backend generates the same template and kernels, run by the
Triton interpreter (plain-op decode instead of the inline PTX): the generated code and the
numerics are checked there in CI; the same checks run on the GPU (marked gpu)."""

import re

import pytest
import torch
import torch.utils._triton
from torch import nn
from torch._inductor.utils import run_and_get_code

import nvfp4_inductor as nv
from nvfp4_inductor import capability
from nvfp4_inductor.lowerings.passes import norms as norm_fusion
from nvfp4_inductor.kernels import gemm_configs, plan
from nvfp4_inductor.kernels.device.mainloops import MAINLOOPS
from nvfp4_inductor.lowerings import linear as linear_lowering

import decode  # examples/decode.py (its RMSNorm)
from helpers import streams as streams_helper
from helpers.gemm import TEMPLATE_MARK


class LinearBlock(nn.Module):
    """act(x @ W^T + b) + residual."""

    def __init__(self, k, n, act):
        super().__init__()
        self.linear = nn.Linear(k, n)
        self.act = act

    def forward(self, x, residual):
        return self.act(self.linear(x)) + residual


@pytest.fixture
def triton_inductor(monkeypatch, kernel_device):
    """Inductor emitting Triton for kernel_device: the GPU, or the CPU (Triton CPU backend, kernels
    run by the interpreter; the backend hash Inductor asks for needs a driver, so it is fixed)."""
    torch._dynamo.reset()
    patches = {}
    if kernel_device == "cpu":
        monkeypatch.setattr(torch.utils._triton, "triton_hash_with_backend", lambda: "interpreter")
        patches.update({"cpu_backend": "triton", "compile_threads": 1})
    with torch._inductor.config.patch(patches):
        yield kernel_device
    torch._dynamo.reset()


@pytest.fixture
def template_inductor(triton_inductor, monkeypatch):
    """triton_inductor with the template as the pick wherever it applies (on the GPU the default
    pick takes dequantize + cuBLAS for shapes this small above M = 64, and on sm_90 the Hopper GEMM
    from 128 rows): these tests check the template's code and numerics; the pick itself is tested
    below."""
    monkeypatch.setattr(plan, "template_is_default", lambda *args, **kwargs: True)
    monkeypatch.setattr(gemm_configs, "HOPPER_GEMM_M", (1, 0))  # (sm_90: not the Hopper GEMM)
    return triton_inductor


_COUNTERS = re.compile(r"(buf\d+) = empty_strided_\w+\(\((\d+), \), \(1, \), torch\.int32\)")


def _counter_fills(code: str) -> list[str]:
    """The launches that zero a graph's split-K tile counters (lowerings/linear.py: an int32 buffer
    the graph's call allocates, fills and hands to each of its split-K templates)."""
    return [line.strip() for name, size in _COUNTERS.findall(code) for line in code.splitlines()
            if f".run({name}, {size}, stream=" in line]


def _launches(code: str) -> list[str]:
    """The kernels and extern calls of the generated code, but the counters' fills."""
    fills = _counter_fills(code)
    return [line.strip() for line in code.splitlines() if (".run(" in line or "extern_kernels." in line
            and "import" not in line) and line.strip() not in fills]


def _linear_eager(linear, h, activations, norm=()):
    """An nn.Linear on h as the eager nvfp4 ops (the same quantized, tiled weights); norm: a
    deferred RMSNorm's (norm_h, norm_eps)."""
    w = linear.weight.detach()
    data, scale, g = torch.ops.nvfp4.quantize(w, None, False, False)
    data, scale = torch.ops.nvfp4.tile_weight(data, scale)
    bias = None if linear.bias is None else linear.bias.detach()
    with torch.no_grad():
        return torch.ops.nvfp4.linear_tiled(h, data, scale, g, bias, w.shape[0], activations, *norm)


def _rel_err(y, expected) -> float:
    return ((y.float() - expected.float()).norm() / expected.float().norm()).item()


def _eager(model, x, residual):
    """The same model with the linear as the eager nvfp4 ops (same quantized, tiled weights)."""
    return model.act(_linear_eager(model.linear, x, "bf16")) + residual


def _run(device, m, k, n, act=torch.relu, lead=()):
    torch.manual_seed(m * 7 + k + n)
    model = LinearBlock(k, n, act).to(device=device, dtype=torch.bfloat16).eval()
    x = torch.randn(*lead, m, k, device=device, dtype=torch.bfloat16)
    residual = torch.randn(*lead, m, n, device=device, dtype=torch.bfloat16)
    y, code = run_and_get_code(nv.compile(model, nv.Config(activations="bf16")), x, residual)
    with torch.no_grad():
        expected = _eager(model, x, residual)
    # One bf16 rounding apart at most (the eager op and the template round products differently).
    torch.testing.assert_close(y, expected, rtol=2**-7, atol=2**-6)
    return "\n".join(code)


@pytest.mark.parametrize("m", [1, 5, 16])
def test_decode_rows_run_one_kernel(template_inductor, m):
    """Split K: the last split of each tile sums the partials, then the scale, bias, ReLU and
    residual add fused in. The partials go to an uninitialized workspace (no memset) and the tile
    counters to the graph's own buffer, zeroed by one fill a call. (K = 1024: on CUDA the
    register-fed mainloop splits only ranges of at least 4 K-steps, 8 above M = 8.)"""
    code = _run(template_inductor, m, 1024, 192)
    assert TEMPLATE_MARK in code
    launches = _launches(code)
    assert len(launches) == 1 and "triton_tem_fused" in launches[0], launches
    assert len(_counter_fills(code)) == 1
    assert "workspace_" in code and ".zero_()" not in code and "fill_" not in code
    assert "torch.ops.nvfp4.linear_tiled.default(" not in code  # (the FX graph comments name it)


class TwoLinears(nn.Module):
    """Two linears reading one x (kept apart: merge_linears=False), the second the wider."""

    def __init__(self, k, n_a, n_b):
        super().__init__()
        self.a, self.b = nn.Linear(k, n_a), nn.Linear(k, n_b)

    def forward(self, x):
        return self.a(x), self.b(x)


def test_split_k_templates_of_a_graph_share_counters_it_allocates(template_inductor):
    """The tile counters are the graph's own: an int32 buffer allocated and zeroed (one fill) in
    each call, not a constant shared with other graphs (two graphs, or one called from two
    threads, on two streams at once would mix their counts), and passed to both split-K templates,
    sized for the wider one (1024 / 64 = 16 tiles) though the narrower (3 tiles) comes first."""
    torch.manual_seed(2)
    model = TwoLinears(1024, 192, 1024).to(device=template_inductor, dtype=torch.bfloat16).eval()
    x = torch.randn(4, 1024, device=template_inductor, dtype=torch.bfloat16)
    compiled = nv.compile(model, nv.Config(activations="bf16", merge_linears=False))
    (ya, yb), code = run_and_get_code(compiled, x)
    code = "\n".join(code)
    call = code[code.index("def call("):]
    (name, size), = _COUNTERS.findall(call)  # allocated in the call, once
    assert int(size) == 16 and len(_COUNTERS.findall(code)) == 1
    assert len(_counter_fills(call)) == 1
    templates = [line for line in _launches(call) if "triton_tem_fused" in line]
    assert len(templates) == 2 and all("workspace_" in line for line in templates), templates
    assert all(re.search(rf"\b{name}\b", line) for line in templates), templates
    assert not hasattr(linear_lowering, "_counters")
    with torch.no_grad():
        for y, linear in ((ya, model.a), (yb, model.b)):
            torch.testing.assert_close(y, _linear_eager(linear, x, "bf16"), rtol=2**-7, atol=2**-6)
    again = compiled(x)
    assert torch.equal(again[0], ya) and torch.equal(again[1], yb)


def test_wide_rows_fuse_the_whole_epilogue_into_the_template(template_inductor):
    m = plan.SPLITK_MAX_M_TILED + 36
    code = _run(template_inductor, m, 128, 192)
    launches = _launches(code)
    assert len(launches) == 1 and "triton_tem_fused" in launches[0], launches
    assert TEMPLATE_MARK in code


@pytest.mark.parametrize("m, k, n, lead", [(3, 48, 80, ()), (5, 208, 48, (2,)), (70, 80, 144, ())])
def test_odd_shapes(template_inductor, m, k, n, lead):
    """K and N not multiples of the 64x64 tiles, several rows per program, 3-D inputs."""
    assert TEMPLATE_MARK in _run(template_inductor, m, k, n, lead=lead)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("m", [1, 5])
def test_fp16_and_fp32_models_multiply_x_rounded_to_bf16(template_inductor, dtype, m):
    """W4A16 in an fp16 / fp32 model: the template multiplies x rounded to bf16, as the eager op
    (on the GPU the register-fed mainloop read an fp16 x's words as bf16 pairs: inf outputs)."""
    torch.manual_seed(m)
    model = LinearBlock(128, 192, torch.relu).to(device=template_inductor, dtype=dtype).eval()
    x = torch.randn(m, 128, device=template_inductor, dtype=dtype) * 3
    residual = torch.randn(m, 192, device=template_inductor, dtype=dtype)
    y, code = run_and_get_code(nv.compile(model, nv.Config(activations="bf16")), x, residual)
    source = "\n".join(code)
    assert TEMPLATE_MARK in source
    # the template's x is a bf16 buffer the graph fills from x (the numbers below cannot tell:
    # under the interpreter an fp16 operand multiplies as accurately)
    template_x = re.search(r"triton_tem_\w*\.run\((\w+),", source).group(1)
    assert re.search(rf"{template_x} = empty_strided_\w+\([^\n]*torch\.bfloat16\)", source), source
    with torch.no_grad():
        want = _eager(model, x, residual)
    assert y.dtype == dtype and torch.isfinite(y).all() and _rel_err(y, want) < 2**-7


@pytest.mark.parametrize("scale", [1e5, 1e-9])
@pytest.mark.parametrize("m", [1, 5])
def test_template_keeps_x_in_bf16_range(template_inductor, scale, m):
    """x far outside fp16's range (above 65504, below 2^-24) multiplies as the eager op: the
    interpreter's path had narrowed x to fp16 operands (inf, NaN or zero outputs)."""
    torch.manual_seed(m)
    model = LinearBlock(128, 192, torch.relu).to(device=template_inductor, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        model.linear.bias.mul_(scale)  # every term of the output at x's scale
    x = (torch.randn(m, 128, device=template_inductor) * scale).to(torch.bfloat16)
    residual = (torch.randn(m, 192, device=template_inductor) * scale).to(torch.bfloat16)
    y, code = run_and_get_code(nv.compile(model, nv.Config(activations="bf16")), x, residual)
    assert TEMPLATE_MARK in "\n".join(code)
    with torch.no_grad():
        want = _eager(model, x, residual)
    assert torch.isfinite(y).all() and _rel_err(y, want) < 2**-7


def test_empty_input(template_inductor):
    """No template for zero rows (no empty grid); Inductor then drops the empty computation."""
    model = LinearBlock(64, 32, torch.relu).to(device=template_inductor, dtype=torch.bfloat16).eval()
    x = torch.randn(0, 64, device=template_inductor, dtype=torch.bfloat16)
    y, code = run_and_get_code(nv.compile(model, nv.Config(activations="bf16")), x, x[:, :32])
    assert y.shape == (0, 32) and TEMPLATE_MARK not in "\n".join(code)


@pytest.mark.parametrize("m", [2, plan.SPLITK_MAX_M_TILED + 6])
def test_nvfp4_activations_feed_the_template_as_values(template_inductor, m):
    """W4A4 (without FP4 tensor cores): one nvfp4.quantize_values kernel (x's quantized values,
    e2m1 * block scale in bf16), then the W4A16 template, the epilogue fused as for W4A16."""
    torch.manual_seed(m)
    model = LinearBlock(128, 192, torch.relu).to(device=template_inductor, dtype=torch.bfloat16).eval()
    x = torch.randn(m, 128, device=template_inductor, dtype=torch.bfloat16)
    residual = torch.randn(m, 192, device=template_inductor, dtype=torch.bfloat16)
    y, code = run_and_get_code(nv.compile(model, nv.Config(activations="nvfp4")), x, residual)
    source = "\n".join(code)
    assert TEMPLATE_MARK in source and "torch.ops.nvfp4.quantize_values.default(" in source
    assert "torch.ops.nvfp4.quantize.default(" not in source
    assert "torch.ops.nvfp4.linear_tiled.default(" not in source
    assert "torch.ops.nvfp4.dequantize" not in source
    expected = torch.relu(_linear_eager(model.linear, x, "nvfp4")) + residual
    # the same quantized x on both sides (x is the graph input): products agree to fp32 rounding
    torch.testing.assert_close(y, expected, rtol=2**-7, atol=2**-6)


class WeightAfterCastRMSNorm(nn.Module):
    """The Hugging Face Llama form: the weight multiplies in bf16, after the cast."""

    def __init__(self, k, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(k))

    def forward(self, h):
        hf = h.float()
        hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * hf.to(h.dtype)


NORMS = {
    "example": lambda k: decode.RMSNorm(k, 1e-5),  # weight.float() before the cast
    "nn": lambda k: nn.RMSNorm(k, eps=1e-6),  # the bf16 weight promoted to fp32
    "nn_no_weight": lambda k: nn.RMSNorm(k, eps=1e-6, elementwise_affine=False),
    "after_cast": lambda k: WeightAfterCastRMSNorm(k, 1e-5),
}


class NormLinear(nn.Module):
    """linear(norm(x)); with also_return, the norm's output is a graph output too."""

    def __init__(self, norm, k, n, also_return=False):
        super().__init__()
        self.norm, self.linear, self.also_return = NORMS[norm](k), nn.Linear(k, n), also_return
        if getattr(self.norm, "weight", None) is not None:
            self.norm.weight.data = torch.rand(k) + 0.5

    def forward(self, x):
        h = self.norm(x)
        return (self.linear(h), h) if self.also_return else self.linear(h)


def _norm_linear(device, norm, m, k=256, n=192, also_return=False, dtype=torch.bfloat16):
    torch.manual_seed(m + k)
    model = NormLinear(norm, k, n, also_return).to(device=device, dtype=dtype).eval()
    x = torch.randn(m, k, device=device, dtype=dtype) * 3
    y, code = run_and_get_code(nv.compile(model, nv.Config(activations="nvfp4")), x)
    with torch.no_grad():
        expected = _linear_eager(model.linear, model.norm(x), "nvfp4")
    y = y[0] if also_return else y
    assert y.dtype == dtype
    # the compiled norm may round an element of h otherwise (the mean's order), and its
    # quantization with it: close in norm, not elementwise
    err = _rel_err(y, expected)
    assert err < 2**-7, err
    return "\n".join(code)


@pytest.mark.parametrize("norm", list(NORMS))
@pytest.mark.parametrize("m", [1, norm_fusion.MAX_ROWS])
def test_rms_norm_and_w4a4_linear_run_in_two_kernels(template_inductor, norm, m):
    """RMSNorm -> W4A4 linear at decode: one kernel normalizes and quantizes x
    (nvfp4.rms_norm_quantize_values), the template multiplies the values: two kernels (the norm,
    the quantize and the GEMM were three)."""
    code = _norm_linear(template_inductor, norm, m)
    assert "torch.ops.nvfp4.rms_norm_quantize_values.default(" in code
    assert "torch.ops.nvfp4.quantize_values.default(" not in code
    fills = _counter_fills(code)
    kernels = [line for line in code.splitlines() if ".run(" in line and line.strip() not in fills
               or "torch.ops.nvfp4.rms_norm_quantize_values.default(" in line and "=" in line]
    assert len(kernels) == 2 and "triton_tem_fused" in kernels[1], kernels


class NormQKV(nn.Module):
    """Three linears reading one RMSNorm's output (q / k / v)."""

    def __init__(self, k, n):
        super().__init__()
        self.norm = decode.RMSNorm(k, 1e-5)
        self.norm.weight.data = torch.rand(k) + 0.5
        self.q, self.k, self.v = (nn.Linear(k, n, bias=False) for _ in range(3))

    def forward(self, x):
        h = self.norm(x)
        return self.q(h), self.k(h), self.v(h)


@pytest.mark.parametrize("merge", [True, False])
def test_one_fused_norm_feeds_several_linears(template_inductor, merge):
    """q / k / v on one norm, merged into one GEMM or not: the norm quantizes x once for all."""
    torch.manual_seed(7)
    model = NormQKV(256, 64).to(device=template_inductor, dtype=torch.bfloat16).eval()
    x = torch.randn(1, 256, device=template_inductor, dtype=torch.bfloat16) * 3
    ys, code = run_and_get_code(nv.compile(model, nv.Config(activations="nvfp4", merge_linears=merge)), x)
    source = "\n".join(code)
    calls = [line for line in source.splitlines()
             if "torch.ops.nvfp4.rms_norm_quantize_values.default(" in line and "=" in line]
    assert len(calls) == 1 and "torch.ops.nvfp4.quantize_values.default(" not in source, calls
    with torch.no_grad():
        h = model.norm(x)
        for y, linear in zip(ys, (model.q, model.k, model.v)):
            expected = _linear_eager(linear, h, "nvfp4")
            err = _rel_err(y, expected)
            assert err < 2**-7, err


@pytest.mark.parametrize("m, also_return, dtype", [(norm_fusion.MAX_ROWS + 1, False, torch.bfloat16),
                                                   (1, True, torch.bfloat16), (1, False, torch.float16)])
def test_rms_norm_stays_where_it_cannot_fuse(kernel_device, m, also_return, dtype):
    """More rows than the fused kernel wins at, the norm's output used by more than W4A4 linears, or
    an fp16 model (the linear would multiply bf16 values and return bf16): the norm stays
    Inductor's, then W4A4's own quantize (on the CPU Inductor's C++ backend: the interpreter lacks
    the rsqrt of Inductor's norm kernel; the linear stays the eager op there)."""
    torch._dynamo.reset()
    code = _norm_linear(kernel_device, "example", m, also_return=also_return, dtype=dtype)
    assert "rms_norm_quantize_values" not in code
    if kernel_device == "cuda":
        assert "torch.ops.nvfp4.quantize_values.default(" in code
    torch._dynamo.reset()


class NormViewLinear(nn.Module):
    """A norm of rows of 32 whose output a view regroups into rows of 64 before the linear."""

    def __init__(self, width=32):
        super().__init__()
        self.norm, self.linear = nn.RMSNorm(width), nn.Linear(2 * width, 64, bias=False)

    def forward(self, h):
        return self.linear(self.norm(h).reshape(-1, self.linear.in_features))


def _defer_anywhere(monkeypatch):
    """The W4A16 norm deferral runs where the template does; on the CPU the test lets it run
    (Inductor's C++ backend then calls the eager op, with its own deferred norm): the pass is
    what is tested."""
    monkeypatch.setattr(norm_fusion, "template_device", lambda device: True)


@pytest.mark.parametrize("activations, width", [("bf16", 32), ("nvfp4", 32), ("nvfp4", 24)])
def test_norm_output_regrouped_by_a_view_is_not_fused(kernel_device, monkeypatch, activations, width):
    """The W4A16 deferred norm and the W4A4 fused norm take x's rows as h's: a view that changes
    the last dim (rows of 32 -> 64; a norm of 24 whose rows are not a multiple of 16 at all) keeps
    Inductor's norm (compiling failed on both)."""
    _defer_anywhere(monkeypatch)
    torch._dynamo.reset()
    torch.manual_seed(width)
    model = NormViewLinear(width).to(device=kernel_device, dtype=torch.bfloat16).eval()
    h = torch.randn(norm_fusion.MAX_ROWS, width, device=kernel_device, dtype=torch.bfloat16)  # fused sizes
    y, code = run_and_get_code(nv.compile(model, nv.Config(activations=activations)), h)
    source = "\n".join(code)
    assert "norm_h" not in source and "rms_norm_quantize_values" not in source
    with torch.no_grad():
        want = _linear_eager(model.linear, model.norm(h).reshape(-1, 2 * width), activations)
    assert _rel_err(y, want) < 2**-7


def _rms_fp32(h, dim):
    hf = h.float()
    return hf * torch.rsqrt(hf.pow(2).mean(dim=dim, keepdim=True) + 1e-6)


def _rms(h, dim):
    return _rms_fp32(h, dim).to(h.dtype)


class WholeTensorRMSLinear(nn.Module):
    """A whole-tensor RMS (mean over dim=None), not a row norm; one of its outputs feeds a linear."""

    def __init__(self, k=64):
        super().__init__()
        self.linear = nn.Linear(k, 64)

    def forward(self, x, h):
        g = _rms(h, None)
        return self.linear(x), g, self.linear(g)


class SizeScaledLinear(nn.Module):
    """linear(f(x) * rows), f a row RMSNorm or a SiLU: under dynamic shapes rows is a SymInt, which
    the norm's weight matcher and the gated-MLP matcher (run on every node) read as a tensor."""

    def __init__(self, f, k=64):
        super().__init__()
        self.f, self.linear = f, nn.Linear(k, 64)

    def forward(self, x):
        return self.linear(self.f(x) * x.shape[0])


@pytest.mark.parametrize("activations", ["bf16", "nvfp4"])
@pytest.mark.parametrize("f, f_fp32", [(lambda x: _rms(x, -1), lambda x: _rms_fp32(x, -1)),
                                       (nn.functional.silu, lambda x: nn.functional.silu(x.float()))],
                         ids=["rms_norm", "silu"])
def test_a_size_factor_compiles_under_dynamic_shapes(kernel_device, activations, f, f_fp32):
    """The second batch size recompiles with a dynamic row count; reading the SymInt's .shape or
    .dtype crashed compilation (AttributeError)."""
    torch._dynamo.reset()
    torch.manual_seed(3)
    model = SizeScaledLinear(f).to(device=kernel_device, dtype=torch.bfloat16).eval()
    compiled = nv.compile(model, nv.Config(activations=activations))
    for rows in (3, 5):
        x = torch.randn(rows, 64, device=kernel_device, dtype=torch.bfloat16)
        y = compiled(x)
        # f rounded to bf16 before the product, or (Inductor may) one rounding after it: W4A4 then
        # quantizes a slightly different x, so either is the reference
        xs = (f(x) * rows, (f_fp32(x) * rows).to(x.dtype))
        with torch.no_grad():
            err = min(_rel_err(y, _linear_eager(model.linear, v, activations)) for v in xs)
        assert err < 2**-7, (rows, err)
    torch._dynamo.reset()


@pytest.mark.parametrize("activations", ["bf16", "nvfp4"])
def test_whole_tensor_rms_is_not_a_norm_to_fuse(kernel_device, monkeypatch, activations):
    """mean(dim=None, keepdim=True) traces with no dims: the matcher iterated None (TypeError: every
    compile of such a graph failed). It is no row norm: nothing is fused."""
    _defer_anywhere(monkeypatch)
    torch._dynamo.reset()
    torch.manual_seed(4)
    model = WholeTensorRMSLinear().to(device=kernel_device, dtype=torch.bfloat16).eval()
    x, h = (torch.randn(2, 64, device=kernel_device, dtype=torch.bfloat16) for _ in range(2))
    (y, g, yg), code = run_and_get_code(nv.compile(model, nv.Config(activations=activations)), x, h)
    source = "\n".join(code)
    assert "norm_h" not in source and "rms_norm_quantize_values" not in source
    with torch.no_grad():
        want_g = _rms(h, None)
        assert _rel_err(g, want_g) < 2**-7
        assert _rel_err(y, _linear_eager(model.linear, x, activations)) < 2**-7
        assert _rel_err(yg, _linear_eager(model.linear, want_g, activations)) < 2**-7
    torch._dynamo.reset()


def test_fp16_norm_is_not_deferred(kernel_device, monkeypatch):
    """fp16: x = h * w would be rounded to fp16 before the norm's factor and overflow where the
    normalized y does not (inf outputs); the norm stays a kernel."""
    _defer_anywhere(monkeypatch)
    torch._dynamo.reset()
    model = NormLinear("after_cast", 256, 192).to(device=kernel_device, dtype=torch.float16).eval()
    with torch.no_grad():
        model.norm.weight[0] = 200.0
    x = torch.randn(2, 256, device=kernel_device, dtype=torch.float16)
    x[:, 0] = 400.0  # h * w = 80000 > 65504
    y, code = run_and_get_code(nv.compile(model, nv.Config(activations="bf16")), x)
    assert "norm_h" not in "\n".join(code)
    with torch.no_grad():
        want = _linear_eager(model.linear, model.norm(x), "bf16")
    assert torch.isfinite(y).all() and _rel_err(y, want) < 2**-7


def _norm_times_weight(norm, h):
    """The x a deferred norm leaves its linears: h times the norm's weight, rounded as it rounds."""
    weight = getattr(norm, "weight", None)
    if weight is None:
        return h
    if isinstance(norm, WeightAfterCastRMSNorm):
        return weight * h
    return (h.float() * weight.float()).to(h.dtype)


# W4A16 against the norm's own kernel: x rounded once either way, at different places (2^-9); the
# CPU interpreter truncates to bf16 instead of rounding, a bias that adds up (up to 0.7%)
_NORM_TOL = {"cpu": 2**-6, "cuda": 2**-7}


@pytest.mark.parametrize("norm", list(NORMS))
@pytest.mark.parametrize("m, k, scale", [(1, 256, 3.0), (5, 256, 3.0), (plan.DEFER_NORM_MAX_ROWS, 256, 3.0),
                                         (1, 192, 3.0), (5, 192, 2.0**-9)])
def test_w4a16_gemm_applies_the_rms_norm(template_inductor, norm, m, k, scale):
    """RMSNorm -> W4A16 linear at decode: x = h * weight (a pointwise kernel, none without a weight)
    and the template multiplies each row by rsqrt(mean(h^2) + eps), reading h's rows whole (16 x
    256: gemm_configs.RMS_MAX_ELEMENTS; the last split, or each program where K is not split, as
    on the GPU at K = 256); no reduction kernel. K = 192 is not a power of two (the row read
    padded to 256, the mean over K; 320 would not fit 16 rows: the eager op on the GPU); at scale
    2^-9 mean(h^2) is ~4e-6, so eps counts. Equal to the op's
    definition on the same x and h up to the template's rounding, and to the norm then the linear
    within bf16's rounding of x."""
    torch.manual_seed(m)
    model = NormLinear(norm, k, 192).to(device=template_inductor, dtype=torch.bfloat16).eval()
    x = torch.randn(m, k, device=template_inductor, dtype=torch.bfloat16) * scale
    y, code = run_and_get_code(nv.compile(model, nv.Config(activations="bf16")), x)
    launches = _launches("\n".join(code))
    assert len(launches) == (1 if norm == "nn_no_weight" else 2), launches
    assert "triton_tem_fused" in launches[-1] and all("triton_poi" in line for line in launches[:-1]), launches
    with torch.no_grad():
        eps = model.norm.eps
        exact = _linear_eager(model.linear, _norm_times_weight(model.norm, x), "bf16", (x, eps))
        torch.testing.assert_close(y, exact, rtol=2**-7, atol=2**-6)
        err = _rel_err(y, _linear_eager(model.linear, model.norm(x), "bf16"))
    assert err < _NORM_TOL[template_inductor], err


def test_unsplit_template_applies_the_rms_norm(template_inductor, monkeypatch):
    """K not split (every config forced to one range): each program reads its rows of h whole."""
    configs = gemm_configs.template_configs

    def unsplit(m, n, k, *args):
        return [c._replace(split=1, tiles_per_split=-(-k // c.block_k)) for c in configs(m, n, k, *args)]

    monkeypatch.setattr(gemm_configs, "template_configs", unsplit)
    torch.manual_seed(4)
    model = NormLinear("after_cast", 256, 192).to(device=template_inductor, dtype=torch.bfloat16).eval()
    x = torch.randn(5, 256, device=template_inductor, dtype=torch.bfloat16) * 3
    with torch._inductor.config.patch(fx_graph_cache=False):  # (keyed without the patch)
        y, code = run_and_get_code(nv.compile(model, nv.Config(activations="bf16")), x)
    source = "\n".join(code)
    assert "workspace_" not in source and len(_launches(source)) == 2, _launches(source)
    with torch.no_grad():
        exact = _linear_eager(model.linear, _norm_times_weight(model.norm, x), "bf16", (x, model.norm.eps))
    torch.testing.assert_close(y, exact, rtol=2**-7, atol=2**-6)


def test_a_deferred_norm_the_template_cannot_read_whole_runs_the_eager_op(template_inductor, monkeypatch):
    """nvfp4.linear_tiled with norm_h where rows x K exceed what the last split reads (16 x 512):
    the lowering leaves the eager op (its own deferred norm), not a template without the norm.
    (Plain torch.compile: the lowering registered here, and the FX graph cache off, whose key holds
    neither.)"""
    from torch._inductor import lowering as inductor_lowering

    linear_lowering.register()
    lowered = []
    op = torch.ops.nvfp4.linear_tiled.default
    lower = inductor_lowering.lowerings[op]
    monkeypatch.setitem(inductor_lowering.lowerings, op, lambda *a, **kw: lowered.append(1) or lower(*a, **kw))
    torch.manual_seed(2)
    linear = nn.Linear(512, 192).to(device=template_inductor, dtype=torch.bfloat16)
    h = torch.randn(16, 512, device=template_inductor, dtype=torch.bfloat16)
    x = h * 0.75

    def run(x, h):
        return _linear_eager(linear, x, "bf16", (h, 1e-6))

    assert not gemm_configs.rms_in_template(16, 512)
    with torch._inductor.config.patch(fx_graph_cache=False):
        y, code = run_and_get_code(torch.compile(run, fullgraph=True), x, h)
    calls = [line for line in "\n".join(code).splitlines()
             if "torch.ops.nvfp4.linear_tiled.default(" in line and not line.strip().startswith("#")]
    assert lowered and len(calls) == 1 and "1e-06)" in calls[0], (lowered, calls)
    torch.testing.assert_close(y, run(x, h), rtol=0, atol=0)


class NormGatedMLP(nn.Module):
    """A decoder's MLP half: h + down(silu(gate(norm(h))) * up(norm(h))), after h = x + o(a)."""

    def __init__(self, k, hidden):
        super().__init__()
        self.o = nn.Linear(k, k, bias=False)
        self.norm = decode.RMSNorm(k, 1e-5)
        self.norm.weight.data = torch.rand(k) + 0.5
        self.mlp = GatedMLP(k, hidden)

    def forward(self, a, x):
        h = x + self.o(a)
        return h, self.mlp(self.norm(h))


@pytest.mark.parametrize("m", [1, 5])
def test_w4a16_gated_mlp_applies_the_rms_norm(template_inductor, m):
    """The norm's x = h * weight fuses into the template that makes h (o's GEMM + residual add),
    the gate / up template applies the norm: three templates, nothing else. The MLP's output (h
    returned on its own: it dwarfs it) against the eager ops' definition and the norm kernel."""
    torch.manual_seed(m)
    model = NormGatedMLP(256, 256).to(device=template_inductor, dtype=torch.bfloat16).eval()
    a, x = (torch.randn(m, 256, device=template_inductor, dtype=torch.bfloat16) for _ in range(2))
    (h, y), code = run_and_get_code(nv.compile(model, nv.Config(activations="bf16")), a, x)
    launches = _launches("\n".join(code))
    assert len(launches) == 3 and all("triton_tem" in line for line in launches), launches
    with torch.no_grad():
        h_eager = x + _linear_eager(model.o, a, "bf16")
        torch.testing.assert_close(h, h_eager, rtol=2**-7, atol=2**-6)
        mlp = model.mlp
        for x_in, norm in ((_norm_times_weight(model.norm, h), (h, 1e-5)), (model.norm(h), ())):
            gated = (nn.functional.silu(_linear_eager(mlp.gate, x_in, "bf16", norm))
                     * _linear_eager(mlp.up, x_in, "bf16", norm))
            err = _rel_err(y, _linear_eager(mlp.down, gated, "bf16"))
            assert err < (2**-6 if norm else 2 * _NORM_TOL[template_inductor]), (bool(norm), err)


def _deferred_norms(monkeypatch, model, config, *inputs) -> tuple[int, torch.Tensor]:
    """Compiles and runs model; -> (how many norms the rewrite deferred, its output). The pass
    decides as on a device the template runs on, whatever Inductor emits here (on the CPU the
    linears then run as the eager op: the deferred norm's CPU implementation)."""
    from nvfp4_inductor.lowerings.passes import linear as rewrite

    counts, original = [], rewrite.LinearToNVFP4.__call__

    def recording(pass_, graph):
        original(pass_, graph)
        counts.append(pass_.norms_deferred)

    monkeypatch.setattr(rewrite.LinearToNVFP4, "__call__", recording)
    monkeypatch.setattr(norm_fusion, "template_device", lambda device: True)
    torch._dynamo.reset()
    y = nv.compile(model, config)(*inputs)
    torch._dynamo.reset()
    return sum(counts), y


@pytest.mark.parametrize("m, k, also_return, fuse, dtype, deferred", [
    (1, 256, False, True, torch.bfloat16, 1), (1, 4096, False, True, torch.bfloat16, 1),
    (1, 4096, False, True, torch.float16, 0),
    (plan.DEFER_NORM_MAX_ROWS + 1, 16, False, True, torch.bfloat16, 0),
    (2, 4096, False, True, torch.bfloat16, 0),
    (1, 256, True, True, torch.bfloat16, 0), (1, 256, False, False, torch.bfloat16, 0)])
def test_w4a16_rms_norm_is_deferred_only_where_it_fits(monkeypatch, m, k, also_return, fuse, dtype, deferred):
    """Decode rows (at most plan.DEFER_NORM_MAX_ROWS) whose h the template reads whole (1 x 4096, not
    2 x 4096), only W4A16 linears reading the norm (not a graph output too), Config.fuse_norms
    on; bf16 only (fp16's h * w can overflow: test_fp16_norm_is_not_deferred). Numerics of each
    against the norm then the linear (CPU: the eager op's deferred norm)."""
    torch.manual_seed(m)
    model = NormLinear("example", k, 192, also_return).to(dtype=dtype).eval()
    x = torch.randn(m, k, dtype=dtype) * 3
    count, y = _deferred_norms(monkeypatch, model, nv.Config(activations="bf16", fuse_norms=fuse), x)
    assert count == deferred
    y = y[0] if also_return else y
    with torch.no_grad():
        err = _rel_err(y, _linear_eager(model.linear, model.norm(x), "bf16"))
    assert y.dtype == dtype and err < 2**-7, err


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)): gate and up merge into one GEMM at decode."""

    def __init__(self, k, hidden):
        super().__init__()
        self.gate = nn.Linear(k, hidden, bias=False)
        self.up = nn.Linear(k, hidden, bias=False)
        self.down = nn.Linear(hidden, k, bias=False)

    def forward(self, x):
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))


class UpFirstGatedMLP(GatedMLP):
    """The same MLP written up first: up is the merged GEMM's first half, and mul's first operand."""

    def forward(self, x):
        return self.down(self.up(x) * nn.functional.silu(self.gate(x)))


@pytest.mark.parametrize("activations", ["bf16", "nvfp4"])
@pytest.mark.parametrize("m, mlp", [(1, GatedMLP), (5, GatedMLP), (1, UpFirstGatedMLP)])
def test_gate_up_template_applies_silu_mul(template_inductor, activations, m, mlp):
    """A gated MLP at decode: the merged gate / up GEMM's epilogue takes silu(gate) * up
    (nvfp4.linear_tiled_silu_mul, the weight rows interleaved): two templates, no SiLU * mul
    kernel. W4A4's values of the down projection's x may differ from the eager chain's by a whole
    e2m1 step where gate or up rounds an ulp apart (a few percent; swapped halves or a lost global
    scale would be ~100%)."""
    torch.manual_seed(m)
    model = mlp(256, 256).to(device=template_inductor, dtype=torch.bfloat16).eval()
    x = torch.randn(m, 256, device=template_inductor, dtype=torch.bfloat16)
    y, code = run_and_get_code(nv.compile(model, nv.Config(activations=activations)), x)
    source = "\n".join(code)
    kernels = [line for line in _launches(source) if ".run(" in line]
    assert len(kernels) == 2 and all("triton_tem" in line for line in kernels), kernels
    assert "torch.ops.nvfp4.linear_tiled_silu_mul.default(" not in source  # lowered to the template
    with torch.no_grad():
        h = nn.functional.silu(_linear_eager(model.gate, x, activations)) * _linear_eager(model.up, x, activations)
        expected = _linear_eager(model.down, h, activations)
    err = _rel_err(y, expected)
    assert err < (2**-6 if activations == "bf16" else 0.08), err


@pytest.mark.parametrize("m", [40, 100])
def test_serving_rows_take_the_wgmma_mainloop(template_inductor, monkeypatch, m):
    """Where the device has wgmma (sm_90; asked as such on the CPU, whose interpreter runs the
    same mainloop in fp32), 33..128 rows run the template with the wgmma mainloop: K split in two
    at 40 rows (3 output tiles), two blocks of rows at 100; the epilogue fused, and at 40 rows the
    merged gate / up GEMM's silu * mul too; outputs as the eager ops'. (At 100 rows gate and up
    stay apart and Inductor fuses SiLU through libdevice, which the interpreter lacks.)"""
    monkeypatch.setattr(capability, "wgmma", lambda device: True)
    code = _run(template_inductor, m, 320, 192)
    assert f"MAINLOOP : tl.constexpr = {MAINLOOPS['wgmma']}" in code
    launches = _launches(code)
    assert len(launches) == 1 and "triton_tem_fused" in launches[0], launches
    assert ("workspace_" in code) == (m <= 64)  # the split's partials
    if m > 64:
        return
    torch.manual_seed(m)
    model = GatedMLP(320, 192).to(device=template_inductor, dtype=torch.bfloat16).eval()
    x = torch.randn(m, 320, device=template_inductor, dtype=torch.bfloat16)
    y, code = run_and_get_code(nv.compile(model, nv.Config(activations="bf16")), x)
    with torch.no_grad():
        h = nn.functional.silu(_linear_eager(model.gate, x, "bf16")) * _linear_eager(model.up, x, "bf16")
        expected = _linear_eager(model.down, h, "bf16")
    assert _rel_err(y, expected) < 2**-6
    source = "\n".join(code)
    assert "silu_mul_halves(" in source
    assert len(re.findall(f"MAINLOOP : tl.constexpr = {MAINLOOPS['wgmma']}\n", source)) == 2


class TransposedInput(nn.Module):
    """A linear whose x is a column-major view: given so, or transposed in the graph."""

    def __init__(self, in_graph):
        super().__init__()
        self.linear = nn.Linear(64, 80)
        self.in_graph = in_graph

    def forward(self, x):
        return self.linear(torch.relu(x).t() if self.in_graph else x)


@pytest.mark.parametrize("in_graph", [False, True])
def test_template_reads_a_column_major_x(template_inductor, in_graph):
    """The template reads x's rows as runs of K: an x with another K stride is copied first (it
    was read as if contiguous)."""
    torch.manual_seed(4)
    model = TransposedInput(in_graph).to(device=template_inductor, dtype=torch.bfloat16).eval()
    x = torch.randn(64, 5, device=template_inductor, dtype=torch.bfloat16)
    x_in = x if in_graph else x.t()
    y, code = run_and_get_code(nv.compile(model, nv.Config(activations="bf16")), x_in)
    assert "triton_tem" in "\n".join(code)
    expected = _linear_eager(model.linear, torch.relu(x).t().contiguous() if in_graph else x_in.contiguous(), "bf16")
    err = _rel_err(y, expected)
    assert err < 2**-7, err


@pytest.mark.parametrize("shape", [(3, 64), (1, 3, 64)])
def test_fused_gate_up_template_applies_silu_mul(template_inductor, shape):
    """One gate_up weight sliced in halves (a per-tensor global scale for both): the same gated
    template, each interleaved row taking that scale; with a 3-D x as well."""
    from test_backend import FusedGateUp

    torch.manual_seed(3)
    model = FusedGateUp().to(device=template_inductor, dtype=torch.bfloat16).eval()
    x = torch.randn(shape, device=template_inductor, dtype=torch.bfloat16)
    y, code = run_and_get_code(nv.compile(model, nv.Config(activations="bf16")), x)
    kernels = [line for line in "\n".join(code).splitlines() if ".run(" in line]
    assert len(kernels) == 1 and "triton_tem" in kernels[0], kernels
    with torch.no_grad():
        h = _linear_eager(model.gate_up, x.reshape(-1, 64), "bf16").reshape(*shape[:-1], 256)
        expected = nn.functional.silu(h[..., :128]) * h[..., 128:]
    err = _rel_err(y, expected)
    assert err < 2**-6, err


class ScaledLinear(nn.Module):
    """linear(x * s), or linear(RMSNorm(x)) with norm: a producer kernel in front of the linear. s
    holds powers of two, so x * s is exact in bf16 and the eager reference sees the same activation
    as the compiled graph."""

    def __init__(self, k, n, norm=False):
        super().__init__()
        self.s = nn.Parameter(2.0 ** torch.randint(-3, 4, (k,)).float())
        self.norm = decode.RMSNorm(k, 1e-5) if norm else None
        self.linear = nn.Linear(k, n)

    def producer(self, x):
        return self.norm(x) if self.norm is not None else x * self.s.to(x.dtype)

    def forward(self, x):
        return self.linear(self.producer(x))


@pytest.mark.parametrize("activations", ["bf16", "nvfp4"])
def test_a_graph_ending_in_the_template(template_inductor, activations):
    """The template's output is the graph's output (nothing after the linear) and x is computed in
    the graph: Inductor's memory planning read `.name` of the template's workspace there and
    failed (torch 2.13) until _compat gave the workspace that attribute. (K = 512, 8 K-steps: the
    register-fed mainloop on CUDA splits only ranges of at least 4.)"""
    torch.manual_seed(3)
    model = ScaledLinear(512, 192).to(device=template_inductor, dtype=torch.bfloat16).eval()
    x = torch.randn(1, 512, device=template_inductor, dtype=torch.bfloat16)
    y, code = run_and_get_code(nv.compile(model, nv.Config(activations=activations)), x)
    launches = _launches("\n".join(code))
    assert "triton_tem_fused" in launches[-1] and "workspace_" in "\n".join(code), launches
    with torch.no_grad():
        expected = _linear_eager(model.linear, model.producer(x), activations)  # x * s is exact in bf16
    torch.testing.assert_close(y, expected, rtol=2**-7, atol=2**-6)


class QKVAttention(nn.Module):
    """Grouped-query attention on q / k / v projections of one x (merged into one GEMM at decode)."""

    def __init__(self, hidden, heads, kv_heads, head_dim):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.wq = nn.Linear(hidden, heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(hidden, kv_heads * head_dim, bias=False)

    def forward(self, x):
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


@pytest.mark.parametrize("activations", ["bf16", "nvfp4"])
def test_attention_reads_the_template_output(template_inductor, activations):
    """q / k / v sliced from the merged GEMM go to attention, an op with a layout constraint: the
    template stores the bf16 projections and attention reads them in place. (Left a pointwise
    node, the epilogue makes attention's constraint copy q, k and v out of an fp32 product in a
    kernel of their own.)"""
    torch.manual_seed(5)
    model = QKVAttention(128, 4, 2, 32).to(device=template_inductor, dtype=torch.bfloat16).eval()
    x = torch.randn(1, 1, 128, device=template_inductor, dtype=torch.bfloat16)
    y, code = run_and_get_code(nv.compile(model, nv.Config(activations=activations)), x)
    launches = _launches("\n".join(code))
    kernels = [line for line in launches if ".run(" in line]  # (W4A4's quantize_values is an op call)
    assert len(kernels) == 1 and "triton_tem_fused" in kernels[0], launches
    with torch.no_grad():
        projections = [_linear_eager(linear, x, activations) for linear in (model.wq, model.wk, model.wv)]
        q, k, v = (p.view(1, 1, -1, 32).transpose(1, 2) for p in projections)
        expected = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(y, expected, rtol=2**-7, atol=2**-6)


@pytest.mark.gpu
@pytest.mark.parametrize("norm", [False, True])
def test_computed_activations_take_the_register_fed_mainloop(triton_inductor, norm):
    """x computed in the graph (its layout's stride a sympy Integer) still has even rows: the
    decode template takes the register-fed mainloop, not the slower tl.dot one (_even_rows reads
    sympy Integers)."""
    torch.manual_seed(4)
    model = ScaledLinear(4096, 1024, norm=norm).to(device="cuda", dtype=torch.bfloat16).eval()
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    y, code = run_and_get_code(nv.compile(model, nv.Config(activations="bf16")), x)
    source = "\n".join(code)
    assert "REG_MMA : tl.constexpr = 1" in source, source
    with torch.no_grad():
        expected = _linear_eager(model.linear, model.producer(x), "bf16")
    err = _rel_err(y, expected)
    assert err < 1e-2, err  # the compiled norm may round h differently (W4A16 is continuous in h)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [gemm_configs.HOPPER_GEMM_M[0], 200, gemm_configs.HOPPER_GEMM_M[1]])
def test_planned_rows_run_the_hopper_gemm(triton_inductor, m):
    """Where plan.py picks the Hopper GEMM (sm_90, gemm_configs.HOPPER_GEMM_M), the compiled linear
    calls the op, whose CUDA implementation runs that kernel with its epilogue: no template,
    outputs as the eager op's (the same kernel)."""
    if not capability.wgmma(torch.device("cuda")):
        pytest.skip("the Hopper GEMM needs sm_90")
    code = _run(triton_inductor, m, 1040, 200)
    assert "triton_tem_fused" not in code and "torch.ops.nvfp4.linear_tiled.default(" in code, code


@pytest.mark.gpu
def test_shape_padding_leaves_the_nvfp4_linears_alone(template_inductor):
    """Inductor's pad_mm (CUDA only) runs before the rewrite: forced to pad, it turned x's 5 rows
    into a copy to 8, then the template, then the epilogue as a kernel of its own. The backend
    turns shape padding off (test_decode_rows_run_one_kernel[5] failed whenever pad_mm's own
    benchmark chose to pad)."""
    with torch._inductor.config.patch(force_shape_pad=True):
        code = _run(template_inductor, 5, 1024, 192)
    launches = _launches(code)
    assert len(launches) == 1 and "triton_tem_fused" in launches[0], launches


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 12, 40])
def test_pdl_template_waits_before_reading_x(template_inductor, m):
    """Programmatic dependent launch (Inductor's triton.enable_pdl, which the backend sets for
    CUDA graphs): the template launches with it and waits for the kernel before it, after the first
    weight tile where the register-fed mainloop reads frozen weights (M <= 16), at the start
    otherwise (the tl.dot mainloop). _run checks the numerics; the residual add, read in the
    epilogue, comes after the wait."""
    code = _run(template_inductor, m, 1024, 192)  # the backend turns PDL on for CUDA graphs
    assert "'launch_pdl': True" in code
    assert "gdc_launch_dependents()" in code
    if m <= 16:
        assert "'REG_MMA': 0" not in code
        assert "'PDL': 2" in code  # the register-fed mainloop waits after its first weight tile
    else:
        assert "'REG_MMA': 0" in code
        assert "'PDL': 1" in code  # the mainloop's dispatch waits first (PTX: test_compile_targets)


@pytest.mark.gpu
def test_gelu_epilogue_fuses_on_the_gpu(triton_inductor):
    m = plan.SPLITK_MAX_M_TILED + 64
    n = 64 * (torch.cuda.get_device_properties(0).multi_processor_count + 4)  # the template's pick
    code = _run(triton_inductor, m, 256, n, act=nn.functional.gelu)
    launches = _launches(code)
    assert len(launches) == 1 and "triton_tem_fused" in launches[0], launches
    code = _run(triton_inductor, 4, 512, 384, act=nn.functional.gelu)  # split K: one kernel too
    launches = _launches(code)
    assert len(launches) == 1 and "triton_tem_fused" in launches[0], launches


@pytest.mark.gpu
@pytest.mark.parametrize("m", [plan.WGMMA_MAX_M + 36, plan.TEMPLATE_MAX_M + 44])
def test_large_m_or_few_programs_pick_the_extern_choice(triton_inductor, m):
    """The extern choice: one cuBLASLt GEMM that reads g (W4A4: g * g_x) on the device and adds
    the bias, then ReLU + residual; no fp32 product (and no literal alpha: a frozen g is a named
    constant, which the FX graph cache binds anew)."""
    code = _run(triton_inductor, m, 256, 192)
    assert "extern_kernels.nvfp4_scaled_mm_tiled(" in code and TEMPLATE_MARK not in code
    assert "nvfp4_mm_tiled_f32(" not in code
    torch.manual_seed(m)
    model = LinearBlock(256, 192, torch.relu).to(device="cuda", dtype=torch.bfloat16).eval()
    model.linear.bias = None
    x = torch.randn(m, 256, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn(m, 192, device="cuda", dtype=torch.bfloat16)
    y, code = run_and_get_code(nv.compile(model, nv.Config(activations="bf16")), x, residual)
    assert "extern_kernels.nvfp4_scaled_mm_tiled(" in "\n".join(code)
    expected = _eager(model, x, residual)
    torch.testing.assert_close(y, expected, rtol=2**-7, atol=2**-6)
    y, code = run_and_get_code(nv.compile(model, nv.Config(activations="nvfp4")), x, residual)
    source = "\n".join(code)
    assert "extern_kernels.nvfp4_scaled_mm_tiled(" in source and "nvfp4_mm_tiled_f32(" not in source
    with torch.no_grad():
        expected = model.act(_linear_eager(model.linear, x, "nvfp4")) + residual
    torch.testing.assert_close(y, expected, rtol=2**-7, atol=2**-6)


@pytest.mark.gpu
@pytest.mark.parametrize("activations", ["bf16", "nvfp4"])
def test_large_m_extern_choice_under_cuda_graph_trees(triton_inductor, activations):
    """mode="reduce-overhead" records the extern GEMM in a CUDA-graph tree, which refuses any
    allocation made while recording that outlives the call (cuBLASLt's workspace and beta are
    per-call allocations for that reason); replays with new x match the eager ops."""
    torch.manual_seed(3)
    m = plan.TEMPLATE_MAX_M + 44
    model = LinearBlock(256, 192, torch.relu).to(device="cuda", dtype=torch.bfloat16).eval()
    compiled = nv.compile(model, nv.Config(activations=activations), mode="reduce-overhead")
    for _ in range(3):  # warm up, record, replay
        x = torch.randn(m, 256, device="cuda", dtype=torch.bfloat16)
        residual = torch.randn(m, 192, device="cuda", dtype=torch.bfloat16)
        y = compiled(x, residual).clone()
        with torch.no_grad():
            expected = model.act(_linear_eager(model.linear, x, activations)) + residual
        torch.testing.assert_close(y, expected, rtol=2**-7, atol=2**-6)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [8, 130])
def test_max_autotune_benchmarks_every_choice(triton_inductor, m):
    torch.manual_seed(m)
    model = LinearBlock(256, 320, torch.relu).to(device="cuda", dtype=torch.bfloat16).eval()
    x = torch.randn(m, 256, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn(m, 320, device="cuda", dtype=torch.bfloat16)
    compiled = nv.compile(model, nv.Config(activations="bf16"), mode="max-autotune-no-cudagraphs")
    y, code = run_and_get_code(compiled, x, residual)
    with torch.no_grad():
        torch.testing.assert_close(y, _eager(model, x, residual), rtol=2**-7, atol=2**-6)
    source = "\n".join(code)
    assert TEMPLATE_MARK in source or "extern_kernels.nvfp4_mm_tiled_f32(" in source


def _decode_graph(k, n, seed, mode=None):
    """Two chained linears at decode size, compiled: two split-K templates -> (the compiled
    function, an x, its output run alone)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(k, n), nn.ReLU(), nn.Linear(n, k)).to(device="cuda", dtype=torch.bfloat16)
    compiled = nv.compile(model.eval(), nv.Config(activations="bf16"), mode=mode)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    y, code = run_and_get_code(compiled, x)
    code = "\n".join(code)
    templates = [line for line in _launches(code) if "triton_tem_fused" in line]
    assert len(templates) == 2 and all("workspace_" in line for line in templates), templates  # K split
    assert len(_counter_fills(code)) == 1
    return compiled, x, y.clone()


@pytest.mark.gpu
def test_compiled_graphs_on_two_streams_at_once(template_inductor):
    """Two compiled graphs of split-K templates (other shapes) run at once on two streams, many
    times: every output is bit for bit its graph's run alone. (With tile counters shared by every
    graph of a device, their counts mixed: a tile summed before all its splits had stored, or a
    counter left nonzero for the next call.)"""
    graphs = [_decode_graph(4096, 4096, 0), _decode_graph(8192, 2048, 1)]
    streams = [torch.cuda.Stream() for _ in graphs]
    outs = streams_helper.on_streams([lambda f=f, x=x: f(x) for f, x, _ in graphs], streams, 200)
    for (_, _, want), got in zip(graphs, outs):
        assert all(torch.equal(y, want) for y in got)


@pytest.mark.gpu
def test_one_compiled_graph_from_two_threads_at_once(template_inductor):
    """One compiled graph of split-K templates called from two threads at once, each on its own
    stream, many times: bit for bit the run alone (each call fills tile counters of its own)."""
    compiled, x, want = _decode_graph(4096, 4096, 2)
    other = torch.randn_like(x)
    want_other = compiled(other).clone()
    streams = [torch.cuda.Stream() for _ in range(2)]
    outs = streams_helper.on_threads([lambda: compiled(x), lambda: compiled(other)], streams, 200)
    for got, mine, theirs in ((outs[0], want, want_other), (outs[1], want_other, want)):
        wrong = [i for i, y in enumerate(got) if not torch.equal(y, mine)]
        swapped = sum(torch.equal(got[i], theirs) for i in wrong)  # the other thread's output instead
        assert not wrong, f"{len(wrong)} of {len(got)} differ (first at {wrong[0]}), {swapped} the other thread's"


@pytest.mark.gpu
def test_compiled_graphs_from_two_threads_under_cuda_graphs(template_inductor):
    """Two graphs of split-K templates compiled with mode="reduce-overhead", each called first
    (compiled, warmed up, recorded) and then replayed from a thread of its own on its own stream,
    the two replaying at once many times: bit for bit each one's serial output, no CUDA-graph
    skips. (Torch's CUDA-graph trees are per thread: a compiled function records into the tree
    of the thread that first calls it, and its replays reuse one set of output buffers, so one
    such function is not for two threads at once, NVFP4 or not. The tile counters are an
    intermediate of each graph, in its own tree's pool.)"""
    from torch._dynamo.utils import counters as dynamo_counters

    skips = dynamo_counters["inductor"]["cudagraph_skips"]
    codes = []

    def job(compiled, x):
        """compiled(x), keeping the code Inductor generates on the first call (in the job's thread)."""
        called = []

        def call():
            if called:
                return compiled(x)
            called.append(True)
            y, code = run_and_get_code(compiled, x)
            codes.append("\n".join(code))
            return y

        return call

    jobs = []
    for k, n, seed in ((4096, 4096, 3), (8192, 2048, 4)):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(k, n), nn.ReLU(), nn.Linear(n, k)).to(device="cuda", dtype=torch.bfloat16)
        compiled = nv.compile(model.eval(), nv.Config(activations="bf16"), mode="reduce-overhead")
        jobs.append(job(compiled, torch.randn(1, k, device="cuda", dtype=torch.bfloat16)))
    streams = [torch.cuda.Stream() for _ in jobs]
    serial = []
    outs = streams_helper.on_threads(jobs, streams, 200, warm_up=3, serial=serial)
    for code in codes:  # K split in both templates, counters filled once a call
        templates = [line for line in _launches(code) if "triton_tem_fused" in line]
        assert len(templates) == 2 and all("workspace_" in line for line in templates), templates
        assert len(_counter_fills(code)) == 1
    assert len(codes) == 2
    for got, want in zip(outs, serial):
        wrong = sum(not torch.equal(y, want) for y in got)
        assert not wrong, f"{wrong} of {len(got)} differ from the serial run"
    assert dynamo_counters["inductor"]["cudagraph_skips"] == skips
