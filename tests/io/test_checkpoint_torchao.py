"""torchao's NVFP4 checkpoints (nvfp4_inductor.io.torchao): files torchao 0.18 itself wrote
(tests/data/make_torchao_checkpoint.py, which also saved what torchao held in memory) load bit for
bit; the options NVFP4Linear cannot hold and damaged files are refused, naming torchao, before any
layer is replaced."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

import nvfp4_inductor as nv

DATA = Path(__file__).parent / "data" / "torchao"
EXPECTED = load_file(DATA / "expected.safetensors")
LAYERS = ("up", "down")


class Tiny(nn.Module):
    """The generator's model: norm -> up (80 x 48, bias) -> relu -> down (32 x 80)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(48)
        self.up = nn.Linear(48, 80)
        self.down = nn.Linear(80, 32, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(self.norm(x))))


def _model():
    torch.manual_seed(3)  # not the generator's seed: every loaded tensor must come from the file
    return Tiny().to(torch.bfloat16).eval()


def _read(name):
    with safe_open(str(DATA / f"{name}.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def _write(path, tensors, metadata):
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    return path


def _edit_layer(metadata, layer, **data):
    entry = json.loads(metadata[f"{layer}.weight"])
    entry["_data"].update(data)
    metadata[f"{layer}.weight"] = json.dumps(entry)


@pytest.mark.parametrize("variant, activations", [("w4a16", "bf16"), ("w4a16_no_per_tensor_scale", "bf16"),
                                                  ("w4a4_static", "nvfp4"), ("w4a4_dynamic", "nvfp4")])
def test_torchao_files_load_bit_for_bit(variant, activations):
    model = _model()
    report = nv.load_checkpoint(model, DATA / f"{variant}.safetensors")
    assert sorted(report.converted) == sorted(LAYERS)
    for layer in LAYERS:
        module = getattr(model, layer)
        assert isinstance(module, nv.NVFP4Linear) and module.activations == activations
        data, scale = module.plain_weight()
        assert torch.equal(data, EXPECTED[f"{variant}.{layer}.codes"])
        assert torch.equal(scale.view(torch.uint8), EXPECTED[f"{variant}.{layer}.scale"].view(torch.uint8))
        # torchao's NVFP4Tensor without a per_tensor_scale decodes with block scales alone: g = 1
        g = EXPECTED.get(f"{variant}.{layer}.per_tensor_scale", torch.tensor(1.0))
        assert torch.equal(module.weight_scale_2, g)
        # static: the calibrated x scale; dynamic: none stored, NVFP4Linear computes it from x as torchao does
        act = EXPECTED.get(f"{variant}.{layer}.act_per_tensor_scale")
        assert (module.input_scale is None) if act is None else torch.equal(module.input_scale, act)
    stored, _ = _read(variant)
    assert all(torch.equal(model.state_dict()[key], stored[key]) for key in ("up.bias", "norm.weight", "norm.bias"))
    with torch.no_grad():
        assert torch.isfinite(model(EXPECTED["x"])).all()


def test_torchao_weights_decode_as_torchao_decodes():
    """Our decode is e2m1 * s * g rounded once; torchao's dequantize rounds g * s first, so its fp32
    values are within one ulp of ours and identical in bf16, the dtype its weight-only linear uses;
    the loaded model's output matches torchao's own model's."""
    model = _model()
    nv.load_checkpoint(model, DATA / "w4a16.safetensors")
    for layer in LAYERS:
        module = getattr(model, layer)
        data, scale = module.plain_weight()
        shape = torch.Size((module.out_features, module.in_features))
        ours = nv.dequantize(nv.NVFP4(data, scale, module.weight_scale_2, shape), torch.float32)
        blocks = nv.dequantize(nv.NVFP4(data, scale, torch.tensor(1.0), shape), torch.float32)  # exact
        assert torch.equal(ours, (blocks.double() * module.weight_scale_2.double()).float())
        theirs = EXPECTED[f"w4a16.{layer}.dequantized"]
        assert (ours.view(torch.int32) - theirs.view(torch.int32)).abs().max() <= 1
        assert torch.equal(ours.bfloat16(), theirs.bfloat16())
    with torch.no_grad():
        torch.testing.assert_close(model(EXPECTED["x"]), EXPECTED["w4a16.output"], rtol=2**-7, atol=2**-7)


def test_torchao_folder_with_and_without_transformers_config(tmp_path):
    """A folder holding the file loads as the file does; with config.json's quantization_config as
    transformers' save_pretrained writes it for a TorchAoConfig, too."""
    shutil.copy(DATA / "w4a4_static.safetensors", tmp_path / "model.safetensors")
    nv.load_checkpoint(model := _model(), tmp_path)
    assert model.up.activations == "nvfp4"
    quant = {"quant_method": "torchao", "quant_type": {"default": {
        "_type": "NVFP4DynamicActivationNVFP4WeightConfig", "_version": 1, "_data": {"step": "convert"}}}}
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": quant}))
    nv.load_checkpoint(model := _model(), tmp_path)
    assert isinstance(model.down, nv.NVFP4Linear)
    tensors, _ = _read("w4a16")
    _write(tmp_path / "model.safetensors", tensors, {"format": "pt"})  # the metadata lost
    with pytest.raises(ValueError, match="config.json says torchao, but .* no torchao metadata"):
        nv.load_checkpoint(_model(), tmp_path)


def test_torchao_shards_each_carrying_the_whole_metadata(tmp_path):
    """transformers' save_pretrained writes the model's whole torchao metadata into every shard."""
    tensors, metadata = _read("w4a4_static")
    shards = {"model-00001-of-00002.safetensors": [k for k in tensors if k.startswith("up.")],
              "model-00002-of-00002.safetensors": [k for k in tensors if not k.startswith("up.")]}
    for file, keys in shards.items():
        _write(tmp_path / file, {k: tensors[k] for k in keys}, {**metadata, "format": "pt"})
    index = {"weight_map": {k: file for file, keys in shards.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    nv.load_checkpoint(model := _model(), tmp_path)
    assert torch.equal(model.up.input_scale, EXPECTED["w4a4_static.up.act_per_tensor_scale"])
    assert torch.equal(model.down.plain_weight()[0], EXPECTED["w4a4_static.down.codes"])


def test_torchao_single_file_needs_torchao_metadata(tmp_path):
    tensors, _ = _read("w4a16")
    for path in (_write(tmp_path / "plain.safetensors", tensors, {"format": "pt"}), tmp_path / "model.bin"):
        path.touch()
        with pytest.raises(NotADirectoryError, match="is a file: give the checkpoint's folder .* a single file is read "
                                                     "only when it is a safetensors file with torchao's metadata"):
            nv.load_checkpoint(_model(), path)


def test_torchao_loads_into_a_model_on_the_meta_device():
    with nv.init_empty_weights():
        model = Tiny()
    nv.load_checkpoint(model, DATA / "w4a16.safetensors")
    assert model.norm.weight.device.type == "cpu" and model.up.weight.device.type == "cpu"
    assert torch.equal(model.up.plain_weight()[0], EXPECTED["w4a16.up.codes"])


def test_torchao_plain_scales_load(tmp_path):
    """is_swizzled_scales false: the scales are stored (N, K/16) as they are."""
    tensors, metadata = _read("w4a16")
    for layer in LAYERS:
        tensors[f"{layer}._weight_scale"] = EXPECTED[f"w4a16.{layer}.scale"]
        _edit_layer(metadata, layer, is_swizzled_scales=False)
    nv.load_checkpoint(model := _model(), _write(tmp_path / "plain.safetensors", tensors, metadata))
    assert torch.equal(model.down.plain_weight()[1].view(torch.uint8), EXPECTED["w4a16.down.scale"].view(torch.uint8))


def _block_size(tensors, metadata):
    _edit_layer(metadata, "up", block_size=32)


def _act_block_size(tensors, metadata):
    entry = json.loads(metadata["up.weight"])
    entry["_data"]["act_quant_kwargs"]["_data"]["block_size"] = 32
    metadata["up.weight"] = json.dumps(entry)


def _float8(tensors, metadata):
    metadata["down.weight"] = metadata["down.weight"].replace('"NVFP4Tensor"', '"Float8Tensor"')


def _no_scale(tensors, metadata):
    del tensors["down._weight_scale"]


def _no_per_tensor_scale(tensors, metadata):
    del tensors["up._weight_per_tensor_scale"]  # the metadata still lists it


def _plain_scale_declared_swizzled(tensors, metadata):
    tensors["down._weight_scale"] = EXPECTED["w4a16.down.scale"]


def _padding(tensors, metadata):
    scale = tensors["up._weight_scale"].view(torch.uint8).clone().reshape(-1)
    scale[-1] = 0x38  # 1.0 in the last pad byte (rows 80..127 are padding)
    tensors["up._weight_scale"] = scale.view(torch.float8_e4m3fn).reshape(tensors["up._weight_scale"].shape)


def _bad_json(tensors, metadata):
    metadata["up.weight"] = metadata["up.weight"][:-5]


def _reciprocal(tensors, metadata):
    tensors["up._weight_per_tensor_scale"] = 1 / tensors["up._weight_per_tensor_scale"]


def _three_d(tensors, metadata):
    tensors["up._weight_qdata"] = tensors["up._weight_qdata"].reshape(2, 40, 24)


@pytest.mark.parametrize("variant, edit, match", [
    ("mxfp4", None, r"'0\.weight' is a torchao 'MXTensor'; this package reads torchao's NVFP4Tensor"),
    ("w4a4_single_level", None, "torchao quantizes its input with block scales alone"),
    ("w4a16", _block_size, "'up.weight' is a torchao NVFP4Tensor of block_size 32"),
    ("w4a4_static", _act_block_size, "'up': torchao's act_quant_kwargs .* are not NVFP4 activations"),
    ("w4a16", _float8, "'down.weight' is a torchao 'Float8Tensor'"),
    ("w4a16", _no_scale,
     r"torchao's metadata gives 'down' the tensors .*'scale'.*; the files hold \['per_tensor_scale', 'qdata'\]"),
    ("w4a16", _no_per_tensor_scale, "torchao's metadata gives 'up' the tensors"),
    ("w4a16", _plain_scale_declared_swizzled, r"torchao's swizzled down._weight_scale has shape \(32, 5\); .* need "
                                              r"\(32, 32\)"),
    ("w4a16", _padding, "torchao's swizzled up._weight_scale has nonzero padding"),
    ("w4a16", _bad_json, "the torchao metadata 'up.weight' is not valid JSON"),
    ("w4a16", _reciprocal, r"up._weight_per_tensor_scale = .* stored where torchao keeps amax / 2688"),
    ("w4a16", _three_d, "torchao's up._weight_qdata must be 2-D uint8"),
])
def test_torchao_refusals(tmp_path, variant, edit, match):
    path = DATA / f"{variant}.safetensors"
    if edit is not None:
        tensors, metadata = _read(variant)
        edit(tensors, metadata)
        path = _write(tmp_path / "edited.safetensors", tensors, metadata)
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        nv.load_checkpoint(model, path)
    assert all(type(getattr(model, layer)) is nn.Linear for layer in LAYERS)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
