"""NVFP4 checkpoints in the formats other tools write and read: NVIDIA ModelOpt's Hugging Face
export and compressed-tensors' "nvfp4-pack-quantized" (llmcompressor); torchao's flattened
NVFP4Tensor state dicts are read too (their layout: io/torchao.py). Files are read with safetensors
only (never unpickled).

                      ModelOpt                               compressed-tensors
    codes             <layer>.weight        uint8 (N, K/2)   <layer>.weight_packed  uint8 (N, K/2)
    block scales      <layer>.weight_scale  e4m3 (N, K/16)   <layer>.weight_scale   e4m3 (N, K/16)
    global scale      <layer>.weight_scale_2 = g  fp32 ()    <layer>.weight_global_scale = 1/g  fp32 (1,)
    x's scale (W4A4)  <layer>.input_scale    = g_x fp32 ()   <layer>.input_global_scale  = 1/g_x (1,)
    which layers      hf_quant_config.json: quant_algo       config.json quantization_config:
                      ("NVFP4": W4A4, "W4A16_NVFP4"),        config_groups (input_activations:
                      exclude_modules (globs)                W4A4), ignore (names, "re:" regexes)

Mixture-of-experts layers (a transformers experts module, or an NVFP4Experts) are stored per
expert under the model's original per-expert names, as ModelOpt exports them:
<experts>.<e>.<gate>.*, <experts>.<e>.<up>.*, <experts>.<e>.<down>.* with the suffixes above
((gate, up, down) = gate_proj / up_proj / down_proj, Mixtral's w1 / w3 / w2); each expert's gate
and up share one global scale (NVFP4Experts holds one per expert for its gate_up weight). Keys
are the model's original names too (Mixtral's model.layers.<l>.block_sparse_moe.experts, where
transformers 5 has .mlp.experts): both directions rename as transformers does (modules/hf_names.py).

Element 2i sits in the low nibble in both, as here. g = amax / 2688 is well below 1 for any
weight of ordinary size: a global scale >= 1 (amax >= 2688) is almost always a reciprocal stored
in the wrong field, and loading it would scale every output by roughly its square; it is refused.
"""

import contextlib
import json
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from nvfp4_inductor import api, checkpoint_config, checks
from nvfp4_inductor.format import BLOCK_SIZE
from nvfp4_inductor.io import torchao
from nvfp4_inductor.modules import hf_names
from nvfp4_inductor.modules.common import replace_module
from nvfp4_inductor.modules.convert import ConversionReport, fused_groups, unquantized_modules
from nvfp4_inductor.modules.experts import cannot_convert, is_experts, NVFP4Experts
from nvfp4_inductor.modules.linear import NVFP4Linear

__all__ = ["init_empty_weights", "load_checkpoint", "save_checkpoint"]

FORMATS = ("modelopt", "compressed-tensors")
SUFFIXES = {"modelopt": ("weight", "weight_scale", "weight_scale_2", "input_scale"),
            "compressed-tensors": ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"),
            "torchao": torchao.SUFFIXES}


@contextlib.contextmanager
def init_empty_weights():
    """Build a model without memory for its parameters: inside, every parameter a module
    registers goes to the meta device (buffers stay where they are made, so computed ones such as
    rotary tables are right). load_checkpoint then gives each its tensor from the checkpoint:

        with nv.init_empty_weights():
            model = AutoModelForCausalLM.from_config(config)
        nv.load_checkpoint(model, path)
    """
    register = nn.Module.register_parameter

    def register_on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _checkpoint_folder(path) -> Path:
    """path, checked to be an existing folder (a checkpoint is a folder of files)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}: it does not exist")
    if not path.is_dir():
        raise NotADirectoryError(f"{path} is a file: give the checkpoint's folder (the one holding config.json "
                                 "or hf_quant_config.json and the .safetensors files); a single file is read only "
                                 "when it is a safetensors file with torchao's metadata")
    return path


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint folder's safetensors files: those its index names, else every one in it."""
    path = _checkpoint_folder(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{index} is not a safetensors index (a JSON object with a weight_map): {error}") from None
        files = sorted({path / name for name in weight_map.values()})
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(f"{index} names files the folder lacks: {absent[:4]}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} holds no .safetensors files")
    return files


def read_file(file: Path) -> dict[str, torch.Tensor]:
    """One safetensors file's tensors (CPU); a file safetensors cannot read raises naming it."""
    try:
        return load_file(file)
    except (SafetensorError, OSError) as error:
        raise ValueError(f"{file} is not a readable safetensors file (truncated or corrupt?): {error}") from None


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in safetensors_files(path):
        tensors.update(read_file(file))
    return tensors


def _model_keys(model: nn.Module, tensors: dict) -> dict:
    """tensors under model's state-dict keys (transformers renames some models' original module
    names, hf_names)."""
    rename = hf_names.key_renamer(model, to_checkpoint=False)
    renamed, original = {}, {}
    for key, value in tensors.items():
        new = rename(key)
        if new in renamed:
            raise ValueError(f"the checkpoint's {original[new]!r} and {key!r} are both the model's {new!r}")
        renamed[new], original[new] = value, key
    return renamed


def _json_file(file: Path) -> dict | None:
    if not file.is_file():
        return None
    try:
        value = json.loads(file.read_text())
    except ValueError as error:
        raise ValueError(f"{file} is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{file} must hold a JSON object")
    return value


def quantization(path) -> checkpoint_config.QuantizationSpec:
    """The checkpoint folder's format, W4A4 or not, and excluded layers, from its config files."""
    path = _checkpoint_folder(path)
    config = _json_file(path / "config.json") or {}
    return checkpoint_config.read_quantization(str(path), config.get("quantization_config"),
                                               _json_file(path / "hf_quant_config.json"))


def _torchao_checkpoint(path: Path) -> tuple[dict, dict] | None:
    """torchao's files at path (a folder, or one .safetensors file) -> torchao.read's (tensors,
    {layer: W4A4?}); None for a folder that is another format's or holds no torchao metadata."""
    if path.is_file() and path.suffix == ".safetensors" and torchao.is_torchao([path]):
        return torchao.read([path])
    path = _checkpoint_folder(path)
    config = _json_file(path / "config.json") or {}
    method = (config.get("quantization_config") or {}).get("quant_method")
    if method == "torchao":
        files = safetensors_files(path)
        if not torchao.is_torchao(files):
            raise ValueError(f"{path}: config.json says torchao, but its safetensors files carry no torchao "
                             "metadata (torchao's flatten_tensor_state_dict); a torchao checkpoint saved another way "
                             "(torch.save, safe_serialization=False) is not read here")
        return torchao.read(files)
    if method is not None or (path / "hf_quant_config.json").is_file() or not list(path.glob("*.safetensors")):
        return None
    files = safetensors_files(path)
    return torchao.read(files) if torchao.is_torchao(files) else None


def stored_global_scale(name: str, value: torch.Tensor | None, fmt: str) -> torch.Tensor:
    """A stored global scale -> g, fp32 () (compressed-tensors stores 1 / g), checked."""
    if value is None and fmt == "torchao":
        return torch.ones((), dtype=torch.float32)  # torchao's NVFP4Tensor without a per_tensor_scale: g = 1
    checks.check_tensor(name, value, (torch.float32,))
    if value.numel() != 1:
        raise ValueError(f"{name} must hold one per-tensor scale; got shape {tuple(value.shape)}")
    stored = value.reshape(()).clone()
    if not bool(torch.isfinite(stored) and stored > 0):
        raise ValueError(f"{name} must be finite and > 0; got {stored.item()}")
    g = 1.0 / stored if fmt == "compressed-tensors" else stored
    if g >= 1:
        other = ("a ModelOpt weight_scale_2 / input_scale (amax / 2688) stored where compressed-tensors "
                 "keeps its reciprocal" if fmt == "compressed-tensors" else
                 "a compressed-tensors global scale (2688 / amax) stored where "
                 f"{'torchao' if fmt == 'torchao' else 'ModelOpt'} keeps amax / 2688")
        raise ValueError(f"{name} = {stored.item()} means a global scale of {g.item()} (amax >= 2688): "
                         f"almost certainly {other}")
    return g


def stored_layer(fmt: str, prefix: str, modelopt: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A layer's tensors under ModelOpt's suffixes (weight, weight_scale, weight_scale_2 and
    input_scale where present) -> {prefix.name: tensor} under fmt's names, each global scale as fmt
    stores it (compressed-tensors: 1 / g, shape (1,)); stored_global_scale reads them back."""
    stored = {}
    for suffix, name in zip(SUFFIXES["modelopt"], SUFFIXES[fmt]):
        if suffix in modelopt:
            value = modelopt[suffix]
            if fmt == "compressed-tensors" and suffix in ("weight_scale_2", "input_scale"):
                value = (1.0 / value).reshape(1)
            stored[f"{prefix}.{name}"] = value
    return stored


def _layer(prefix: str, linear: nn.Linear, tensors: dict, fmt: str, w4a4: bool) -> NVFP4Linear:
    codes_key, scale_key, g_key, x_key = (f"{prefix}.{s}" for s in SUFFIXES[fmt])
    n, k = linear.out_features, linear.in_features
    # (torchao may store no global scale: g = 1)
    absent = [key for key in (codes_key, scale_key, *([] if fmt == "torchao" else [g_key])) if key not in tensors]
    if absent:
        raise ValueError(f"the checkpoint quantizes {prefix!r} but lacks {absent} ({fmt} stores a layer as "
                         f"{', '.join(SUFFIXES[fmt][:3])})")
    codes, scale = tensors.pop(codes_key), tensors.pop(scale_key)
    checks.check_tensor(codes_key, codes, (torch.uint8,))
    checks.check_tensor(scale_key, scale, (torch.float8_e4m3fn, torch.uint8))
    for key, value, shape in ((codes_key, codes, (n, k // 2)), (scale_key, scale, (n, k // BLOCK_SIZE))):
        if tuple(value.shape) != shape:
            raise ValueError(f"{key} has shape {tuple(value.shape)}; the model's layer ({n} x {k}) needs {shape}")
    g = stored_global_scale(g_key, tensors.pop(g_key, None), fmt)
    x_scale = tensors.pop(x_key, None)
    input_scale = stored_global_scale(x_key, x_scale, fmt) if x_scale is not None and w4a4 else None
    bias = tensors.pop(f"{prefix}.bias", None)
    if (bias is None) != (linear.bias is None):
        raise ValueError(f"{prefix}: the checkpoint {'lacks' if bias is None else 'has'} a bias the model's "
                         f"layer {'has' if bias is None else 'lacks'}")
    weight = api.NVFP4(codes, scale.view(torch.float8_e4m3fn), g, torch.Size((n, k)), False)
    dtype = linear.bias.dtype if linear.bias is not None and linear.bias.dtype.is_floating_point else None
    return NVFP4Linear(weight, None if bias is None else bias.to(dtype or bias.dtype),
                       "nvfp4" if w4a4 else "bf16", input_scale)


def _experts_layer(prefix: str, module: nn.Module, tensors: dict, fmt: str, w4a4: bool,
                   names: tuple[str, str, str]) -> NVFP4Experts:
    """The NVFP4Experts for the experts module at prefix (transformers' or an NVFP4Experts, whose
    own names then count; names: the model's per-expert names), its per-expert tensors popped
    from tensors and checked (global scales as stored_global_scale checks them, then codes, scales,
    shapes and gate / up sharing as NVFP4Experts' loader does)."""
    if isinstance(module, NVFP4Experts):
        e, h, i, names = module.num_experts, module.hidden_dim, module.intermediate_dim, module.checkpoint_names
    else:
        reason = cannot_convert(module)
        if reason is not None:
            raise ValueError(f"the checkpoint quantizes the experts {prefix!r}, which cannot hold NVFP4 experts: "
                             f"{reason}")
        e, two_i, h = module.gate_up_proj.shape
        i = two_i // 2

    def empty(n, k):
        return (torch.zeros(e, n, k // 2, dtype=torch.uint8), torch.zeros(e, n, k // BLOCK_SIZE, dtype=torch.float8_e4m3fn),
                torch.ones(e, dtype=torch.float32))

    layer = NVFP4Experts(empty(2 * i, h), empty(h, i), "nvfp4" if w4a4 else "bf16", names)
    codes, scale, g, x = SUFFIXES[fmt]
    state, input_scales = {}, []
    for key in [k for k in tensors if k.startswith(prefix + ".")]:
        value = tensors.pop(key)
        rest, _, suffix = key[len(prefix) + 1:].rpartition(".")
        if suffix == g:
            state[f"{rest}.weight_scale_2"] = stored_global_scale(key, value, fmt)
        elif suffix == x:
            input_scales.append(stored_global_scale(key, value, fmt))
        else:
            state[f"{rest}.{'weight' if suffix == codes else suffix}"] = value
    try:
        layer.load_state_dict(state, strict=True)  # (missing or unexpected tensors raise too)
    except RuntimeError as error:
        raise ValueError(f"the checkpoint's experts {prefix!r} ({e} experts, hidden {h}, expert MLP {i}, "
                         f"per-expert names {names}): {error}") from None
    if input_scales:
        warnings.warn(f"load_checkpoint: the experts {prefix!r} carry static input scales; NVFP4Experts "
                      "quantizes x per expert group with a dynamic global scale instead, so the stored ones are "
                      "checked but not used", stacklevel=3)
    return layer


def load_checkpoint(model: nn.Module, path) -> ConversionReport:
    """Load a ModelOpt or compressed-tensors NVFP4 checkpoint folder (config.json and / or
    hf_quant_config.json, safetensors files, sharded with an index or not) into model, in place:
    every linear the checkpoint quantizes becomes an NVFP4Linear holding the stored codes and
    scales as they are (W4A4 layers with their calibrated input scales), the rest of the model
    loads its tensors. A torchao checkpoint (a folder, or one .safetensors file, written with
    torchao's flatten_tensor_state_dict) loads the same way, its scales unswizzled; what
    NVFP4Linear cannot hold is refused (io/torchao.py). Everything is checked before any layer is
    replaced."""
    torchao_files = _torchao_checkpoint(Path(path))
    if torchao_files is None:
        spec = quantization(path)
        fmt, w4a4, excluded_in_files = spec.format, spec.w4a4, spec.excluded
        tensors = _read_tensors(path)
    else:  # which layers are quantized, and how, is in the files: none excluded, W4A4 per layer
        (tensors, w4a4_layers), fmt = torchao_files, "torchao"
        excluded_in_files, w4a4 = (lambda name: False), hf_names.either_name(model, w4a4_layers.get)
    excluded = hf_names.either_name(model, excluded_in_files)
    tensors = _model_keys(model, tensors)
    codes_suffix = "." + SUFFIXES[fmt][0]
    # the tensor that marks a quantized layer: its global scale (ModelOpt's codes are nn.Linear's
    # "weight"); torchao's may be absent (g = 1), and its codes have a name of their own
    scale_suffix = "." + SUFFIXES[fmt][0 if fmt == "torchao" else 2]
    quantized = sorted(key[:-len(scale_suffix)] for key in tensors if key.endswith(scale_suffix))
    modules = dict(model.named_modules())
    experts_modules = {name: m for name, m in modules.items() if is_experts(m) or isinstance(m, NVFP4Experts)}
    # <experts>.<e>.<projection>: an expert's layer, read into the experts module's NVFP4Experts
    of_experts = {name: name.rsplit(".", 2)[0] for name in quantized
                  if name.count(".") >= 2 and name.rsplit(".", 2)[0] in experts_modules
                  and name.rsplit(".", 2)[1].isdigit()}
    for name, experts in of_experts.items():
        if excluded(name):
            raise ValueError(f"the checkpoint holds NVFP4 tensors for {name!r}, which its config excludes")
        if name + codes_suffix not in tensors:
            raise ValueError(f"the checkpoint has {name}{scale_suffix} but no {name}{codes_suffix}")
    quantized_experts = sorted(set(of_experts.values()))
    if quantized_experts and fmt == "torchao":
        raise ValueError(f"the torchao checkpoint quantizes experts of {quantized_experts}; torchao experts are "
                         "not read here")
    quantized = [name for name in quantized if name not in of_experts]
    for name in quantized:
        if not isinstance(modules.get(name), nn.Linear):
            raise ValueError(f"the checkpoint quantizes {name!r}, which is not an nn.Linear of the model "
                             f"({type(modules[name]).__name__ if name in modules else 'no such module'})")
        if excluded(name):
            raise ValueError(f"the checkpoint holds NVFP4 tensors for {name!r}, which its config excludes")
        if name + codes_suffix not in tensors:
            raise ValueError(f"the checkpoint has {name}{scale_suffix} but no {name}{codes_suffix}")
    unfilled = [name for name, m in modules.items()
                if type(m) is nn.Linear and name not in quantized and not excluded(name)
                and f"{name}.weight" not in tensors]
    if unfilled:
        raise ValueError(f"the checkpoint's config quantizes {unfilled}, but it holds no tensors for them")
    expected = model.state_dict(keep_vars=True)
    own = {f"{name}.{key}" for name in quantized for key in ("weight", "bias")}
    own |= {key for key in expected if key.startswith(tuple(f"{name}." for name in quantized_experts))}
    prefixes = tuple(f"{name}." for name in [*quantized, *quantized_experts])
    unexpected = [key for key in tensors if key not in expected and not key.startswith(prefixes)]
    if unexpected:
        raise ValueError(f"the checkpoint holds tensors the model lacks: {unexpected[:8]}")
    layers = {name: _layer(name, modules[name], tensors, fmt, w4a4 if isinstance(w4a4, bool) else bool(w4a4(name)))
              for name in quantized}
    expert_names = hf_names.expert_namer(model)
    layers.update({name: _experts_layer(name, modules[name], tensors, fmt, w4a4, expert_names(name))
                   for name in quantized_experts})
    leftover = [key for key in tensors if key.startswith(prefixes)]
    if leftover:
        raise ValueError(f"the checkpoint holds tensors of quantized layers this loader does not read: {leftover[:8]}")
    # a tensor the checkpoint lacks is refused unless another name of the same tensor is loaded (a
    # tied output head)
    loaded = {id(expected[key]) for key in tensors}
    missing = [key for key, value in expected.items()
               if key not in tensors and key not in own and id(value) not in loaded]
    if missing:
        raise ValueError(f"the checkpoint lacks tensors of the model: {missing[:8]}")
    meta = any(t.device.type == "meta" for t in expected.values())
    model.load_state_dict(tensors, strict=False, assign=meta)
    if meta and hasattr(model, "tie_weights"):
        model.tie_weights()  # (a transformers model: a tied head takes the loaded embedding again)
    report = ConversionReport()
    for name, layer in layers.items():
        old = modules[name]
        device = next(iter(old.parameters() if not isinstance(old, NVFP4Experts) else old.buffers())).device
        layer.to(device if device.type != "meta" else "cpu")
        replace_module(model, name, old, layer)
        report.converted.append(name)
        report.layers += 1
    empty = [key for key, t in model.state_dict(keep_vars=True).items() if t.device.type == "meta"]
    if empty:
        raise ValueError(f"after loading, tensors of the model are still on the meta device: {empty[:8]}")
    return report


def _unshared_groups(layers: dict) -> list[list[str]]:
    """The fused groups (modules/convert.FUSED_GROUPS) among NVFP4 layers whose global scales differ."""
    return [members for members in fused_groups(layers)
            if len({layers[m].weight_scale_2.item() for m in members}) > 1]


def save_checkpoint(model: nn.Module, path, format: str = "modelopt") -> None:  # noqa: A002
    """Write model, whose NVFP4 layers are NVFP4Linear, as a checkpoint folder in `format`
    ("modelopt" or "compressed-tensors"): model.safetensors, and the format's config (ModelOpt:
    hf_quant_config.json; both: config.json's quantization_config, merged into the model's
    Hugging Face config where it has one)."""
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}; got {format!r}")
    # a tensor-parallel share (modules/sharded.NVFP4LinearShard) would be written under its whole layer's
    # name: a checkpoint whose tensors are one rank's rows or columns
    shards = [name for name, m in model.named_modules() if isinstance(m, NVFP4Linear) and getattr(m, "tp_size", 1) > 1]
    if shards:
        raise ValueError(f"save_checkpoint: {shards[:4]} are tensor-parallel shares (NVFP4LinearShard); saving a "
                         "sharded model as one checkpoint is not implemented: save the unsharded model")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    layers = {name: m for name, m in model.named_modules() if isinstance(m, NVFP4Linear)}
    experts = {name: m for name, m in model.named_modules() if isinstance(m, NVFP4Experts)}
    if not layers and not experts:
        raise ValueError("the model has no NVFP4Linear layers: convert it (nvfp4_inductor.convert) first "
                         "(nor NVFP4Experts)")
    unshared = _unshared_groups(layers)
    if unshared:
        warnings.warn(f"save_checkpoint: the fused groups {unshared} have global scales of their own; vLLM, "
                      "SGLang and TensorRT-LLM read one per group and would decode these layers wrongly. "
                      "Convert with Config(share_global_scales=True) for such engines.", stacklevel=2)
    state = {key: value.detach().contiguous() for key, value in model.state_dict().items()}
    w4a4 = any(m.activations == "nvfp4" for m in [*layers.values(), *experts.values()])
    # each expert's projections under the per-expert names NVFP4Experts' state dict uses
    expert_layers = [f"{name}.{e}.{proj}" for name, m in experts.items() for e in range(m.num_experts)
                     for proj in m.checkpoint_names]
    for name in [*layers, *expert_layers]:
        modelopt = {suffix: state.pop(f"{name}.{suffix}") for suffix in SUFFIXES["modelopt"]
                    if f"{name}.{suffix}" in state}
        state.update(stored_layer(format, name, modelopt))
    # tied tensors are saved once (safetensors refuses shared storage)
    seen = {}
    for key in list(state):
        ptr = (state[key].untyped_storage().data_ptr(), state[key].storage_offset(), state[key].shape)
        if ptr in seen and state[key].numel():
            del state[key]
        else:
            seen[ptr] = key
    # under the model's original names, as transformers' save_pretrained writes them (hf_names)
    to_file = hf_names.key_renamer(model, to_checkpoint=True)
    save_file({to_file(key): value for key, value in state.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    config = model.config.to_dict() if hasattr(getattr(model, "config", None), "to_dict") else {}
    write_configs(path, config, format, w4a4, unquantized_modules(model))


def write_configs(path: Path, config: dict, fmt: str, w4a4: bool, excluded: list[str]) -> None:
    """Write the checkpoint folder's config files for fmt: config.json (config, a model's Hugging
    Face config as a dict or {}, with the format's quantization_config) and, for ModelOpt,
    hf_quant_config.json; excluded: the modules left unquantized, as the files name them."""
    if fmt == "modelopt":
        entry, hf_quant = checkpoint_config.modelopt_configs(w4a4, excluded)
        (path / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=2))
    else:
        entry = checkpoint_config.compressed_tensors_config(w4a4, excluded)
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": entry}, indent=2, default=str))
