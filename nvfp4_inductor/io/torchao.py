"""torchao's NVFP4 checkpoints: a model whose linears torchao (0.18) quantized to its NVFP4Tensor,
flattened with torchao's flatten_tensor_state_dict and written to safetensors with the JSON it
returns as the file's metadata (transformers' save_pretrained with a TorchAoConfig writes the
same, and config.json's quantization_config {"quant_method": "torchao", "quant_type": ...}).

    <layer>._weight_qdata                uint8 (N, K/2), element 2i in the low nibble
    <layer>._weight_scale                float8_e4m3fn: swizzled (is_swizzled_scales, what torchao's
                                         configs write) (32*ceil(N/128), 16*ceil(K/64)): the bytes of
                                         the (ceil(N/128)*128, ceil(K/64)*4) 128x4-tile layout, padding
                                         zero; else plain (N, K/16)
    <layer>._weight_per_tensor_scale     fp32 () = amax / 2688 = g; absent: g = 1 (block scales alone)
    <layer>._weight_act_per_tensor_scale fp32 () = amax_x / 2688, the static x scale (W4A4 "convert")
    metadata["<layer>.weight"]           {"_type": "NVFP4Tensor", "_data": {"block_size": 16,
                                         "is_swizzled_scales", "act_quant_kwargs": null (weight-only) or
                                         {"_type": "QuantizeTensorToNVFP4Kwargs", "_data": {"block_size",
                                         "use_dynamic_per_tensor_scale"}}, ...}, "_tensor_data_names"}
    metadata["tensor_names"]             JSON list of every state-dict key

W = e2m1(code) * scale * g, as ModelOpt's weight_scale_2. W4A4 layers quantize x per tensor with a
dynamic scale (use_dynamic_per_tensor_scale) or the stored static one. Read here: the stored codes
and scales as they are, the scales unswizzled; everything torchao can also write that NVFP4Linear
cannot hold (MX / other tensor types, other block sizes, per-expert 3-D weights, x quantized with
block scales alone) is refused by name. Files are read with safetensors only.
"""

import json
from pathlib import Path

import torch

from nvfp4_inductor import api
from nvfp4_inductor.format import BLOCK_SIZE, SWIZZLE_TILE_COLS, SWIZZLE_TILE_ROWS

__all__ = ["SUFFIXES", "is_torchao", "read"]

SUFFIXES = ("_weight_qdata", "_weight_scale", "_weight_per_tensor_scale", "_weight_act_per_tensor_scale")
_DATA_NAMES = {"qdata": SUFFIXES[0], "scale": SUFFIXES[1], "per_tensor_scale": SUFFIXES[2],
               "act_per_tensor_scale": SUFFIXES[3]}
# torchao stores each 128 x 4 swizzled tile (512 bytes) as 32 rows of 16
_STORED_TILE = (32, 16)


def _metadata(file: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        return f.metadata() or {}


def is_torchao(files: list[Path]) -> bool:
    """Whether any of the safetensors files carries torchao's flattened-state-dict metadata."""
    return any("tensor_names" in _metadata(file) for file in files)


def _json(file: Path, key: str, text):
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        raise ValueError(f"{file}: the torchao metadata {key!r} is not valid JSON: {str(text)[:80]!r}") from None


def _layouts(file: Path, metadata: dict) -> dict[str, dict]:
    """-> {layer: its NVFP4Tensor's metadata "_data" plus "_tensor_data_names"}, every tensor type checked."""
    names = _json(file, "tensor_names", metadata.get("tensor_names"))
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{file}: the torchao metadata 'tensor_names' must be a JSON list of names")
    layers = {}
    for name in names:
        entry = _json(file, name, metadata.get(name))
        kind = entry.get("_type") if isinstance(entry, dict) else None
        if kind == "Tensor":
            continue
        if kind != "NVFP4Tensor":
            raise ValueError(f"{file}: {name!r} is a torchao {kind!r}; this package reads torchao's NVFP4Tensor "
                             "(NVFP4WeightOnlyConfig / NVFP4DynamicActivationNVFP4WeightConfig) only")
        data = entry.get("_data")
        stored = entry.get("_tensor_data_names")
        if not isinstance(data, dict) or not isinstance(stored, list):
            raise ValueError(f"{file}: the torchao metadata of {name!r} lacks '_data' or '_tensor_data_names'")
        if data.get("block_size") != BLOCK_SIZE:
            raise ValueError(f"{file}: {name!r} is a torchao NVFP4Tensor of block_size {data.get('block_size')!r}; "
                             f"NVFP4 blocks are {BLOCK_SIZE}")
        if not name.endswith(".weight"):
            raise ValueError(f"{file}: {name!r} is a torchao NVFP4Tensor that is not a linear's weight (torchao's "
                             "3-D experts weights are not read here)")
        unknown = [n for n in stored if n not in _DATA_NAMES]
        if unknown or not {"qdata", "scale"} <= set(stored):
            raise ValueError(f"{file}: {name!r} is a torchao NVFP4Tensor holding {stored}; expected qdata, "
                             "scale and optionally per_tensor_scale, act_per_tensor_scale")
        layers[name[: -len(".weight")]] = {**data, "_tensor_data_names": stored}
    return layers


def _activations(file: Path, layer: str, data: dict) -> str:
    """-> "bf16" (weight-only), "dynamic" or "static": how torchao quantizes the layer's input."""
    kwargs = data.get("act_quant_kwargs")
    if kwargs is None:
        return "bf16"
    args = kwargs.get("_data") if isinstance(kwargs, dict) else None
    if kwargs.get("_type") != "QuantizeTensorToNVFP4Kwargs" or not isinstance(args, dict) \
            or args.get("block_size") != BLOCK_SIZE:
        raise ValueError(f"{file}: {layer!r}: torchao's act_quant_kwargs {json.dumps(kwargs)[:200]} are not NVFP4 "
                         f"activations of block size {BLOCK_SIZE}")
    if args.get("use_dynamic_per_tensor_scale"):
        return "dynamic"
    if "act_per_tensor_scale" not in data["_tensor_data_names"]:
        raise ValueError(f"{file}: {layer!r}: torchao quantizes its input with block scales alone (no per-tensor "
                         "scale: use_dynamic_per_tensor_scale=False without a calibrated act_per_tensor_scale), "
                         "which NVFP4Linear does not do; quantize with use_dynamic_per_tensor_scale=True or the "
                         "static prepare / convert steps")
    return "static"


def _plain_scale(file: Path, key: str, scale: torch.Tensor, n: int, k: int, swizzled) -> torch.Tensor:
    """torchao's stored block scales -> plain float8_e4m3fn (N, K/16), the swizzled padding checked zero."""
    if scale.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{file}: torchao's {key} is {scale.dtype}; NVFP4 block scales are float8_e4m3fn")
    if swizzled is False:
        return scale
    if swizzled is not True:
        raise ValueError(f"{file}: torchao's is_swizzled_scales for {key} must be true or false; got {swizzled!r}")
    cols = k // BLOCK_SIZE
    row_tiles, col_tiles = -(-n // SWIZZLE_TILE_ROWS), -(-cols // SWIZZLE_TILE_COLS)
    expected = (row_tiles * _STORED_TILE[0], col_tiles * _STORED_TILE[1])
    if tuple(scale.shape) != expected:
        raise ValueError(f"{file}: torchao's swizzled {key} has shape {tuple(scale.shape)}; codes of shape "
                         f"({n}, {k // 2}) need {expected} (32*ceil(N/128), 16*ceil(K/64))")
    padded = scale.reshape(row_tiles * SWIZZLE_TILE_ROWS, col_tiles * SWIZZLE_TILE_COLS)  # the same bytes
    plain = api.unswizzle_scales(padded, n, cols)
    # a nonzero pad byte is not what torchao writes: the bytes are likely in another layout
    if not torch.equal(api.swizzle_scales(plain).view(torch.uint8), padded.view(torch.uint8)):
        raise ValueError(f"{file}: torchao's swizzled {key} has nonzero padding (beyond row {n} or scale "
                         f"column {cols}); torchao pads with zeros, so its layout is not the one declared")
    return plain


def read(files: list[Path]) -> tuple[dict[str, torch.Tensor], dict[str, bool]]:
    """torchao's flattened safetensors files -> (tensors under torchao's keys with each layer's
    `_weight_scale` plain (N, K/16) e4m3 and a dynamic layer's unused stored x scale dropped,
    {layer: W4A4?}). Shapes against the model and scale values are left to the caller."""
    from safetensors.torch import load_file

    # transformers' save_pretrained writes the whole model's metadata into every shard
    tensors, layers = {}, {}
    for file in files:
        metadata = _metadata(file)
        if "tensor_names" in metadata:
            layers.update(_layouts(file, metadata))
        tensors.update(load_file(str(file)))
    where = files[0] if len(files) == 1 else files[0].parent
    w4a4 = {}
    for layer, data in layers.items():
        present = {n for n in _DATA_NAMES if f"{layer}.{_DATA_NAMES[n]}" in tensors}
        if present != set(data["_tensor_data_names"]):
            raise ValueError(f"{where}: torchao's metadata gives {layer!r} the tensors {data['_tensor_data_names']}; "
                             f"the files hold {sorted(present)}")
        activations = _activations(where, layer, data)
        codes_key, scale_key = (f"{layer}.{s}" for s in SUFFIXES[:2])
        codes = tensors[codes_key]
        if codes.dtype != torch.uint8 or codes.dim() != 2:
            raise ValueError(f"{where}: torchao's {codes_key} must be 2-D uint8 (N, K/2); got {codes.dtype} "
                             f"{tuple(codes.shape)}")
        n, k = codes.shape[0], 2 * codes.shape[1]
        if k % BLOCK_SIZE:
            raise ValueError(f"{where}: torchao's {codes_key} holds K = {k} elements a row, not a multiple of "
                             f"{BLOCK_SIZE}")
        tensors[scale_key] = _plain_scale(where, scale_key, tensors[scale_key], n, k, data.get("is_swizzled_scales"))
        if activations == "dynamic":
            tensors.pop(f"{layer}.{SUFFIXES[3]}", None)  # torchao ignores it then: x's scale comes from x
        w4a4[layer] = activations != "bf16"
    return tensors, w4a4
