"""convert(): nn.Linear -> NVFP4Linear, eagerly and under torch.compile on the CPU."""

import gc
import weakref

import pytest
import torch
from torch import nn

import nvfp4_inductor as nv


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(64, 128)
        self.down = nn.Linear(128, 64, bias=False)
        self.odd = nn.Linear(64, 40)         # 40 is not a multiple of 16
        self.lm_head = nn.Linear(64, 32)     # output head, skipped by default

    def forward(self, x):
        h = self.down(torch.relu(self.up(x)))
        return self.lm_head(h), self.odd(h)


def _model():
    torch.manual_seed(0)
    return Block().to(torch.bfloat16).eval()


def test_convert_replaces_eligible_linears_and_reports_the_rest():
    model = _model()
    report = nv.convert(model, nv.Config(activations="bf16"))
    assert report.converted == ["up", "down"]
    assert report.skipped == {"odd": "shape (40, 64) is not a multiple of 16",
                              "lm_head": "output head (Config.skip_output_head)"}
    assert isinstance(model.up, nv.NVFP4Linear) and isinstance(model.lm_head, nn.Linear)
    assert "converted 2 linear layers, skipped 2" in str(report)
    state = model.state_dict()
    assert state["up.weight"].dtype == torch.uint8 and state["up.weight"].shape == (128, 32)
    assert state["up.weight_scale"].dtype == torch.float8_e4m3fn
    assert state["up.weight_scale"].shape == (128, 4)
    assert state["up.weight_scale_2"].dtype == torch.float32
    assert not any(p.dtype == torch.bfloat16 and p.dim() == 2 for n, p in model.named_parameters()
                   if n.startswith(("up.", "down.")))


def test_converted_model_matches_the_reference_linear():
    model = _model()
    x = torch.randn(3, 7, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        w_up = nv.quantize(model.up.weight)
        w_down = nv.quantize(model.down.weight)
        h = nv.linear(x, w_up, model.up.bias)
        want = nv.linear(torch.relu(h), w_down)
        nv.convert(model, nv.Config(activations="bf16"))
        got, _ = model(x)
        assert torch.equal(model.down(torch.relu(model.up(x))), want)
    assert got.shape == (3, 7, 32)


def test_convert_frees_the_bf16_weights():
    model = _model()
    weight_ref = weakref.ref(model.up.weight)
    nv.convert(model)
    gc.collect()
    assert weight_ref() is None


def test_config_options_and_errors():
    model = _model()
    report = nv.convert(model, nv.Config(include=lambda name, m: name != "down",
                                         skip_output_head=False, min_weight_numel=64 * 128))
    assert report.converted == ["up"]
    assert report.skipped["down"] == "excluded by Config.include"
    assert report.skipped["lm_head"] == "2048 weights < Config.min_weight_numel"
    with pytest.raises(ValueError, match="activations must be one of"):
        nv.Config(activations="fp8")
    with pytest.raises(TypeError, match="include must be callable"):
        nv.Config(include="up")
    with pytest.raises(ValueError, match="min_weight_numel must be an int >= 0"):
        nv.Config(min_weight_numel=-1)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        nv.convert(object())
    with pytest.raises(TypeError, match="config must be an nvfp4_inductor.Config"):
        nv.convert(_model(), {"activations": "bf16"})


@pytest.mark.parametrize("activations", ["bf16", "nvfp4", "auto"])
def test_converted_model_compiles_fullgraph_on_cpu(activations):
    torch._dynamo.reset()
    model = _model()
    nv.convert(model, nv.Config(activations=activations))
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        eager = model(x)
        compiled = torch.compile(model, fullgraph=True)(x)
    for e, c in zip(eager, compiled):
        assert torch.equal(e, c)


def test_module_casts_keep_the_nvfp4_buffers():
    """model.half() / .float() / .to(dtype) after convert cast the bias, not the codes, the e4m3
    scales or the fp32 global scale (a cast to fp16 would round the global scale)."""
    model = _model()
    nv.convert(model, nv.Config(activations="bf16"))
    before = {n: b.clone() for n, b in model.up.named_buffers()}
    x = torch.randn(3, 64)
    for cast in (lambda m: m.half(), lambda m: m.float(), lambda m: m.to(torch.bfloat16),
                 lambda m: m.to("cpu", torch.float32)):
        cast(model)
        for name, buffer in model.up.named_buffers():
            assert buffer.dtype == before[name].dtype
            assert torch.equal(buffer.reshape(-1).view(torch.uint8),
                               before[name].reshape(-1).view(torch.uint8))
    with torch.no_grad():
        got = model.up(x)
        want = nv.linear(x, model.up.nvfp4_weight(), model.up.bias)
    assert model.up.bias.dtype == torch.float32 and got.dtype == torch.float32
    assert torch.equal(got, want)


def test_state_dict_holds_plain_scales_for_a_swizzled_weight():
    torch.manual_seed(1)
    w = torch.randn(128, 64)
    swizzled = nv.NVFP4Linear(nv.quantize(w, swizzle=True), None, "bf16")
    plain = nv.NVFP4Linear(nv.quantize(w), None, "bf16")
    state = swizzled.state_dict()
    assert torch.equal(state["weight_scale"].view(torch.uint8),
                       plain.state_dict()["weight_scale"].view(torch.uint8))
    x = torch.randn(4, 64)
    # Swizzled -> plain and plain -> swizzled modules: the same product either way.
    target = nv.NVFP4Linear(nv.quantize(torch.randn(128, 64)), None, "bf16")
    target.load_state_dict(state)
    back = nv.NVFP4Linear(nv.quantize(torch.randn(128, 64), swizzle=True), None, "bf16")
    back.load_state_dict(plain.state_dict())
    with torch.no_grad():
        want = plain(x)
        assert torch.equal(target(x), want) and torch.equal(back(x), want)
    assert torch.equal(back.weight_scale.view(torch.uint8), swizzled.weight_scale.view(torch.uint8))


def _modelopt_state(w: torch.Tensor) -> dict:
    """A ModelOpt-style state dict of w (N, K), as an exporter writes it: codes (N, K/2) uint8,
    plain e4m3 scales (N, K/16), fp32 weight_scale_2."""
    q = nv.quantize(w)
    return {"weight": q.data.clone(), "weight_scale": q.scale.clone(), "weight_scale_2": q.global_scale.clone()}


@pytest.mark.parametrize("swizzle", [False, True])
def test_load_state_dict_takes_codes_and_scales_as_bits(swizzle):
    """Scales stored as uint8 bytes and codes as int8 (as FlashInfer / TensorRT-LLM pass them) load
    as the same bits, into plain and swizzled modules alike; torch's own copy would have turned
    scale byte 0x76 into the e4m3 number 118."""
    torch.manual_seed(2)
    w, x = torch.randn(128, 64), torch.randn(3, 64)
    state = _modelopt_state(w)
    want = nv.NVFP4Linear(nv.quantize(torch.randn(128, 64), swizzle=swizzle), None, "bf16")
    want.load_state_dict(state)
    got = nv.NVFP4Linear(nv.quantize(torch.randn(128, 64), swizzle=swizzle), None, "bf16")
    got.load_state_dict({**state, "weight": state["weight"].view(torch.int8),
                         "weight_scale": state["weight_scale"].view(torch.uint8)})
    assert got.weight.dtype == torch.uint8 and got.weight_scale.dtype == want.weight_scale.dtype
    assert torch.equal(got.weight_scale.view(torch.uint8), want.weight_scale.view(torch.uint8))
    with torch.no_grad():
        assert torch.equal(got(x), want(x))
        assert torch.equal(want(x), nv.linear(x, nv.quantize(w), None))


@pytest.mark.parametrize("key, value, message", [
    ("weight", lambda s: s["weight"].float(), r"weight is a torch.float32 tensor \(an unquantized checkpoint\)"),
    ("weight", lambda s: s["weight"].to(torch.int32), "weight must have dtype"),
    ("weight_scale", lambda s: s["weight_scale"].to(torch.bfloat16), "weight_scale must have dtype"),
    ("weight_scale_2", lambda s: torch.zeros(()), "weight_scale_2 must be finite and > 0"),
    ("weight_scale_2", lambda s: -s["weight_scale_2"], "weight_scale_2 must be finite and > 0"),
    ("weight_scale_2", lambda s: torch.tensor(float("nan")), "weight_scale_2 must be finite and > 0"),
    ("weight_scale_2", lambda s: torch.tensor(float("inf")), "weight_scale_2 must be finite and > 0"),
    ("weight_scale_2", lambda s: s["weight_scale_2"].to(torch.bfloat16), "weight_scale_2 must have dtype"),
])
def test_load_state_dict_refuses_nvfp4_tensors_it_would_load_wrong(key, value, message):
    """Codes or scales as numbers (converted value by value), and a zero, negative or non-finite
    global scale (outputs zero, sign-flipped or NaN), are refused with the tensor's name; the module
    keeps what it had."""
    torch.manual_seed(3)
    state = _modelopt_state(torch.randn(64, 32))
    module = nv.NVFP4Linear(nv.quantize(torch.randn(64, 32)), None, "bf16")
    before = {name: t.clone() for name, t in module.state_dict().items()}
    with pytest.raises(RuntimeError, match=message) as refused:
        module.load_state_dict({**state, key: value(state)})
    assert "Missing key" not in str(refused.value)  # the tensor was there: only its error is reported
    assert torch.equal(module.state_dict()[key].float(), before[key].float())


def test_convert_warns_when_it_converts_nothing():
    with pytest.warns(UserWarning, match="converted nothing: it has no nn.Linear layers"):
        report = nv.convert(nn.Sequential(nn.ReLU()))
    assert report.layers == 0
    with pytest.warns(UserWarning, match="none of its 1 nn.Linear layers qualified"):
        nv.convert(nn.Sequential(nn.Linear(30, 30)))


def test_an_output_head_of_any_width_is_reported_as_the_output_head():
    """An LM head of 1000 classes is left bf16 as the output head (the reason that holds whatever
    its width), not for its width."""
    model = nn.Module()
    model.body, model.lm_head = nn.Linear(64, 64), nn.Linear(64, 1000)
    report = nv.convert(model)
    assert report.skipped == {"lm_head": "output head (Config.skip_output_head)"}
    other = nn.Module()
    other.lm_head = nn.Linear(64, 1000)
    with pytest.warns(UserWarning, match="converted nothing"):
        report = nv.convert(other, nv.Config(skip_output_head=False))
    assert report.skipped == {"lm_head": "shape (1000, 64) is not a multiple of 16"}


class _Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 32)
        self.b = self.a                       # one module under two names
        self.emb = nn.Embedding(10, 32)
        self.proj = nn.Linear(32, 10, bias=False)
        self.proj.weight = self.emb.weight    # tied to the embedding
        self.mha = nn.MultiheadAttention(32, 2)
        self.empty = nn.Linear(0, 16)
        self.pre_classifier = nn.Linear(32, 32)  # not an output head: last component differs
        self.mlm_head = nn.Linear(32, 32)

    def forward(self, x):
        return self.proj(self.b(x))


def test_convert_handles_shared_tied_and_special_linears():
    model = _Shared()
    report = nv.convert(model, nv.Config(activations="bf16"))
    assert report.converted == ["a", "b", "pre_classifier", "mlm_head"]
    assert model.a is model.b and isinstance(model.b, nv.NVFP4Linear)
    assert report.skipped["proj"].startswith("weight shared with emb (tied)")
    assert model.proj.weight is model.emb.weight
    assert report.skipped["mha.out_proj"].startswith("NonDynamicallyQuantizableLinear subclasses")
    assert report.skipped["empty"] == "shape (16, 0) has no weights"
    with torch.no_grad():
        assert model(torch.randn(2, 32)).shape == (2, 10)
    lone = nn.Linear(32, 32)
    assert nv.convert(lone).skipped == {"": "the model itself: use NVFP4Linear.from_linear(model)"}
    assert report.layers == 3 and "converted 3 linear layers (4 names)" in str(report)


class _TwoNames(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 32)
        self.lm_head = self.proj  # the output head, registered first under another name
        self.c = nn.Linear(32, 32)


def test_a_layer_under_two_names_passes_the_skip_rules_under_both():
    model = _TwoNames()
    report = nv.convert(model, nv.Config(activations="bf16"))
    assert report.converted == ["c"] and type(model.lm_head) is nn.Linear
    assert report.skipped == {"proj": "output head (Config.skip_output_head) (as lm_head)",
                              "lm_head": "output head (Config.skip_output_head)"}
    report = nv.convert(_TwoNames(), nv.Config(skip_output_head=False, include=lambda name, _: name != "lm_head"))
    assert report.converted == ["c"] and report.skipped["proj"] == "excluded by Config.include (as lm_head)"


def test_replacements_keep_hooks_mode_and_a_trainable_bias():
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32)).eval()
    seen = []
    handle = model[0].register_forward_hook(lambda module, args, out: seen.append(type(module).__name__))
    model[1].register_forward_pre_hook(lambda module, args: (args[0] * 2,))
    x = torch.randn(2, 32)
    nv.convert(model, nv.Config(activations="bf16"))
    assert not model[0].training and not model[1].training
    y = model(x)
    assert seen == ["NVFP4Linear"]
    w0, w1 = (model[i].nvfp4_weight() for i in range(2))
    with torch.no_grad():
        want = nv.linear(nv.linear(x, w0, model[0].bias) * 2, w1, model[1].bias)
    assert torch.equal(y.detach(), want)
    handle.remove()  # the user's handle still removes the moved hook
    model(x)
    assert seen == ["NVFP4Linear"]
    y.sum().backward()  # W4A16 passes the bias a gradient, as README's Gradients section says
    assert model[0].bias.grad is not None and model[1].bias.grad is not None
    frozen = nn.Linear(32, 32).requires_grad_(False)
    assert not nv.NVFP4Linear.from_linear(frozen, "bf16").bias.requires_grad


def test_convert_skips_linears_a_transformer_layer_reads_directly():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 128, batch_first=True).eval()
    report = nv.convert(layer, nv.Config(activations="bf16"))
    assert report.converted == []
    assert report.skipped["linear1"] == "its parent (TransformerEncoderLayer) reads its .weight directly"
    with torch.no_grad():  # the fast path
        assert layer(torch.randn(2, 5, 64)).shape == (2, 5, 64)


def test_nvfp4_linear_checks_its_arguments():
    q = nv.quantize(torch.randn(32, 64))
    with pytest.raises(TypeError, match="weight must be an nvfp4_inductor.NVFP4"):
        nv.NVFP4Linear(torch.randn(32, 64), None)
    with pytest.raises(ValueError, match="weight must be a 2-D"):
        nv.NVFP4Linear(nv.quantize(torch.randn(2, 32, 64)), None)
    with pytest.raises(ValueError, match="activations must be one of"):
        nv.NVFP4Linear(q, None, "bf-16")
    with pytest.raises(ValueError, match="activations must be one of"):
        nv.NVFP4Linear.from_linear(nn.Linear(64, 32), "bf-16")
    with pytest.raises(TypeError, match="skip_output_head must be a bool"):
        nv.Config(skip_output_head="no")
    with pytest.raises(ValueError, match="min_weight_numel must be an int"):
        nv.Config(min_weight_numel=True)
    with pytest.raises(TypeError, match="config must be an nvfp4_inductor.Config"):
        nv.compile(nn.Linear(64, 32), {"activations": "bf16"})


@pytest.mark.parametrize("k", [80, 112, 128, 48])
def test_nvfp4_linear_refuses_x_of_another_width(k):
    """x whose last dimension is not in_features (96, tiled to 128 columns): a ValueError, as
    nn.Linear raises, also for widths the tiled weight's padding would take."""
    layer = nv.NVFP4Linear.from_linear(nn.Linear(96, 64), "bf16")
    layer(torch.randn(3, 96))
    with pytest.raises(ValueError, match=f"x has {k} features .* in_features = 96"):
        layer(torch.randn(3, k))


def test_nvfp4_linear_holds_the_tiled_layout_and_saves_the_interchange_one():
    """The module's buffers are the tiled layout the decode GEMM reads; its state dict is the
    checkpoint's (N, K/2) codes and (N, K/16) e4m3 scales, bit for bit, and loads back tiled.
    Codes without their scales (or the reverse) are refused."""
    from nvfp4_inductor.reference import tiled

    torch.manual_seed(3)
    q = nv.quantize(torch.randn(80, 96))  # N and K not multiples of the 64 x 64 tile
    layer = nv.NVFP4Linear(q, None, "bf16")
    want_data, want_scale = tiled.tile(q.data, q.scale.view(torch.uint8))
    assert torch.equal(layer.weight, want_data) and torch.equal(layer.weight_scale, want_scale)
    state = layer.state_dict()
    assert torch.equal(state["weight"], q.data)
    assert state["weight_scale"].dtype == torch.float8_e4m3fn
    assert torch.equal(state["weight_scale"].view(torch.uint8), q.scale.view(torch.uint8))
    other = nv.NVFP4Linear(nv.quantize(torch.randn(80, 96)), None, "bf16")
    other.load_state_dict(state)
    assert torch.equal(other.weight, layer.weight) and torch.equal(other.weight_scale, layer.weight_scale)
    with pytest.raises(RuntimeError, match="weight was given without weight_scale"):
        other.load_state_dict({"weight": state["weight"], "weight_scale_2": state["weight_scale_2"]},
                              strict=False)
    x = torch.randn(5, 96, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(layer(x), nv.linear(x, q))


@pytest.mark.parametrize("backend", ["inductor", "nvfp4"])
def test_a_converted_model_compiles_to_the_tiled_gemm_with_either_backend(backend):
    """torch.compile with the default backend keeps the module's op, which is the tiled GEMM's
    (no row-major copy, no retiling); backend="nvfp4" takes the same weights as they are."""
    from torch._inductor.utils import run_and_get_code

    model = _model()
    nv.convert(model, nv.Config(activations="bf16"))
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    torch._dynamo.reset()
    with torch.no_grad():
        want = model(x)
        got, code = run_and_get_code(torch.compile(model, backend=backend), x)
    torch._dynamo.reset()
    code = "\n".join(code)
    assert code.count("torch.ops.nvfp4.linear_tiled.default(") == 2 and "nvfp4.linear.default" not in code
    assert "tile_weight" not in code
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0.02 * b.abs().max().item())


def test_nvfp4_linear_backward_through_the_tiled_op():
    """W4A16: the bias trains and x gets dL/dy @ W (W dequantized), as nn.Linear's would."""
    torch.manual_seed(4)
    linear = nn.Linear(64, 32)
    layer = nv.NVFP4Linear.from_linear(linear, "bf16")
    x = torch.randn(3, 64, requires_grad=True)
    layer(x).sum().backward()
    w = layer.nvfp4_weight().dequantize(torch.float32)
    torch.testing.assert_close(x.grad, torch.ones(3, 32) @ w)
    torch.testing.assert_close(layer.bias.grad, torch.full((32,), 3.0))


@pytest.mark.gpu
@pytest.mark.parametrize("activations, static", [("bf16", False), ("nvfp4", False), ("nvfp4", True)])
@pytest.mark.parametrize("m", [1, 5, 70])
def test_eager_nvfp4_linear_on_cuda_is_the_op(activations, static, m):
    """NVFP4Linear's eager CUDA call (the kernel launched without the op's dispatch) gives the
    op's result bit for bit, with gradients on or off, and stays close to the reference."""
    torch.manual_seed(m)
    layer = nv.NVFP4Linear.from_linear(nn.Linear(256, 192), activations).cuda()
    if static:
        layer.set_input_scale(torch.tensor(0.01))
    x = torch.randn(m, 256, device="cuda", dtype=torch.bfloat16)
    g = layer.weight_scale_2
    with torch.no_grad():
        got = layer(x)
        if static:
            values, x_scale = torch.ops.nvfp4.quantize_values(x, layer.input_scale)
            want = torch.ops.nvfp4.linear_tiled(values.to(x.dtype), layer.weight, layer.weight_scale, g * x_scale,
                                                layer.bias, 192, "bf16")
        else:
            want = torch.ops.nvfp4.linear_tiled(x, layer.weight, layer.weight_scale, g, layer.bias, 192, activations)
    assert torch.equal(got, want)
    assert torch.equal(layer(x), want)  # the op's path (the bias requires grad)
    ref = nv.linear(x.cpu(), layer.cpu().nvfp4_weight(), layer.bias.detach(), activations=activations,
                    x_global_scale=layer.input_scale)
    torch.testing.assert_close(got.cpu().float(), ref.float(), rtol=0.02, atol=0.02 * ref.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("bias", [True, False])
def test_eager_nvfp4_linear_binds_its_launches(bias):
    """After an x's first call, NVFP4Linear launches the kernel bound to it for that form of x
    (shape, strides, dtype, alignment): fresh xs of each form give the op's result bit for bit, on
    the current stream or another one, and under a CUDA-graph capture (not bound: the op's launch);
    loading other weights, a new bias or a move drops the bound launches."""
    torch.manual_seed(1)
    layer = nv.NVFP4Linear.from_linear(nn.Linear(256, 192, bias=bias), "bf16").cuda()

    def want(x):
        return torch.ops.nvfp4.linear_tiled(x, layer.weight, layer.weight_scale, layer.weight_scale_2, layer.bias,
                                            192, "bf16")

    def xs(shape, offset=0):
        flat = torch.randn(int(torch.tensor(shape).prod()) + offset, device="cuda", dtype=torch.bfloat16)
        return flat[offset:].view(shape)

    with torch.no_grad():
        for shape, offset in [((1, 256), 0), ((1, 1, 256), 0), ((3, 256), 0), ((2, 4, 256), 0), ((1, 256), 2),
                              ((64, 256), 0)]:
            for _ in range(3):
                x = xs(shape, offset)
                assert torch.equal(layer(x), want(x)), (shape, offset)
        assert sum(bound is not None for bound in layer._bound.values()) == 6
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            x = xs((1, 256))
            got = layer(x)
        stream.synchronize()
        assert torch.equal(got, want(x))
        x = xs((1, 256))
        graph = torch.cuda.CUDAGraph()
        layer(x)  # (warm-up on this stream)
        with torch.cuda.graph(graph):
            captured = layer(x)
        x.copy_(xs((1, 256)))
        graph.replay()
        assert torch.equal(captured, want(x))
        other = nv.NVFP4Linear.from_linear(nn.Linear(256, 192, bias=bias), "bf16")
        layer.load_state_dict(other.state_dict())
        x = xs((1, 256))
        assert torch.equal(layer(x), want(x))
        if bias:
            layer.bias = nn.Parameter(torch.randn(192, device="cuda"))
            assert not layer._bound
            assert torch.equal(layer(x), want(x))
        layer.cpu().cuda()
        assert not layer._bound
        assert torch.equal(layer(x), want(x))
