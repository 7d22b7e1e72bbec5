"""backend="nvfp4" on the CPU: found by name, linears rewritten and quantized once at compile time,
numerics equal to the eager NVFP4 reference, clear fall-backs."""

import copy
import logging
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

import nvfp4_inductor as nv
from nvfp4_inductor.lowerings.backend import nvfp4_backend

from helpers.gemm import TEMPLATE_MARK


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(64, 128)
        self.down = nn.Linear(128, 64, bias=False)
        self.lm_head = nn.Linear(64, 32)

    def forward(self, x):
        return self.lm_head(self.down(torch.relu(self.up(x))))


def _block(seed=0):
    torch.manual_seed(seed)
    return Block().to(torch.bfloat16).eval()


def _eager_nvfp4(model, x):
    """The model with up / down in NVFP4 (W4A16) and the head in bf16, eagerly."""
    with torch.no_grad():
        h = nv.linear(x, nv.quantize(model.up.weight), model.up.bias)
        return model.lm_head(nv.linear(torch.relu(h), nv.quantize(model.down.weight)))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_backend_is_found_by_name():
    assert "nvfp4" in torch._dynamo.list_backends(exclude_tags=())
    assert torch._dynamo.lookup_backend("nvfp4") is nvfp4_backend


def test_linears_become_nvfp4_quantized_once(caplog):
    model = _block()
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    compiled = nv.compile(model, nv.Config(activations="bf16"))
    with caplog.at_level(logging.INFO, logger="nvfp4_inductor"):
        y, code = run_and_get_code(compiled, x)
    assert torch.equal(y, _eager_nvfp4(model, x))
    source = "\n".join(code)
    assert source.count("torch.ops.nvfp4.linear_tiled.default(") == 2  # up, down; the head stays bf16
    # weights were quantized and tiled at compile time
    assert "torch.ops.nvfp4.quantize" not in source and "tile_weight" not in source
    assert "converted 2 linear weights, skipped 1" in caplog.text
    assert "output head" in caplog.text
    # Another batch size recompiles; the weights are again frozen constants, not requantized.
    x2 = torch.randn(9, 64, dtype=torch.bfloat16)
    y2, code2 = run_and_get_code(compiled, x2)
    assert torch.equal(y2, _eager_nvfp4(model, x2))
    assert "torch.ops.nvfp4.quantize" not in "\n".join(code2)


def test_models_with_different_weights_get_their_own_weights():
    """Same graph, different weights: nothing stale from Inductor's FX graph cache. The second
    model's weights are the first's times 30: the same codes and block scales, other global
    scales (0-d constants, which Inductor inlined as literals its cache key left out)."""
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    for scale in (1.0, 30.0):
        model = _block(1)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(scale)
        counters.clear()
        assert torch.equal(nv.compile(model, nv.Config(activations="bf16"))(x),
                           _eager_nvfp4(model, x))
        torch._dynamo.reset()
    assert counters["inductor"]["fxgraph_cache_hit"] == 1  # the second compile came from the cache


class _BreakingLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(64, 64)

    def forward(self, x):
        h = self.proj(x)
        torch._dynamo.graph_break()  # Dynamo compiles this frame on its own, once per layer object
        return h * 2


def test_each_module_instance_runs_its_own_weights():
    """The frozen weights are guarded by identity: two instances of a class compiled one after the
    other, and a repeated layer whose forward has a graph break, each run their own weights (they
    ran the first instance's compiled code, with its weights)."""
    torch.manual_seed(0)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    models = [_block(seed) for seed in (1, 2)]
    for model in models:
        assert torch.equal(nv.compile(model, nv.Config(activations="bf16"))(x), _eager_nvfp4(model, x))
    torch._dynamo.reset()
    layers = nn.Sequential(_BreakingLayer(), _BreakingLayer()).to(torch.bfloat16).eval()
    got = nv.compile(layers, nv.Config(activations="bf16"))(x)
    with torch.no_grad():
        want = x
        for layer in layers:
            want = nv.linear(want, nv.quantize(layer.proj.weight), layer.proj.bias) * 2
    assert torch.equal(got, want)


def test_config_rules_apply_under_the_backend(caplog):
    model = _block()
    config = nv.Config(activations="nvfp4", skip_output_head=False, min_weight_numel=64 * 128 + 1)
    with caplog.at_level(logging.INFO, logger="nvfp4_inductor"):
        y, code = run_and_get_code(nv.compile(model, config), torch.randn(2, 64, dtype=torch.bfloat16))
    assert "converted 0 linear weights, skipped 3" in caplog.text
    assert "torch.ops.nvfp4.linear" not in "\n".join(code)


class _Chain(nn.Module):
    """Linears fed straight by linears: a -> b, and a -> (c, d), which merge into one GEMM."""

    def __init__(self, bias):
        super().__init__()
        self.a, self.b = nn.Linear(64, 64, bias=bias), nn.Linear(64, 64, bias=bias)
        self.c, self.d = nn.Linear(64, 64, bias=bias), nn.Linear(64, 64, bias=bias)

    def forward(self, x):
        h = self.a(x)
        return self.b(h), self.c(h), self.d(h)


@pytest.mark.parametrize("bias", [True, False])
def test_linears_fed_by_linears(bias):
    """The rewrite reads each linear's x as the graph has it when it converts that linear (it had
    kept the node of the earlier, replaced linear: 'used before it has been defined')."""
    torch.manual_seed(0)
    model = _Chain(bias).to(torch.bfloat16).eval()
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    got = nv.compile(model, nv.Config(activations="bf16"))(x)
    with torch.no_grad():
        h = nv.linear(x, nv.quantize(model.a.weight), model.a.bias)
        want = [nv.linear(h, nv.quantize(m.weight), m.bias) for m in (model.b, model.c, model.d)]
    for g, w in zip(got, want):
        assert torch.equal(g, w)


class _TiedHead(nn.Module):
    """An output head tied to the embedding (GPT-2 style), and a weight held as a buffer."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(128, 64)
        self.lm_head = nn.Linear(64, 128, bias=False)
        self.lm_head.weight = self.emb.weight
        self.register_buffer("proj", torch.randn(64, 64))

    def forward(self, tokens):
        return self.lm_head(F.linear(self.emb(tokens), self.proj))


def test_tied_weights_and_buffer_weights_follow_config(caplog):
    """A weight the graph also reads elsewhere (the embedding) stays bf16, as convert() leaves it;
    a weight held as a buffer obeys Config like a parameter (include rejected it here)."""
    torch.manual_seed(0)
    model = _TiedHead().to(torch.bfloat16).eval()
    tokens = torch.randint(0, 128, (2, 3))
    with caplog.at_level(logging.INFO, logger="nvfp4_inductor"):
        got = nv.compile(model, nv.Config(activations="bf16", include=lambda name, m: False))(tokens)
    assert "converted 0 linear weights, skipped 2" in caplog.text
    assert "(tied)" in caplog.text and "excluded by Config.include" in caplog.text
    with torch.no_grad():
        assert torch.allclose(got.float(), model(tokens).float(), rtol=2e-2, atol=2e-2)


class _OddAddmm(nn.Module):
    """addmm with an added term that is not a (N,) bias, and a merged pair (x of 4 rows) whose
    biases are computed in the graph."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(64, 64) / 8)
        self.c = nn.Parameter(torch.randn(4, 64))
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x):
        y = torch.addmm(self.c, x, self.w.t())
        return y, self.a(x), F.linear(x, self.b.weight, self.b.bias * 2)


def test_addmm_with_other_added_terms_and_computed_biases():
    torch.manual_seed(0)
    model = _OddAddmm().to(torch.bfloat16).eval()
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    y, a, b = nv.compile(model, nv.Config(activations="bf16"))(x)
    with torch.no_grad():
        assert torch.allclose(y.float(), torch.addmm(model.c, x, model.w.t()).float(), rtol=1e-2, atol=1e-2)
        assert torch.equal(a, nv.linear(x, nv.quantize(model.a.weight), model.a.bias))
        assert torch.equal(b, nv.linear(x, nv.quantize(model.b.weight), model.b.bias * 2))


def test_merged_linears_return_their_own_tensors():
    """b / c / d merged into one GEMM (N = 192): each output the graph returns is contiguous, as
    eager's, and holds that linear's numbers."""
    torch.manual_seed(0)
    model = _Chain(True).to(torch.bfloat16).eval()
    x = torch.randn(1, 3, 64, dtype=torch.bfloat16)
    outs, code = _compiled_code(model, x)
    assert "192, 'bf16', None, 0.0)" in "\n".join(code)
    with torch.no_grad():
        h = nv.linear(x, nv.quantize(model.a.weight), model.a.bias)
        want = [nv.linear(h, nv.quantize(m.weight), m.bias) for m in (model.b, model.c, model.d)]
    for out, w in zip(outs, want):
        assert out.is_contiguous() and out.shape == (1, 3, 64) and torch.equal(out, w)


class _QK(nn.Module):
    """Two linears on one x (merged at decode), returned through views that are not reshapes."""

    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(64, 128, bias=False), nn.Linear(64, 64, bias=False)

    def forward(self, x):
        return self.q(x).unsqueeze(0), self.k(x).t(), self.k(x)[1:]


def test_merged_linears_returned_through_any_view_are_their_own_tensors():
    """Outputs that reach the graph's output through permute / unsqueeze / slice / select shared
    the merged GEMM's storage with its strides (q.view(-1) raised)."""
    torch.manual_seed(0)
    model = _QK().to(torch.bfloat16).eval()
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    got = nv.compile(model, nv.Config(activations="bf16"))(x)
    with torch.no_grad():
        want = model(x)
    storages = {t.untyped_storage().data_ptr() for t in got}
    assert len(storages) >= 2  # the k outputs may share one tensor; q is its own
    assert got[0].untyped_storage().data_ptr() not in {t.untyped_storage().data_ptr() for t in got[1:]}
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.stride() == w.stride()
    assert got[0].view(-1).shape == (3 * 128,)
    assert torch.equal(got[0], nv.linear(x, nv.quantize(model.q.weight)).unsqueeze(0))


def test_backend_judges_layers_by_module_path(caplog):
    """Output heads by the last component of the module path, as convert() judges them: mlm_head
    and pre_classifier are hidden layers; Config.include sees the module path too."""
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("pre_classifier", nn.Linear(64, 64))
    model.add_module("mlm_head", nn.Linear(64, 64))
    model.add_module("head", nn.Linear(64, 32))
    model = model.to(torch.bfloat16).eval()
    seen = []
    config = nv.Config(activations="bf16", include=lambda name, m: seen.append(name) or True)
    with caplog.at_level(logging.INFO, logger="nvfp4_inductor"):
        nv.compile(model, config)(torch.randn(2, 64, dtype=torch.bfloat16))
    assert "converted 2 linear weights, skipped 1" in caplog.text
    assert sorted(seen) == ["mlm_head", "pre_classifier"]


@pytest.mark.parametrize("mode, fullgraph", [(None, False), ("reduce-overhead", True), ("max-autotune", False)])
def test_plain_torch_compile_quantizes(mode, fullgraph):
    """torch.compile(model, backend="nvfp4") with nothing else set: the parameters arrive as graph
    inputs (Dynamo's default) and the backend makes them constants of the graph it compiles: NVFP4
    ops in the code, no warning, the result of nv.compile."""
    model = _block()
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*without NVFP4")
        y, code = run_and_get_code(torch.compile(model, backend="nvfp4", mode=mode, fullgraph=fullgraph), x)
    assert "torch.ops.nvfp4.linear_tiled" in "\n".join(code)
    torch._dynamo.reset()
    assert torch.equal(y, nv.compile(model)(x))


class BufferWeight(nn.Module):
    """A linear whose weight is a buffer (no parameters at all)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("w", torch.randn(64, 64, dtype=torch.bfloat16))

    def forward(self, x):
        return torch.nn.functional.linear(x, self.w)


def test_plain_torch_compile_quantizes_a_weight_in_a_buffer():
    torch.manual_seed(0)
    model = BufferWeight().eval()
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    want = nv.linear(x, nv.quantize(model.w))
    with torch.no_grad():
        assert torch.equal(torch.compile(model, backend="nvfp4")(x), want)
        torch._dynamo.reset()
        assert torch.equal(nv.compile(model, nv.Config(activations="bf16"))(x), want)  # frozen: NVFP4


def test_plain_torch_compile_never_runs_stale_weights():
    """A weight changed in place (load_state_dict, an optimizer step) or replaced after compiling:
    the compiled function sees it and compiles for it; calls with the old weights again take the
    graph compiled for them."""
    model = _block()
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    compiled = torch.compile(model, backend="nvfp4")

    def fresh():
        torch._dynamo.reset()
        return nv.compile(model)(x)

    with torch.no_grad():
        compiled(x)
        model.load_state_dict({k: v * 0.5 for k, v in model.state_dict().items()})
        want = fresh()
        assert torch.equal(compiled(x), want)
        first = model.up
        first.weight.mul_(-1)  # an in-place edit
        want = fresh()
        assert torch.equal(compiled(x), want)
        first.weight = nn.Parameter(torch.randn_like(first.weight) * 0.05)  # a replaced parameter
        want = fresh()
        assert torch.equal(compiled(x), want)


class RepeatedLayers(nn.Module):
    """Two instances of one layer class whose forward breaks the graph: Dynamo compiles the layer's
    frame once and runs it for both (its weights as graph inputs)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = _broken_linear(layer, x)
        return x


def _broken_linear(layer, x):
    x = layer(x)
    torch._dynamo.graph_break()
    return torch.relu(x)


def test_each_module_instance_runs_its_own_weights_under_plain_torch_compile():
    torch.manual_seed(5)
    model = RepeatedLayers().to(torch.bfloat16).eval()
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    want = x
    for layer in model.layers:
        want = torch.relu(nv.linear(want, nv.quantize(layer.weight), layer.bias))
    torch._dynamo.reset()
    with torch.no_grad():
        assert torch.equal(torch.compile(model, backend="nvfp4")(x), want)


class WrittenBuffer(nn.Module):
    """A linear and a 2-D buffer the forward writes (a cache): the buffer must stay an input."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(64, 64)
        self.register_buffer("cache", torch.zeros(4, 64))

    def forward(self, x):
        y = self.linear(x)
        self.cache[: y.shape[0]].copy_(y.float())
        return y


def test_a_buffer_the_graph_writes_stays_an_input():
    torch.manual_seed(6)
    model = WrittenBuffer().to(torch.bfloat16).eval()
    model.cache = model.cache.float()
    compiled = torch.compile(model, backend="nvfp4")
    with torch.no_grad():
        for scale in (1.0, 2.0):
            x = torch.randn(2, 64, dtype=torch.bfloat16) * scale
            y = compiled(x)
            assert torch.equal(model.cache[:2], y.float())  # written through, every call


def test_grad_enabled_warns_and_keeps_bf16():
    model = _block()
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    with torch._dynamo.config.patch(prepare_freezing=True), pytest.warns(UserWarning, match="gradients are enabled"):
        y = torch.compile(model, backend="nvfp4")(x)
    with torch.no_grad():
        assert torch.equal(y, model(x))


def test_modes_options_and_bad_config():
    model = _block()
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    for mode in ("default", "reduce-overhead", "max-autotune-no-cudagraphs"):
        torch._dynamo.reset()
        assert torch.equal(nv.compile(model, nv.Config(activations="bf16"), mode=mode)(x),
                           _eager_nvfp4(model, x))
    torch._dynamo.reset()
    with pytest.raises(Exception, match="must be an nvfp4_inductor.Config"):
        torch.compile(model, backend="nvfp4", options={"nvfp4": "bf16"})(x)
    # nv.compile takes the Config as torch.compile's options carry it too (it was dropped for the
    # default Config), and a Config given both ways is an error
    torch._dynamo.reset()
    every_layer = nv.Config(activations="bf16", skip_output_head=False)  # not the default Config
    with torch.no_grad():
        h = nv.linear(torch.relu(nv.linear(x, nv.quantize(model.up.weight), model.up.bias)),
                      nv.quantize(model.down.weight))
        want = nv.linear(h, nv.quantize(model.lm_head.weight), model.lm_head.bias)
    assert torch.equal(nv.compile(model, options={"nvfp4": every_layer})(x), want)
    with pytest.raises(TypeError, match="must be an nvfp4_inductor.Config"):
        nv.compile(model, options={"nvfp4": "bf16"})
    with pytest.raises(ValueError, match="a Config given twice"):
        nv.compile(model, nv.Config(), options={"nvfp4": nv.Config()})


def test_inductor_options_are_checked_at_once():
    """options as torch.compile's Inductor wrapper takes them ("_" or "-" spelled, values of the
    option's type), checked when compiling is asked for, not at the first call; mode="lite" (or
    options turning the joint-graph passes off) compiled in bf16 without a word."""
    model = _block()
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    torch._dynamo.reset()
    assert torch.equal(nv.compile(model, nv.Config(activations="bf16"), options={"max-autotune": False})(x),
                       _eager_nvfp4(model, x))
    bad = [({"max_autotune": "no"}, TypeError, r"options\['max_autotune'\] must be a bool"),
           ({"not_an_option": 1}, ValueError, "'not_an_option' is not an Inductor config option"),
           ("max_autotune", TypeError, "options must be a dict"),
           ({"use_joint_graph_passes": False}, ValueError, "needs .* for its rewrite of the linears")]
    for options, error, match in bad:
        with pytest.raises(error, match=match):
            nv.compile(model, options=options)
    try:  # (torch 2.13 has mode="lite"; older versions may not)
        lite = torch._inductor.list_mode_options("lite")
    except Exception:
        lite = {}
    if lite.get("use_joint_graph_passes") is False:
        with pytest.raises(ValueError, match="mode='lite'"):
            nv.compile(model, mode="lite")
    torch._dynamo.reset()
    with torch.no_grad(), torch._inductor.config.patch(freezing=True), \
            pytest.raises(Exception, match="is not an Inductor config option"):
        torch.compile(model, backend="nvfp4", options={"not_an_option": 1})(x)


def test_converted_model_compiles_through_the_backend(caplog):
    model = _block()
    nv.convert(model, nv.Config(activations="bf16"))
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="nvfp4_inductor"):
        y, code = run_and_get_code(nv.compile(model), x)
    with torch.no_grad():
        assert torch.equal(y, model(x))
    # the converted layers hold the tiled layout already: their GEMMs take the weights as they are
    source = "\n".join(code)
    assert source.count("torch.ops.nvfp4.linear_tiled.default(") == 2
    assert "torch.ops.nvfp4.linear.default(" not in source and "tile_weight" not in source
    assert "moved to the tiled layout" not in caplog.text


def test_three_dimensional_inputs_and_fp32_models():
    model = _block()
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    y, code = run_and_get_code(nv.compile(model, nv.Config(activations="bf16")), x)
    assert torch.equal(y, _eager_nvfp4(model, x))
    assert "torch.ops.nvfp4.linear_tiled.default(" in "\n".join(code)
    torch._dynamo.reset()
    model32 = _block().float()
    x32 = torch.randn(3, 64)
    assert torch.equal(nv.compile(model32, nv.Config(activations="nvfp4"))(x32),
                       model32.lm_head(nv.linear(torch.relu(nv.linear(
                           x32, nv.quantize(model32.up.weight), model32.up.bias,
                           activations="nvfp4")), nv.quantize(model32.down.weight),
                           activations="nvfp4")).detach())


def test_fx_graph_cache_is_not_bypassed():
    # A custom pass without uuid() makes Inductor bypass its FX graph cache.
    from torch._dynamo.utils import counters

    counters.clear()
    model = _block()
    nv.compile(model, nv.Config(activations="bf16"))(torch.randn(4, 64, dtype=torch.bfloat16))
    seen = dict(counters["inductor"])
    assert seen.get("fxgraph_cache_bypass", 0) == 0, seen
    assert seen.get("fxgraph_cache_miss", 0) + seen.get("fxgraph_cache_hit", 0) >= 1, seen


def test_fx_graph_cache_keys_on_the_template_source():
    """The Inductor template's text makes the generated code: the pass's uuid hashes it with the
    package's Python files (a changed template must not be served from an older cache entry)."""
    from nvfp4_inductor.lowerings.passes import linear as rewrite

    assert any(path.endswith("nvfp4_tiled_gemm.py.jinja") for path in rewrite._PACKAGE_FILES)


def test_fx_graph_cache_keys_on_the_sources_and_the_pass_options():
    """The pass's uuid keys the FX graph cache on the package's sources (the planner's tables as
    written) and the options that change the rewrite, and on nothing else: a new module constant is
    not a cache knob. A fresh cache misses, then the same graph hits."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import fresh_cache

    from nvfp4_inductor.lowerings.passes.linear import LinearToNVFP4

    key = LinearToNVFP4("bf16", []).uuid()
    assert LinearToNVFP4("bf16", []).uuid() == key and LinearToNVFP4("nvfp4", []).uuid() != key
    model = _block()
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    with fresh_cache():
        for expect in ("fxgraph_cache_miss", "fxgraph_cache_hit"):
            torch._dynamo.reset()
            counters.clear()
            nv.compile(model, nv.Config(activations="bf16"))(x)
            seen = dict(counters["inductor"])
            assert seen.get(expect, 0) >= 1, (expect, seen)
    torch._dynamo.reset()


@pytest.mark.parametrize("device, options, pdl", [
    ("cuda", {}, True), ("cuda", {"triton.enable_pdl": False}, False), ("cpu", {}, None)])
def test_inductor_options_the_backend_sets(monkeypatch, device, options, pdl):
    """Programmatic dependent launch on for graphs on CUDA unless the options say otherwise (not
    set for CPU graphs); mkldnn weight prepacking off for every graph (Inductor registers its
    patterns once per process, at the first freezing compile with it on, and applies them to later
    CPU graphs whatever the option says). Fake CUDA inputs: no GPU needed to see the patches."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from nvfp4_inductor.lowerings import compat as _compat

    seen = {}
    monkeypatch.setattr(_compat, "compile_fx",
                        lambda gm, inputs, config_patches: seen.update(config_patches) or gm)
    gm = torch.fx.symbolic_trace(nn.ReLU())
    with FakeTensorMode():
        x = torch.empty(2, 16, device=device)
    with torch.no_grad():
        nvfp4_backend(gm, [x], options={**options, "nvfp4": nv.Config(activations="bf16")})
    assert seen["cpp.weight_prepack"] is False and seen["freezing"] is True
    if _compat.pdl_option() is not None:
        assert seen.get("triton.enable_pdl") is pdl


def test_pdl_for_a_cuda_graph_without_tensor_inputs(monkeypatch):
    """The device is the module's tensors' where the graph has no tensor inputs (a decode step
    that keeps its token and position in buffers)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from nvfp4_inductor.lowerings import compat as _compat

    seen = {}
    monkeypatch.setattr(_compat, "compile_fx",
                        lambda gm, inputs, config_patches: seen.update(config_patches) or gm)
    gm = torch.fx.symbolic_trace(nn.ReLU())
    with FakeTensorMode():
        gm.register_buffer("pos", torch.zeros(1, device="cuda"))
    with torch.no_grad():
        nvfp4_backend(gm, [], options={"nvfp4": nv.Config(activations="bf16")})
    if _compat.pdl_option() is not None:
        assert seen.get("triton.enable_pdl") is True


class BufferStep(nn.Module):
    """A decode-like step with no tensor inputs: reads and advances its own buffers."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(64, 64)
        self.register_buffer("x", torch.randn(2, 64))
        self.register_buffer("count", torch.zeros(1, dtype=torch.long))

    def forward(self):
        self.x.copy_(torch.tanh(self.linear(self.x)))
        self.count.add_(1)


def test_rebuilt_graph_keeps_dynamo_metadata():
    """torch 2.11's pre-grad passes rebuild a graph that has no tensor inputs (with freezing on,
    they take it for a CPU graph) as a new module without Dynamo's metadata; AOTAutograd then
    marked none of its inputs static, and CUDA graphs were skipped for the mutated buffers (the
    GPU test below, on torch 2.11). torch 2.13 reads the metadata before those passes, so here
    the shim is checked on its own: the rebuilt module gets the metadata back."""
    from nvfp4_inductor.lowerings import compat as _compat

    gm = torch.fx.symbolic_trace(nn.ReLU())
    gm.meta["dynamo_compile_id"] = "0/0"
    gm._param_name_to_source = {"weight": "L['self'].weight"}
    (placeholder,) = gm.graph.find_nodes(op="placeholder")
    placeholder._dynamo_source = "L['x']"

    def rebuild(graph_module, inputs, rename=False):
        graph = copy.deepcopy(graph_module.graph)  # new nodes, without the source attribute
        if rename:
            next(iter(graph.find_nodes(op="placeholder"))).name = "y"
        out = torch.fx.GraphModule(graph_module, graph)
        out.meta = {"pre_grad": True}
        out.__dict__.pop("_param_name_to_source", None)
        return out

    out = _compat._keeping_dynamo_metadata(rebuild)(gm, [])
    assert out is not gm
    assert out.meta == {"pre_grad": True, "dynamo_compile_id": "0/0"}
    assert out._param_name_to_source == gm._param_name_to_source
    assert next(iter(out.graph.find_nodes(op="placeholder")))._dynamo_source == "L['x']"
    # other placeholders: not the same graph's inputs, left alone
    other = _compat._keeping_dynamo_metadata(lambda g, i: rebuild(g, i, rename=True))(gm, [])
    assert "dynamo_compile_id" not in other.meta and not hasattr(other, "_param_name_to_source")
    assert _compat._keeping_dynamo_metadata(lambda graph_module, inputs: graph_module)(gm, []) is gm



def test_frozen_graph_keeps_its_static_inputs():
    """A cache the graph writes, marked static (mark_static_address, as Hugging Face's static
    cache is): freezing drops the static indices of every input but the parameters it keeps, so
    the inner compile would take the written cache for a mutated non-static input (CUDA graphs
    skipped for the graph). The backend hands them back at their frozen positions."""
    from unittest import mock

    from nvfp4_inductor.lowerings import compat as _compat

    class Step(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(64, 64)

        def forward(self, x, cache, position):
            cache.index_copy_(0, position, self.proj(x))
            return cache.sum(0)

    torch.manual_seed(0)
    model = Step().to(torch.bfloat16).eval()
    cache = torch.zeros(8, 64, dtype=torch.bfloat16)
    torch._dynamo.mark_static_address(cache)
    inner = _compat._compile_fx_module.compile_fx_inner
    seen = []

    def record(graph, inputs, **kwargs):
        seen.append((list(inputs), list(kwargs.get("static_input_idxs") or ())))
        return inner(graph, inputs, **kwargs)

    torch._dynamo.reset()
    x, position = torch.randn(1, 64, dtype=torch.bfloat16), torch.tensor([3])
    with torch.no_grad(), mock.patch.object(_compat._compile_fx_module, "compile_fx_inner", record):
        torch.compile(model, backend="nvfp4")(x, cache, position)
    torch._dynamo.reset()
    ((inputs, static),) = seen
    positions = [i for i, t in enumerate(inputs) if tuple(t.shape) == tuple(cache.shape)]
    assert positions and set(positions) <= set(static), (positions, static)
    assert all(tuple(inputs[i].shape) == tuple(cache.shape) for i in static)  # x and position are not


def test_compat_shims_take_the_other_torch_versions_branch(monkeypatch):
    """The _compat branches this torch does not take, each with the other version's API stood in:
    autotune_select_algorithm's bare node (2.11) or (node, choice) (2.13), a Dynamo without the
    callback API it expects, and a TritonTemplate.generate without triton_meta (before PR 174292)."""
    from torch._inductor.select_algorithm import TritonTemplate

    from nvfp4_inductor.lowerings import compat as _compat

    node, choice = object(), object()
    assert _compat.selected_node(node) is node and _compat.selected_node((node, choice)) is node

    def generate(self, input_nodes, layout, num_stages, num_warps, **kwargs): ...

    monkeypatch.setattr(TritonTemplate, "generate", generate)
    assert not _compat.template_launch_options()
    monkeypatch.setattr(TritonTemplate, "generate", lambda self, input_nodes, triton_meta=None: None)
    assert _compat.template_launch_options()

def _check_buffer_steps(device, mode, steps):
    """BufferStep compiled by the backend, `steps` calls, against the same steps eagerly."""
    torch.manual_seed(0)
    step, reference = (BufferStep().to(torch.bfloat16).to(device) for _ in range(2))
    reference.load_state_dict(step.state_dict())
    compiled = nv.compile(step, nv.Config(activations="bf16"), mode=mode)
    skips = counters["inductor"]["cudagraph_skips"]
    for _ in range(steps):
        torch.compiler.cudagraph_mark_step_begin()
        compiled()
    assert counters["inductor"]["cudagraph_skips"] == skips and int(step.count) == steps
    with torch.no_grad():
        for _ in range(steps):
            h = nv.linear(reference.x, nv.quantize(reference.linear.weight), reference.linear.bias)
            reference.x.copy_(torch.tanh(h))
    torch.testing.assert_close(step.x, reference.x, rtol=2e-2, atol=2e-2)


def test_buffer_step_under_the_backend():
    _check_buffer_steps("cpu", None, 3)


@pytest.mark.gpu
def test_buffer_step_replays_in_a_cuda_graph():
    """A step with no tensor inputs that mutates its buffers runs as a CUDA graph under the
    backend (torch 2.11 skipped it: "mutated inputs"), and gives eager's results."""
    _check_buffer_steps("cuda", "reduce-overhead", 5)  # compile, warm up, record, replay


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
@pytest.mark.parametrize("entry", ["nv.compile", "torch.compile"])
def test_backend_on_cuda(mode, entry):
    """nv.compile and plain torch.compile(backend="nvfp4") (weights as graph inputs) alike: the
    NVFP4 GEMM template, CUDA graphs with no skips, eager NVFP4's results."""
    torch._dynamo.reset()
    model = _block().cuda()
    x = torch.randn(4, 64, dtype=torch.bfloat16, device="cuda")
    if entry == "nv.compile":
        compiled = nv.compile(model, nv.Config(activations="bf16"), mode=mode)
    else:
        plain = torch.compile(model, backend="nvfp4", mode=None if mode == "default" else mode)

        def compiled(x):
            with torch.no_grad():
                return plain(x)
    skips = counters["inductor"]["cudagraph_skips"]
    y, code = run_and_get_code(compiled, x)  # the first call compiles
    source = "\n".join(code)
    # the linears became the NVFP4 GEMM template (tests/lowerings/test_lowering.py), not the eager op
    assert TEMPLATE_MARK in source and "torch.ops.nvfp4.linear_tiled.default(" not in source
    for _ in range(2):  # reduce-overhead: record, then replay
        y = compiled(x)
    assert counters["inductor"]["cudagraph_skips"] == skips
    torch.testing.assert_close(y, _eager_nvfp4(model, x), rtol=1e-2, atol=1e-2)


class SharedInput(nn.Module):
    """q / k / v and gate / up: linears reading the same input (with and without biases)."""

    def __init__(self, width=64):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(64, 128), nn.Linear(64, 64), nn.Linear(64, width)
        self.gate, self.up = nn.Linear(64, 192, bias=False), nn.Linear(64, 192, bias=False)
        self.down = nn.Linear(192, 64, bias=False)

    def forward(self, x):
        h = x + self.q(x)[..., :64] * self.k(x) + self.v(x)[..., :64]
        return self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))


def _compiled_code(model, x, **config):
    torch._dynamo.reset()
    return run_and_get_code(nv.compile(model, nv.Config(activations="bf16", **config)), x)


def test_linears_reading_one_input_merge_into_one_gemm(caplog):
    torch.manual_seed(0)
    model = SharedInput().to(torch.bfloat16).eval()
    x = torch.randn(1, 3, 64, dtype=torch.bfloat16)  # 3-D: each linear gets its own view of x
    with caplog.at_level(logging.INFO, logger="nvfp4_inductor"):
        y, code = _compiled_code(model, x)
    source = "\n".join(code)
    # q / k / v (N = 256) and gate / up (N = 384, SiLU * mul in its epilogue: 192 out) one call
    # each, down alone; the concatenation of the quantized weights was folded at compile time
    assert source.count("torch.ops.nvfp4.linear_tiled.default(") == 2
    assert source.count("torch.ops.nvfp4.linear_tiled_silu_mul.default(") == 1
    assert "256, 'bf16', None, 0.0)" in source and "192, 'bf16', None, 0.0)" in source
    assert "aten.cat" not in source and "aten.stack" not in source
    assert "merged into one GEMM each" in caplog.text and "['q.weight', 'k.weight'" in caplog.text
    y_apart, code_apart = _compiled_code(model, x, merge_linears=False)
    assert "\n".join(code_apart).count("torch.ops.nvfp4.linear_tiled.default(") == 6
    # each weight keeps its own global scale: the same linears; the gated epilogue rounds silu to
    # bf16 before the product as eager torch does, Inductor's fused SiLU * mul does not
    torch.testing.assert_close(y, y_apart, rtol=2**-6, atol=2**-6)
    with torch.no_grad():
        q = [nv.quantize(layer.weight) for layer in (model.q, model.k, model.v, model.gate, model.up, model.down)]
        h = (x + nv.linear(x, q[0], model.q.bias)[..., :64] * nv.linear(x, q[1], model.k.bias)
             + nv.linear(x, q[2], model.v.bias))
        want = nv.linear(torch.nn.functional.silu(nv.linear(h, q[3])) * nv.linear(h, q[4]), q[5])
    # Inductor rounds the fused bf16 pointwise ops around the linears once, eager at every op
    assert ((y.float() - want.float()).norm() / want.float().norm()).item() < 1e-2


def test_fp32_model_under_autocast_is_converted():
    """torch.autocast hands the GEMMs bf16 casts of the fp32 weights: those casts are quantized
    (no linear was converted, without a word)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64)).eval()
    x = torch.randn(4, 64)
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, code = run_and_get_code(nv.compile(model, nv.Config(activations="bf16")), x)
    assert "\n".join(code).count("torch.ops.nvfp4.linear_tiled.default(") == 2
    with torch.no_grad():
        def layer(i, h):
            return nv.linear(h, nv.quantize(model[i].weight.bfloat16()), model[i].bias.bfloat16())
        want = layer(2, torch.relu(layer(0, x.bfloat16())))
    assert y.dtype == torch.bfloat16 and torch.equal(y, want)


class _AutocastShapes(nn.Module):
    """Under autocast: q and k read one bf16 h (merged: their weights' casts sit after the first
    linear), and one weight shared by two linears (read through two casts)."""

    def __init__(self):
        super().__init__()
        self.inp, self.q, self.k = (nn.Linear(64, 64, bias=False) for _ in range(3))
        self.a, self.c = nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False)
        self.b = nn.Linear(64, 64, bias=False)
        self.b.weight = self.a.weight

    def forward(self, x):
        h = self.inp(x)
        return self.q(h) * self.k(h) + self.c(self.b(self.a(x)))


def test_autocast_merges_and_shared_weights_convert(caplog):
    """An fp32 model under torch.autocast: the merged q / k GEMM compiled (its quantize read the
    second weight's cast before it was defined: the compile crashed), and a weight shared by two
    linears converts as it does in a bf16 model (its parameter, read by two casts, was left bf16
    and named nowhere)."""
    torch.manual_seed(0)
    model = _AutocastShapes().eval()
    x = torch.randn(4, 64)
    with caplog.at_level(logging.INFO, logger="nvfp4_inductor"), torch.autocast("cpu", dtype=torch.bfloat16):
        y = nv.compile(model, nv.Config(activations="bf16"))(x)
    assert "converted 6 linear weights, skipped 0" in caplog.text
    assert "merged into one GEMM each: [['q.weight', 'k.weight']]" in caplog.text
    with torch.no_grad():
        def lin(m, h):
            return nv.linear(h, nv.quantize(m.weight.bfloat16()))
        xb = x.bfloat16()
        h = lin(model.inp, xb)
        want = lin(model.q, h) * lin(model.k, h) + lin(model.c, lin(model.b, lin(model.a, xb)))
    assert y.dtype == torch.bfloat16
    # Inductor rounds the fused product and sum once, eager at each op
    assert ((y.float() - want.float()).norm() / want.float().norm()).item() < 1e-2


def test_a_weight_also_read_through_its_transpose_stays_bf16(caplog):
    """W^T shared by the linear and a sum (common-subexpression elimination) is a tied weight, as
    W.sum() is: it stays bf16, with the reader named (it converted before)."""
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.W = nn.Parameter(torch.randn(64, 64))

        def forward(self, x):
            return F.linear(x, self.W) + self.W.T.sum()

    model = Model().to(torch.bfloat16).eval()
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="nvfp4_inductor"):
        y = nv.compile(model, nv.Config(activations="bf16"))(x)
    assert "converted 0 linear weights, skipped 1" in caplog.text and "(of W^T) (tied)" in caplog.text
    with torch.no_grad():
        assert torch.allclose(y.float(), model(x).float(), rtol=2e-2, atol=2e-1)


class CalledTwice(nn.Module):
    """One linear applied twice to the same x, beside another reading it."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 128)

    def forward(self, x):
        return self.a(x) * 2, self.b(x), self.a(x)


def test_a_linear_called_twice_on_one_x_enters_the_merged_gemm_once():
    torch.manual_seed(0)
    model = CalledTwice().to(torch.bfloat16).eval()
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    outs, code = _compiled_code(model, x)
    source = "\n".join(code)
    assert source.count("torch.ops.nvfp4.linear_tiled.default(") == 1
    assert "192, 'bf16', None, 0.0)" in source  # a and b, not a, b and a again
    with torch.no_grad():
        ya = nv.linear(x, nv.quantize(model.a.weight), model.a.bias)
        yb = nv.linear(x, nv.quantize(model.b.weight), model.b.bias)
    for got, want in zip(outs, (ya * 2, yb, ya)):
        assert torch.equal(got, want)
    assert outs[2].is_contiguous() and outs[2].data_ptr() != outs[1].data_ptr()


class FusedGateUp(nn.Module):
    """One bias-less gate_up projection whose output halves are sliced (a checkpoint's fused
    layout): one weight, so one per-tensor global scale for both halves."""

    def __init__(self, gate_first=True):
        super().__init__()
        self.gate_up = nn.Linear(64, 256, bias=False)
        self.gate_first = gate_first

    def forward(self, x):
        h = self.gate_up(x)
        gate, up = (h[..., :128], h[..., 128:256]) if self.gate_first else (h[..., 128:256], h[..., :128])
        return torch.nn.functional.silu(gate) * up


@pytest.mark.parametrize("shape", [(2, 64), (2, 3, 64)])
@pytest.mark.parametrize("gate_first", [True, False])
def test_a_fused_gate_up_projection_takes_the_gated_epilogue(gate_first, shape):
    """Its per-tensor global scale (0-d) goes to every interleaved row (it crashed compilation: a
    slice of a 0-d tensor). A 3-D x (the halves sliced from one view of the GEMM's rows) too: it
    ran the plain GEMM and a separate SiLU * mul."""
    torch.manual_seed(0)
    model = FusedGateUp(gate_first).to(torch.bfloat16).eval()
    x = torch.randn(shape, dtype=torch.bfloat16)
    y, code = _compiled_code(model, x)
    assert "\n".join(code).count("torch.ops.nvfp4.linear_tiled_silu_mul.default(") == 1
    with torch.no_grad():
        h = nv.linear(x, nv.quantize(model.gate_up.weight))
        gate, up = (h[..., :128], h[..., 128:]) if gate_first else (h[..., 128:], h[..., :128])
        want = nv.reference.silu_mul(gate, up)
    assert torch.equal(y, want)


@pytest.mark.parametrize("rows, width", [(65, 64), (3, 80)])
def test_linears_stay_apart_above_decode_size_or_off_the_tile(rows, width):
    """More than MERGE_MAX_M rows (prefill keeps cuBLAS's scalar alpha), or an N that is not a
    multiple of the 64-row tile (v: N = 80): only what can merge does."""
    torch.manual_seed(0)
    model = SharedInput(width).to(torch.bfloat16).eval()
    _, code = _compiled_code(model, torch.randn(rows, 64, dtype=torch.bfloat16))
    source = "\n".join(code)
    calls = source.count("torch.ops.nvfp4.linear_tiled.default(")
    gated = source.count("torch.ops.nvfp4.linear_tiled_silu_mul.default(")
    # q + k merged, v alone; gate + up merged (with SiLU * mul in its epilogue); down
    assert (calls, gated) == ((6, 0) if rows > 64 else (3, 1)), (calls, gated)


@pytest.mark.parametrize("flag", ["merge_linears", "fuse_norms"])
def test_config_flags_must_be_bools(flag):
    with pytest.raises(TypeError, match=f"{flag} must be a bool"):
        nv.Config(**{flag: "yes"})


def test_weights_made_constants_keep_dynamo_metadata(monkeypatch):
    """The graph compiled with the weight inputs as constants keeps what AOT autograd reads to find
    static inputs (CUDA graphs take a static KV cache by address and let the graph write it): each
    remaining input's source, and a source for each of the graph module's own tensors."""
    from nvfp4_inductor.lowerings import backend

    seen = []
    compile_frozen = backend._compile_frozen
    monkeypatch.setattr(backend, "_compile_frozen", lambda gm, *args: seen.append(gm) or compile_frozen(gm, *args))
    model = WrittenBuffer().to(torch.bfloat16).eval()
    model.cache = model.cache.float()
    with torch.no_grad():
        torch.compile(model, backend="nvfp4")(torch.randn(2, 64, dtype=torch.bfloat16))
    gm, = seen
    own = [name for name, _ in [*gm.named_parameters(), *gm.named_buffers()]]
    assert sorted(own) == ["l_self_modules_linear_parameters_bias_", "l_self_modules_linear_parameters_weight_"]
    assert set(own) <= set(gm._param_name_to_source)
    assert all(hasattr(node, "_dynamo_source") for node in gm.graph.find_nodes(op="placeholder"))
