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
