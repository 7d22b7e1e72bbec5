"""The quantization configs of NVFP4 checkpoints, read and written as the tools that make them do.

    ModelOpt (0.47 `hf_ptq`)     config.json quantization_config = {quant_method "modelopt",
                                 quant_algo "NVFP4" (W4A4) | "W4A16_NVFP4", producer,
                                 config_groups {targets ["Linear"], weights num_bits 4 / type float /
                                 group_size 16}, ignore [globs]}; hf_quant_config.json =
                                 {producer, quantization {quant_algo, group_size, exclude_modules}}
    compressed-tensors           config.json quantization_config = {quant_method "compressed-tensors",
                                 format "nvfp4-pack-quantized", quantization_status "compressed",
                                 config_groups {targets, weights, input_activations}, ignore
                                 [names, "re:" regexes]}

Readers accept both ModelOpt spellings of the excluded modules (config.json's `ignore`,
hf_quant_config.json's `exclude_modules`), since real exports put them in different files.
compressed-tensors' `quantization_status` "compressed" tells transformers that the files hold
packed codes: without it transformers' loader takes the folder for an unquantized model and
leaves the quantized layers' weights uninitialised.
"""

import fnmatch
import re
from dataclasses import dataclass
from typing import Callable

from nvfp4_inductor.format import BLOCK_SIZE

__all__ = ["QuantizationSpec", "read_quantization", "modelopt_configs", "compressed_tensors_config",
           "MODELOPT_ALGOS"]

MODELOPT_ALGOS = ("NVFP4", "W4A16_NVFP4")
PRODUCER = {"name": "nvfp4_inductor"}


@dataclass(frozen=True)
class QuantizationSpec:
    """What a checkpoint's config says: its format, whether x is quantized too (W4A4), and which
    layer names it leaves unquantized."""

    format: str
    w4a4: bool
    excluded: Callable[[str], bool]


def _glob_matcher(globs: list[str]) -> Callable[[str], bool]:
    return lambda name: any(fnmatch.fnmatchcase(name, g) for g in globs)


def _list_of_strings(where: str, value) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{where} must be a list of module names; got {value!r}")
    return value


def _linear_targets(where: str, groups: dict) -> None:
    """config_groups whose targets are not nn.Linear layers: refused (nothing here reads them)."""
    for name, group in (groups or {}).items():
        targets = (group or {}).get("targets") or ["Linear"]
        if any(t != "Linear" for t in targets):
            raise ValueError(f"{where}: config_groups[{name!r}] targets {targets}; only ['Linear'] (every "
                             "nn.Linear not ignored) is read")


def read_quantization(where: str, quantization_config: dict | None, hf_quant_config: dict | None) -> QuantizationSpec:
    """config.json's quantization_config and hf_quant_config.json (each None where absent) ->
    the spec; anything but an NVFP4 checkpoint in one of the two formats raises ValueError."""
    quant = quantization_config or {}
    method = quant.get("quant_method")
    if method == "modelopt" or (method is None and hf_quant_config is not None):
        nested = (hf_quant_config or {}).get("quantization") or {}
        algo = nested.get("quant_algo", quant.get("quant_algo"))
        group_size = nested.get("group_size", quant.get("group_size", BLOCK_SIZE))
        for group in (quant.get("config_groups") or {}).values():
            group_size = ((group or {}).get("weights") or {}).get("group_size", group_size)
        if algo not in MODELOPT_ALGOS or group_size != BLOCK_SIZE:
            raise ValueError(f"{where}: a ModelOpt checkpoint of quant_algo {algo!r}, group_size {group_size!r}; "
                             "NVFP4 is 'NVFP4' or 'W4A16_NVFP4' with group_size 16")
        _linear_targets(where, quant.get("config_groups"))
        globs = [*_list_of_strings(f"{where}: ignore", quant.get("ignore")),
                 *_list_of_strings(f"{where}: exclude_modules", quant.get("exclude_modules")),
                 *_list_of_strings(f"{where}: hf_quant_config.json exclude_modules", nested.get("exclude_modules"))]
        return QuantizationSpec("modelopt", algo == "NVFP4", _glob_matcher(globs))
    if method == "compressed-tensors":
        if quant.get("format") != "nvfp4-pack-quantized":
            raise ValueError(f"{where}: a compressed-tensors checkpoint of format {quant.get('format')!r}; "
                             "NVFP4 is 'nvfp4-pack-quantized'")
        _linear_targets(where, quant.get("config_groups"))
        groups = list((quant.get("config_groups") or {}).values())
        w4a4 = any(((g or {}).get("input_activations") or {}).get("num_bits") == 4 for g in groups)
        ignore = _list_of_strings(f"{where}: ignore", quant.get("ignore"))

        def excluded(name: str) -> bool:
            return any(re.fullmatch(i[3:], name) if i.startswith("re:") else name == i for i in ignore)

        return QuantizationSpec("compressed-tensors", w4a4, excluded)
    raise ValueError(f"{where} is not an NVFP4 checkpoint this package reads: its config.json has no "
                     "quantization_config with quant_method 'modelopt' or 'compressed-tensors' "
                     f"(quant_method {method!r}), there is no hf_quant_config.json, and its safetensors files "
                     "carry no torchao NVFP4 metadata")


def _weights_args() -> dict:
    return {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": BLOCK_SIZE,
            "symmetric": True, "dynamic": False}


def modelopt_configs(w4a4: bool, excluded: list[str]) -> tuple[dict, dict]:
    """-> (config.json's quantization_config, hf_quant_config.json) of a ModelOpt NVFP4 export
    leaving the modules named in excluded unquantized."""
    algo = "NVFP4" if w4a4 else "W4A16_NVFP4"
    group = {"targets": ["Linear"], "weights": _weights_args()}
    if w4a4:
        group["input_activations"] = {**_weights_args(), "dynamic": False}
    entry = {"quant_method": "modelopt", "quant_algo": algo, "producer": dict(PRODUCER),
             "config_groups": {"group_0": group}, "ignore": list(excluded)}
    hf_quant = {"producer": dict(PRODUCER), "quantization": {"quant_algo": algo, "kv_cache_quant_algo": None,
                                                             "group_size": BLOCK_SIZE,
                                                             "exclude_modules": list(excluded)}}
    return entry, hf_quant


def compressed_tensors_config(w4a4: bool, excluded: list[str]) -> dict:
    """-> config.json's quantization_config of a compressed-tensors nvfp4-pack-quantized export."""
    group = {"targets": ["Linear"], "weights": _weights_args(), "format": "nvfp4-pack-quantized",
             "input_activations": {**_weights_args(), "dynamic": "local"} if w4a4 else None}
    return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
            "quantization_status": "compressed", "config_groups": {"group_0": group}, "ignore": list(excluded)}
