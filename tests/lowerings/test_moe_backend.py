"""Hugging Face mixture-of-experts models through backend="nvfp4" (lowerings/passes/experts.py):
plain torch.compile on an unconverted model of each experts_implementation, generate with a
CompileConfig, and models converted with nv.convert (NVFP4Experts) compiled by any backend.
Tiny random Qwen3-MoE and Mixtral configs, one layer, on the CPU (the reference kernels)."""

import logging

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import nvfp4_inductor as nv
from helpers.hf import MOE_ARCHITECTURES, MOE_SHAPES, close, compiled_generate, moe_model
from helpers.hf import nvfp4_ops as _nvfp4_ops
from nvfp4_inductor.modules.experts import NVFP4Experts

transformers = pytest.importorskip("transformers")

ARCHITECTURES = MOE_ARCHITECTURES
EXPERT_WEIGHTS = ["model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"]


def _model(arch: str, impl: str = "grouped_mm", seed: int = 0):
    return moe_model(arch, impl, 1, seed)


def _ids(t: int = 7, seed: int = 1):
    return torch.randint(0, MOE_SHAPES["vocab_size"], (2, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_plain_torch_compile_runs_the_experts_in_nvfp4(arch, impl, caplog):
    """torch.compile(model, backend="nvfp4") on an unconverted model: both expert GEMMs become the
    grouped NVFP4 ops (gate / up with SiLU * up in the epilogue), quantized as nv.convert does:
    the logits are the eager converted model's up to rounding order, and close to bf16."""
    model = _model(arch, impl)
    torch._dynamo.reset()
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="nvfp4_inductor"):
        bf16 = model(_ids()).logits
        got, code = run_and_get_code(torch.compile(model, backend="nvfp4"), _ids())
    assert _nvfp4_ops(code).count("grouped_linear_tiled_silu_mul") == 1, _nvfp4_ops(code)
    assert _nvfp4_ops(code).count("grouped_linear_tiled") == 1, _nvfp4_ops(code)
    assert "converted 2 expert weights" in caplog.text and all(w in caplog.text for w in EXPERT_WEIGHTS)
    ok, err = close(got.logits, bf16)
    assert ok, err
    nv.convert(model, nv.Config(activations="bf16"))
    assert isinstance(model.model.layers[0].mlp.experts, NVFP4Experts)
    with torch.no_grad():
        converted = model(_ids()).logits
    torch.testing.assert_close(got.logits, converted, rtol=0, atol=0.02 * converted.abs().max().item())


def test_a_new_length_recompiles_with_dynamic_shapes():
    """A second call with another sequence length: Dynamo recompiles with a symbolic token count,
    and the experts are still rewritten (the routing's sort and gather are sized at run time)."""
    model = _model("qwen3_moe", "batched_mm")
    compiled = torch.compile(model, backend="nvfp4")
    torch._dynamo.reset()
    with torch.no_grad():
        compiled(_ids(7))
        got, code = run_and_get_code(compiled, _ids(11, seed=2))
        want = model(_ids(11, seed=2)).logits
    assert "grouped_linear_tiled_silu_mul" in _nvfp4_ops(code)
    ok, err = close(got.logits, want)
    assert ok, err


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_eager_experts_stay_bf16_and_the_log_says_so(arch, caplog):
    """experts_implementation="eager" loops over the experts in Python (data-dependent shapes):
    Dynamo runs the loop outside the compiled graphs, so the experts stay bf16, and the backend's
    log names the experts class with the reason."""
    model = _model(arch, "eager")
    torch._dynamo.reset()
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="nvfp4_inductor"):
        want = model(_ids()).logits
        got, code = run_and_get_code(torch.compile(model, backend="nvfp4"), _ids())
    assert not any(op.startswith("grouped") for op in _nvfp4_ops(code))
    experts = type(model.model.layers[0].mlp.experts).__name__
    assert f"{experts} (experts_implementation='eager')" in caplog.text
    assert "loops over the experts in Python" in caplog.text
    ok, err = close(got.logits, want)
    assert ok, err


def test_config_include_keeps_experts_bf16(caplog):
    """Config.include is asked with the experts module's path (as convert_experts asks it)."""
    model = _model("qwen3_moe")
    asked = []

    def include(name, module):
        asked.append(name)
        return not name.endswith(".experts")

    torch._dynamo.reset()
    options = {"nvfp4": nv.Config(include=include)}
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="nvfp4_inductor"):
        _, code = run_and_get_code(torch.compile(model, backend="nvfp4", options=options), _ids())
    assert "model.layers.0.mlp.experts" in asked
    assert not any(op.startswith("grouped") for op in _nvfp4_ops(code))
    assert "'model.layers.0.mlp.experts.gate_up_proj': 'excluded by Config.include'" in caplog.text


@pytest.mark.parametrize("backend", ["nvfp4", "inductor"])
def test_a_converted_model_compiles_in_one_graph(backend):
    """nv.convert (NVFP4Experts), then torch.compile(fullgraph=True): the experts' forward traces
    without a graph break or a host read (sort, searchsorted and the grouped ops stay on the
    device), under the NVFP4 backend and the default one alike."""
    model = _model("qwen3_moe")
    nv.convert(model, nv.Config(activations="bf16"))
    torch._dynamo.reset()
    with torch.no_grad():
        want = model(_ids()).logits
        got, code = run_and_get_code(torch.compile(model, backend=backend, fullgraph=True), _ids())
    assert {"grouped_linear_tiled", "grouped_linear_tiled_silu_mul"} <= set(_nvfp4_ops(code))
    torch.testing.assert_close(got.logits, want, rtol=0, atol=0.02 * want.abs().max().item())


@pytest.mark.parametrize("converted", [False, True], ids=["bf16-model", "converted"])
def test_generate_with_a_compile_config(converted):
    """generate(..., cache_implementation="static", compile_config=CompileConfig(backend="nvfp4"))
    compiles the decode step with the grouped NVFP4 ops, converted or not."""
    model = _model("qwen3_moe")
    if converted:
        nv.convert(model, nv.Config(activations="bf16"))
    out, code, _ = compiled_generate(model, _ids(5)[:1], 3)
    assert out.shape == (1, 8)
    assert "grouped_linear_tiled_silu_mul" in _nvfp4_ops(code), _nvfp4_ops(code)


@pytest.mark.gpu
@pytest.mark.parametrize("converted", [False, True], ids=["bf16-model", "converted"])
def test_generate_under_cuda_graphs(converted):
    """generate with CompileConfig(backend="nvfp4", mode="reduce-overhead") on a GPU: the decode
    step (routing, grouped NVFP4 experts, weighted sum) replays as CUDA graphs with no skips, and
    the converted model's greedy tokens are those of the unconverted one compiled the same way
    or differ only after a near tie."""
    model = _model("qwen3_moe").cuda()
    if converted:
        nv.convert(model, nv.Config(activations="bf16"))
    out, code, skips = compiled_generate(model, _ids(5)[:1].cuda(), 8, "reduce-overhead")
    assert out.shape == (1, 13)
    assert "grouped_linear_tiled_silu_mul" in _nvfp4_ops(code), _nvfp4_ops(code)
    assert skips == 0
