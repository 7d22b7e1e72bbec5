"""NVFP4 checkpoints in the ModelOpt and compressed-tensors formats: files written here by hand
from the formats' conventions (nvfp4_inductor.io.checkpoint's table), loaded bit for bit; the
package's writer round-tripped through both; bad files refused before any layer is replaced."""

import json
import warnings

import pytest
import torch
from safetensors.torch import save_file
from torch._inductor.utils import run_and_get_code
from torch import nn

import nvfp4_inductor as nv


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 64)
        self.q = nn.Linear(64, 64, bias=False)
        self.up = nn.Linear(64, 128)
        self.down = nn.Linear(128, 64)
        self.norm = nn.LayerNorm(64)
        self.lm_head = nn.Linear(64, 50, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        h = h + self.q(h)
        return self.lm_head(self.norm(h + self.down(torch.relu(self.up(h)))))


QUANTIZED = ("q", "up", "down")


def _model(seed=0):
    torch.manual_seed(seed)
    return Tiny().to(torch.bfloat16).eval()


def _write(path, fmt, model, *, w4a4=False, shards=1, edit=None):
    """The model's state dict with q / up / down as NVFP4 tensors in fmt, written by hand."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    expected = {}
    for name in QUANTIZED:
        w = state.pop(f"{name}.weight").float()
        q = nv.quantize(w)
        x_scale = torch.tensor(0.01 + len(name) / 1000)
        expected[name] = (q, x_scale)
        if fmt == "modelopt":
            state.update({f"{name}.weight": q.data, f"{name}.weight_scale": q.scale,
                          f"{name}.weight_scale_2": q.global_scale})
            if w4a4:
                state[f"{name}.input_scale"] = x_scale
        else:
            state.update({f"{name}.weight_packed": q.data, f"{name}.weight_scale": q.scale,
                          f"{name}.weight_global_scale": (1 / q.global_scale).reshape(1)})
            if w4a4:
                state[f"{name}.input_global_scale"] = (1 / x_scale).reshape(1)
    if edit is not None:
        edit(state)
    keys = sorted(state)
    files = {f"model-{i:05d}-of-{shards:05d}.safetensors": keys[i::shards] for i in range(shards)}
    for file, part in files.items():
        save_file({k: state[k].contiguous() for k in part}, str(path / file))
    if shards > 1:
        index = {"weight_map": {k: file for file, part in files.items() for k in part}}
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    if fmt == "modelopt":
        quant = {"quant_algo": "NVFP4" if w4a4 else "W4A16_NVFP4", "group_size": 16,
                 "exclude_modules": ["lm_head"]}
        (path / "hf_quant_config.json").write_text(json.dumps({"quantization": quant}))
        config = {"quantization_config": {"quant_method": "modelopt", **quant}}
    else:
        args = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}
        config = {"quantization_config": {
            "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "ignore": ["re:.*head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": args,
                                          "input_activations": args if w4a4 else None}}}}
    (path / "config.json").write_text(json.dumps(config))
    return expected


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
@pytest.mark.parametrize("w4a4", [False, True], ids=["W4A16", "W4A4"])
@pytest.mark.parametrize("shards", [1, 3])
def test_load_reads_the_files_bit_for_bit(tmp_path, fmt, w4a4, shards):
    source = _model()
    expected = _write(tmp_path, fmt, source, w4a4=w4a4, shards=shards)
    model = _model(seed=1)
    report = nv.load_checkpoint(model, tmp_path)
    assert sorted(report.converted) == sorted(QUANTIZED) and type(model.lm_head) is nn.Linear
    for name, (q, x_scale) in expected.items():
        layer = getattr(model, name)
        assert isinstance(layer, nv.NVFP4Linear) and layer.activations == ("nvfp4" if w4a4 else "bf16")
        data, scale = layer.plain_weight()
        assert torch.equal(data, q.data)
        assert torch.equal(scale.view(torch.uint8), q.scale.view(torch.uint8))
        # compressed-tensors stores 1 / g: inverted back, g within an fp32 rounding
        torch.testing.assert_close(layer.weight_scale_2, q.global_scale, rtol=2**-23, atol=0)
        if w4a4:
            torch.testing.assert_close(layer.input_scale, x_scale, rtol=2**-23, atol=0)
        else:
            assert layer.input_scale is None
    assert torch.equal(model.embed.weight, source.embed.weight) and torch.equal(model.lm_head.weight,
                                                                                source.lm_head.weight)
    ids = torch.randint(0, 50, (2, 5))
    with torch.no_grad():
        assert model(ids).shape == (2, 5, 50)


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
def test_save_then_load_round_trips(tmp_path, fmt):
    """nv.convert, save_checkpoint in fmt, load_checkpoint into a fresh bf16 model: the same NVFP4
    tensors and the same outputs (ModelOpt's global scale is stored as is: bit for bit)."""
    model = _model()
    nv.convert(model, nv.Config(activations="bf16", skip_output_head=True))
    nv.save_checkpoint(model, tmp_path, format=fmt)
    fresh = _model(seed=2)
    nv.load_checkpoint(fresh, tmp_path)
    for name in QUANTIZED:
        a, b = getattr(model, name), getattr(fresh, name)
        assert torch.equal(a.weight, b.weight) and torch.equal(a.weight_scale.view(torch.uint8),
                                                               b.weight_scale.view(torch.uint8))
        if fmt == "modelopt":
            assert torch.equal(a.weight_scale_2, b.weight_scale_2)
    ids = torch.randint(0, 50, (2, 5))
    with torch.no_grad():
        want, got = model(ids), fresh(ids)
    if fmt == "modelopt":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


def _refused(tmp_path, match, fmt="modelopt", **kwargs):
    _write(tmp_path, fmt, _model(), **kwargs)
    model = _model(seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises((ValueError, TypeError), match=match):
        nv.load_checkpoint(model, tmp_path)
    assert all(type(getattr(model, name)) is nn.Linear for name in QUANTIZED)  # nothing replaced
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # nor loaded


def test_a_reciprocal_global_scale_is_refused(tmp_path):
    """compressed-tensors' G = 2688 / amax stored as ModelOpt's weight_scale_2: every output would
    be scaled by ~G^2."""
    def swap(state):
        state["up.weight_scale_2"] = 1 / state["up.weight_scale_2"]

    _refused(tmp_path, r"up.weight_scale_2 = .*almost certainly a compressed-tensors global scale", edit=swap)


def test_an_uninverted_compressed_tensors_scale_is_refused(tmp_path):
    def swap(state):
        state["down.weight_global_scale"] = 1 / state["down.weight_global_scale"]

    _refused(tmp_path, r"down.weight_global_scale = .*almost certainly a ModelOpt", fmt="compressed-tensors",
             edit=swap)


@pytest.mark.parametrize("case, match", [
    ("codes as bf16", "q.weight must have dtype"),
    ("scales shape", r"q.weight_scale has shape \(64, 3\)"),
    ("nan global scale", "q.weight_scale_2 must be finite and > 0"),
    ("layer the model lacks", "'gate', which is not an nn.Linear of the model"),
    ("quantized layer left out", r"quantizes \['up'\], but it holds no tensors"),
    ("tensor the model lacks", "holds tensors the model lacks"),
])
def test_bad_checkpoints_are_refused_before_anything_loads(tmp_path, case, match):
    def edit(state):
        if case == "codes as bf16":
            state["q.weight"] = state["q.weight"].to(torch.bfloat16)
        elif case == "scales shape":
            state["q.weight_scale"] = state["q.weight_scale"][:, :3].contiguous()
        elif case == "nan global scale":
            state["q.weight_scale_2"] = torch.tensor(float("nan"))
        elif case == "layer the model lacks":
            for suffix in ("weight", "weight_scale", "weight_scale_2"):
                state[f"gate.{suffix}"] = state[f"q.{suffix}"].clone()
        elif case == "quantized layer left out":
            for suffix in ("weight", "weight_scale", "weight_scale_2", "bias"):
                del state[f"up.{suffix}"]
        else:
            state["extra.weight"] = torch.zeros(2)

    _refused(tmp_path, match, edit=edit)


def test_not_an_nvfp4_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "gptq"}}))
    with pytest.raises(ValueError, match="not an NVFP4 checkpoint"):
        nv.load_checkpoint(_model(), tmp_path)


def test_transformers_model_round_trip(tmp_path):
    """A converted tiny transformers Llama saved as ModelOpt (config.json keeps the model's config)
    and loaded into a fresh one: the same logits."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    nv.convert(model, nv.Config(activations="bf16", share_global_scales=True))
    nv.save_checkpoint(model, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "llama" and saved["quantization_config"]["quant_method"] == "modelopt"
    # ModelOpt's own layout: config.json names the excluded modules under ignore, hf_quant_config.json
    # under exclude_modules
    assert saved["quantization_config"]["ignore"] == ["lm_head"]
    hf_quant = json.loads((tmp_path / "hf_quant_config.json").read_text())["quantization"]
    assert hf_quant["exclude_modules"] == ["lm_head"] and hf_quant["quant_algo"] == "W4A16_NVFP4"
    torch.manual_seed(1)
    fresh = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    report = nv.load_checkpoint(fresh, tmp_path)
    assert report.layers == 7
    ids = torch.randint(0, 128, (1, 6))
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, model(ids).logits)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(64, 64), nn.Linear(64, 32), nn.Linear(64, 32)
        self.o_proj = nn.Linear(64, 64)
        self.gate_proj, self.up_proj = nn.Linear(64, 128), nn.Linear(64, 128)


def test_fused_groups_share_one_global_scale(tmp_path):
    """Config(share_global_scales=True): q / k / v and gate / up take max(amax of the group) /
    2688, bit for bit, as ModelOpt and llmcompressor export them; o keeps its own. Without it,
    save_checkpoint warns that engines fusing those layers would decode them wrongly."""
    from nvfp4_inductor import reference

    torch.manual_seed(3)
    model = Attention()
    with torch.no_grad():
        model.v_proj.weight.mul_(4)  # the group's largest amax
    weights = {name: m.weight.detach().clone() for name, m in model.named_children()}
    shared = Attention()
    shared.load_state_dict(model.state_dict())
    nv.convert(shared, nv.Config(activations="bf16", share_global_scales=True))
    for group in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
        want = max(reference.compute_global_scale(weights[n]) for n in group)
        for name in group:
            layer = getattr(shared, name)
            assert torch.equal(layer.weight_scale_2, want)
            again = nv.quantize(weights[name], want)  # codes and scales under that global scale
            assert torch.equal(layer.plain_weight()[0], again.data)
    assert torch.equal(shared.o_proj.weight_scale_2, reference.compute_global_scale(weights["o_proj"]))
    nv.convert(model, nv.Config(activations="bf16"))
    with pytest.warns(UserWarning, match="have global scales of their own"):
        nv.save_checkpoint(model, tmp_path / "own")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nv.save_checkpoint(shared, tmp_path / "shared")


def test_load_into_a_model_built_without_weights(tmp_path):
    """nv.init_empty_weights: a transformers Llama built with its parameters on the meta device
    (its rotary buffer computed as usual), then loaded: the logits of the model saved, and no
    tensor left on the meta device."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    nv.convert(model, nv.Config(activations="bf16", share_global_scales=True))
    nv.save_checkpoint(model, tmp_path)
    with nv.init_empty_weights():
        empty = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    assert empty.model.embed_tokens.weight.device.type == "meta"
    nv.load_checkpoint(empty, tmp_path)
    assert not [k for k, t in empty.state_dict().items() if t.device.type == "meta"]
    assert empty.lm_head.weight is empty.model.embed_tokens.weight  # tied again
    ids = torch.randint(0, 128, (1, 6))
    with torch.no_grad():
        assert torch.equal(empty(ids).logits, model(ids).logits)


@pytest.mark.parametrize("w4a4", [False, True], ids=["W4A16", "W4A4"])
def test_compressed_tensors_decompresses_our_export_exactly(tmp_path, w4a4):
    """The compressed-tensors package reads our compressed-tensors export (its config's scheme,
    its NVFP4 decompressor) to exactly nv.dequantize's bf16 values."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    model = _model()
    nv.convert(model, nv.Config(activations="nvfp4" if w4a4 else "bf16"))
    nv.save_checkpoint(model, tmp_path, format="compressed-tensors")
    config = QuantizationConfig.model_validate(json.loads((tmp_path / "config.json").read_text())["quantization_config"])
    scheme, = config.config_groups.values()
    assert (scheme.input_activations is not None) == w4a4
    state = load_file(tmp_path / "model.safetensors")
    for name in QUANTIZED:
        local = {k.split(".", 1)[1]: v for k, v in state.items() if k.startswith(f"{name}.")}
        weight = NVFP4PackedCompressor.decompress(local, scheme)["weight"]
        assert torch.equal(weight, getattr(model, name).nvfp4_weight().dequantize(weight.dtype))


@pytest.mark.parametrize("w4a4", [False, True], ids=["W4A16", "W4A4"])
def test_from_pretrained_through_the_registered_quantizer(tmp_path, w4a4):
    """AutoModelForCausalLM.from_pretrained on a ModelOpt export, after
    nv.register_transformers_quantizer(): the quantized linears are NVFP4Linear holding the files'
    tensors bit for bit, excluded ones stay nn.Linear, and a reciprocal global scale is refused."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    nv.convert(model, nv.Config(activations="nvfp4" if w4a4 else "bf16", share_global_scales=True))
    if w4a4:
        for layer in model.modules():
            if isinstance(layer, nv.NVFP4Linear):
                layer.set_input_scale(torch.tensor(0.02))
    nv.save_checkpoint(model, tmp_path)
    nv.register_transformers_quantizer()
    nv.register_transformers_quantizer()  # (idempotent)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    files = load_file(tmp_path / "model.safetensors")
    state = loaded.state_dict()
    assert isinstance(loaded.model.layers[0].mlp.down_proj, nv.NVFP4Linear) and type(loaded.lm_head) is nn.Linear
    assert all(torch.equal(state[k].view(torch.uint8), v.view(torch.uint8)) if v.dtype == torch.float8_e4m3fn
               else torch.equal(state[k], v) for k, v in files.items())
    assert (loaded.model.layers[1].self_attn.k_proj.activations == "nvfp4") == w4a4
    ids = torch.randint(0, 128, (1, 6))
    with torch.no_grad():  # (the source's rotary table was cast to bf16 with the model; the loaded one is fp32)
        want = loaded(ids).logits
        torch.testing.assert_close(want, model(ids).logits, rtol=0.05, atol=0.05)
        # and it compiles like a converted model: the NVFP4 weights tiled, q / k / v merged
        torch._dynamo.reset()
        got, code = run_and_get_code(torch.compile(loaded, backend="nvfp4"), ids)
        torch._dynamo.reset()
    assert "torch.ops.nvfp4.linear_tiled.default(" in "\n".join(code)
    # (W4A4: Inductor's own rounding of the norm before x's quantization flips some codes)
    tol = 0.1 if w4a4 else 0.02
    torch.testing.assert_close(got.logits, want, rtol=0, atol=tol * want.abs().max().item())
    files["model.layers.0.mlp.up_proj.weight_scale_2"] = 1 / files["model.layers.0.mlp.up_proj.weight_scale_2"]
    save_file(files, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="up_proj.weight_scale_2 = .*almost certainly"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)


def test_checkpoint_arguments_and_configs_refused_with_clear_errors(tmp_path):
    model = _model()
    with pytest.raises(ValueError, match="no NVFP4Linear layers: convert it"):
        nv.save_checkpoint(model, tmp_path / "bf16")
    nv.convert(model)
    with pytest.raises(ValueError, match="format must be one of"):
        nv.save_checkpoint(model, tmp_path / "x", format="gguf")
    (tmp_path / "fp8").mkdir()
    (tmp_path / "fp8" / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "FP8"}}))
    with pytest.raises(ValueError, match="quant_algo 'FP8'"):
        nv.load_checkpoint(_model(), tmp_path / "fp8")
    (tmp_path / "ct").mkdir()
    (tmp_path / "ct" / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "compressed-tensors", "format": "float-quantized"}}))
    with pytest.raises(ValueError, match="format 'float-quantized'"):
        nv.load_checkpoint(_model(), tmp_path / "ct")
