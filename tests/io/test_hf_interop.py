"""Checkpoints as users meet them through transformers: a folder laid out exactly as ModelOpt 0.47's
`hf_ptq` writes it, the package's compressed-tensors export read by transformers' own loader,
`save_pretrained` of a converted model, and the errors a wrong path or a damaged file gives."""

import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import nvfp4_inductor as nv

transformers = pytest.importorskip("transformers")

LLAMA = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1)


def _llama(seed: int = 0):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).to(torch.bfloat16).eval()


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.float()


def _write_modelopt_export(path, model, w4a4: bool):
    """model's linears (lm_head excepted) as ModelOpt 0.47's hf_ptq exports them: the tensors under
    ModelOpt's names, config.json's quantization_config naming the excluded modules under `ignore`
    (with producer and config_groups), hf_quant_config.json under `exclude_modules`. -> {layer name:
    the NVFP4 tensor written}."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    written = {}
    for name, module in model.named_modules():
        if type(module) is not nn.Linear or name == "lm_head":
            continue
        q = nv.quantize(state.pop(f"{name}.weight").float())
        written[name] = q
        state.update({f"{name}.weight": q.data, f"{name}.weight_scale": q.scale,
                      f"{name}.weight_scale_2": q.global_scale})
        if w4a4:
            state[f"{name}.input_scale"] = torch.tensor(0.003)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    algo = "NVFP4" if w4a4 else "W4A16_NVFP4"
    producer = {"name": "modelopt", "version": "0.47.0"}
    args = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
    group = {"weights": args, "targets": ["Linear"], **({"input_activations": args} if w4a4 else {})}
    config = model.config.to_dict()
    config["quantization_config"] = {"config_groups": {"group_0": group}, "ignore": ["lm_head", "model.embed_tokens"],
                                     "quant_algo": algo, "producer": producer, "quant_method": "modelopt"}
    (path / "config.json").write_text(json.dumps(config))
    (path / "hf_quant_config.json").write_text(json.dumps({"producer": producer, "quantization": {
        "quant_algo": algo, "kv_cache_quant_algo": None, "group_size": 16,
        "exclude_modules": ["lm_head", "model.embed_tokens"]}}))
    return written


@pytest.mark.parametrize("w4a4", [False, True], ids=["W4A16", "W4A4"])
def test_a_modelopt_export_loads_through_from_pretrained_and_load_checkpoint(tmp_path, w4a4):
    """ModelOpt names the excluded modules under `ignore` in config.json (the only file
    from_pretrained reads): lm_head stays nn.Linear, every other linear holds the files' tensors."""
    source = _llama()
    written = _write_modelopt_export(tmp_path, source, w4a4)
    nv.register_transformers_quantizer()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    fresh = _llama(seed=1)
    nv.load_checkpoint(fresh, tmp_path)
    for model in (loaded, fresh):
        assert type(model.lm_head) is nn.Linear and torch.equal(model.lm_head.weight, source.lm_head.weight)
        for name, q in written.items():
            layer = model.get_submodule(name)
            assert isinstance(layer, nv.NVFP4Linear) and layer.activations == ("nvfp4" if w4a4 else "bf16")
            data, scale = layer.plain_weight()
            assert torch.equal(data, q.data) and torch.equal(scale.view(torch.uint8), q.scale.view(torch.uint8))
            assert torch.equal(layer.weight_scale_2, q.global_scale)
    ids = torch.randint(0, LLAMA["vocab_size"], (2, 5))
    want = _logits(fresh, ids)
    assert want.isfinite().all()
    # (from_pretrained keeps the rotary table in fp32; the bf16-cast source model's copy is bf16)
    torch.testing.assert_close(_logits(loaded, ids), want, rtol=0.02, atol=0.02 * want.abs().max().item())
    # and save_pretrained of the loaded model writes a folder from_pretrained reads again
    loaded.save_pretrained(tmp_path / "again")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "again", dtype=torch.bfloat16).eval()
    assert torch.equal(_logits(again, ids), _logits(loaded, ids))


def test_modelopt_config_groups_other_than_linear_are_refused(tmp_path):
    _write_modelopt_export(tmp_path, _llama(), False)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["targets"] = ["Embedding"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    nv.register_transformers_quantizer()
    with pytest.raises(ValueError, match=r"targets \['Embedding'\]; only \['Linear'\]"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)


@pytest.mark.parametrize("w4a4", [False, True], ids=["W4A16", "W4A4"])
def test_compressed_tensors_export_loads_through_transformers_own_loader(tmp_path, w4a4):
    """transformers' compressed-tensors quantizer (the compressed-tensors package installed) reads
    save_checkpoint's compressed-tensors export: quantization_status "compressed" makes it unpack
    the codes instead of leaving the layers uninitialised (NaN logits)."""
    pytest.importorskip("compressed_tensors")
    model = _llama()
    nv.convert(model, nv.Config(activations="nvfp4" if w4a4 else "bf16", share_global_scales=True))
    if w4a4:
        for layer in model.modules():
            if isinstance(layer, nv.NVFP4Linear):
                layer.set_input_scale(torch.tensor(0.003))
    nv.save_checkpoint(model, tmp_path, format="compressed-tensors")
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"]["quantization_status"] == \
        "compressed"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, LLAMA["vocab_size"], (2, 5))
    got, want = _logits(loaded, ids), _logits(model, ids)
    assert got.isfinite().all()
    # (decompressed on the first call) every quantized layer's weight is e2m1 * s * g exactly
    for name, layer in model.named_modules():
        if isinstance(layer, nv.NVFP4Linear):
            weight = loaded.get_submodule(name).weight
            assert torch.equal(weight, layer.nvfp4_weight().dequantize(weight.dtype)), name
    if not w4a4:  # (transformers' decompressed model runs x in bf16: W4A4's x quantization is not applied)
        torch.testing.assert_close(got, want, rtol=0.02, atol=0.02 * want.abs().max().item())


def test_save_pretrained_of_a_converted_model_reloads(tmp_path):
    """nv.convert records the ModelOpt quantization_config in a transformers model's config, so
    save_pretrained writes a checkpoint that from_pretrained (after
    register_transformers_quantizer) and load_checkpoint both read, with the same outputs."""
    model = _llama()
    nv.convert(model, nv.Config(activations="bf16"))
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert saved["quant_method"] == "modelopt" and saved["quant_algo"] == "W4A16_NVFP4"
    assert saved["ignore"] == ["lm_head"]
    nv.register_transformers_quantizer()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    fresh = _llama(seed=1)
    nv.load_checkpoint(fresh, tmp_path)
    ids = torch.randint(0, LLAMA["vocab_size"], (2, 5))
    want = _logits(model, ids)
    assert torch.equal(_logits(fresh, ids), want)
    torch.testing.assert_close(_logits(loaded, ids), want, rtol=0.02, atol=0.02 * want.abs().max().item())
    for name, layer in model.named_modules():
        if isinstance(layer, nv.NVFP4Linear):
            other = loaded.get_submodule(name)
            assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                       for a, b in zip(layer.plain_weight(), other.plain_weight())), name


def test_a_layer_whose_tensors_are_missing_is_refused(tmp_path):
    """Missing codes or block scales: a ValueError naming the layer and the tensor, before anything
    is replaced (not a KeyError); under from_pretrained, a layer left uninitialised raises."""
    source = _llama()
    _write_modelopt_export(tmp_path, source, False)
    from safetensors.torch import load_file

    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight_scale"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    model = _llama(seed=1)
    with pytest.raises(ValueError, match=r"quantizes 'model.layers.1.mlp.up_proj' but lacks "
                                         r"\['model.layers.1.mlp.up_proj.weight_scale'\]"):
        nv.load_checkpoint(model, tmp_path)
    assert type(model.model.layers[1].mlp.up_proj) is nn.Linear
    nv.register_transformers_quantizer()
    with pytest.raises(ValueError, match=r"lacks \['model.layers.1.mlp.up_proj.weight_scale'\]: the layer would be "
                                         "left uninitialised"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)


def test_wrong_paths_and_damaged_files_are_named(tmp_path):
    model = _llama()
    with pytest.raises(FileNotFoundError, match="no checkpoint at .*nowhere: it does not exist"):
        nv.load_checkpoint(model, tmp_path / "nowhere")
    _write_modelopt_export(tmp_path, model, False)
    with pytest.raises(NotADirectoryError, match="model.safetensors is a file: give the checkpoint's folder"):
        nv.load_checkpoint(model, tmp_path / "model.safetensors")
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"model.safetensors is not a readable safetensors file \(truncated"):
        nv.load_checkpoint(model, tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        nv.load_checkpoint(model, tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "awq"}}))
    (tmp_path / "hf_quant_config.json").unlink()
    with pytest.raises(ValueError, match="not an NVFP4 checkpoint this package reads.*quant_method 'awq'"):
        nv.load_checkpoint(model, tmp_path)
