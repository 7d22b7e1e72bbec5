"""`AutoModelForCausalLM.from_pretrained(path)` for ModelOpt NVFP4 checkpoints: a transformers
quantizer for `quant_method` "modelopt", which transformers itself does not read.

    import nvfp4_inductor as nv
    nv.register_transformers_quantizer()            # once per process
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)

Before the weights load, every nn.Linear the checkpoint's config does not exclude becomes an
NVFP4Linear with empty (meta) codes and scales, which transformers fills from the files as they
are (no bf16 copy is made); the files' headers are read first, so that a layer they lack is
refused rather than left uninitialised; after loading, each layer's tensors are checked as
load_checkpoint checks them (io/checkpoint.py), and its codes and scales take the tiled layout.
compressed-tensors checkpoints are read by transformers' own compressed-tensors quantizer (or by
nvfp4_inductor.load_checkpoint).
"""

import torch
from safetensors import safe_open
from torch import nn

from nvfp4_inductor import api, checkpoint_config
from nvfp4_inductor.format import BLOCK_SIZE
from nvfp4_inductor.io.checkpoint import stored_global_scale
from nvfp4_inductor.modules import hf_names
from nvfp4_inductor.modules.common import checked_bits, replace_module
from nvfp4_inductor.modules.experts import is_experts
from nvfp4_inductor.modules.linear import NVFP4Linear

_registered = False


def register_transformers_quantizer() -> None:
    """Register the "modelopt" quantization config and quantizer with transformers (idempotent)."""
    global _registered
    if _registered:
        return
    try:
        from transformers.quantizers.auto import (
            AUTO_QUANTIZATION_CONFIG_MAPPING,
            register_quantization_config,
            register_quantizer,
        )
        from transformers.quantizers.base import HfQuantizer
        from transformers.utils.quantization_config import QuantizationConfigMixin
    except ImportError as error:
        raise ImportError("register_transformers_quantizer needs transformers: "
                          "pip install 'nvfp4-inductor[transformers]'") from error

    if "modelopt" in AUTO_QUANTIZATION_CONFIG_MAPPING:
        raise RuntimeError("transformers already has a 'modelopt' quantization method registered")

    @register_quantization_config("modelopt")
    class ModelOptNVFP4Config(QuantizationConfigMixin):
        """config.json's quantization_config of a ModelOpt NVFP4 export (every field kept, so that
        save_pretrained writes it back as read)."""

        def __init__(self, **fields):
            fields.pop("quant_method", None)
            self.__dict__.update(fields)
            self.quant_method = "modelopt"
            self.spec = checkpoint_config.read_quantization("config.json quantization_config", self.to_dict(), None)

        def to_dict(self):
            return {key: value for key, value in self.__dict__.items() if key != "spec"}

    @register_quantizer("modelopt")
    class ModelOptNVFP4Quantizer(HfQuantizer):
        requires_calibration = False

        def validate_environment(self, *args, **kwargs):
            if not self.pre_quantized:
                raise ValueError("the 'modelopt' quantizer loads NVFP4 checkpoints; to quantize a bf16 model "
                                 "use nvfp4_inductor.convert")

        def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
            replaced = _replace_linears(model, self.quantization_config)
            if checkpoint_files:
                _check_files_hold(model, replaced, checkpoint_files)

        def _process_model_after_weight_loading(self, model, **kwargs):
            _check_loaded(model)
            return model

        def is_serializable(self):
            return True

        @property
        def is_trainable(self) -> bool:
            return False

        @property
        def is_compileable(self) -> bool:
            return True

    _registered = True


def _replace_linears(model: nn.Module, config) -> list[str]:
    """Every nn.Linear not excluded -> an NVFP4Linear whose buffers are empty, on the meta device
    (excluded names are matched as the files name modules too: hf_names); -> the names replaced."""
    w4a4 = config.spec.w4a4
    replaced = []
    excluded = hf_names.either_name(model, config.spec.excluded)
    expert_names = hf_names.expert_namer(model)
    for name, module in list(model.named_modules()):
        if is_experts(module):
            gate = f"{name}.0.{expert_names(name)[0]}"
            if not excluded(name) and not excluded(gate):
                raise ValueError(f"{name}: from_pretrained does not read NVFP4 mixture-of-experts weights; build the "
                                 "model with nvfp4_inductor.init_empty_weights() and read the checkpoint with "
                                 "nvfp4_inductor.load_checkpoint")
        if type(module) is not nn.Linear or excluded(name):
            continue
        n, k = module.out_features, module.in_features
        if k % BLOCK_SIZE:
            raise ValueError(f"{name}: in_features {k} is not a multiple of {BLOCK_SIZE}; exclude it or check the "
                             "checkpoint's exclude_modules")
        with torch.device("meta"):
            weight = api.NVFP4(torch.empty((n, k // 2), dtype=torch.uint8),
                               torch.empty((n, k // BLOCK_SIZE), dtype=torch.float8_e4m3fn),
                               torch.empty((), dtype=torch.float32), torch.Size((n, k)), False)
            bias = None if module.bias is None else torch.empty(n, dtype=module.bias.dtype)
            layer = NVFP4Linear(weight, bias, "nvfp4" if w4a4 else "bf16")
            # the files' layout, which transformers checks the loaded tensors against: tiled once
            # loaded (_check_loaded)
            layer.weight, layer.weight_scale = weight.data, weight.scale
            if w4a4:
                layer.input_scale = torch.empty((), dtype=torch.float32)
        replace_module(model, name, module, layer)
        replaced.append(name)
    return replaced


def _check_files_hold(model: nn.Module, layers: list[str], checkpoint_files: list[str]) -> None:
    """Each NVFP4 layer's codes, block scales and global scale are in the checkpoint's files (read
    from their headers): transformers fills what a checkpoint lacks with uninitialised memory."""
    rename = hf_names.key_renamer(model, to_checkpoint=False)
    keys = set()
    for file in checkpoint_files:
        if str(file).endswith(".safetensors"):
            with safe_open(str(file), framework="pt") as handle:
                keys.update(rename(key) for key in handle.keys())
    for name in layers:
        absent = [f"{name}.{key}" for key in ("weight", "weight_scale", "weight_scale_2")
                  if f"{name}.{key}" not in keys]
        if absent:
            raise ValueError(f"the checkpoint quantizes {name!r} but lacks {absent}: the layer would be left "
                             "uninitialised")


def _check_loaded(model: nn.Module) -> None:
    """Each NVFP4Linear's loaded tensors, checked as load_checkpoint checks them."""
    for name, layer in model.named_modules():
        if not isinstance(layer, NVFP4Linear):
            continue
        if layer.input_scale is not None and layer.input_scale.device.type == "meta":
            layer.input_scale = None  # W4A4 without a stored x scale: computed from each x (as load_checkpoint)
        for key in ("weight", "weight_scale", "weight_scale_2"):
            t = getattr(layer, key)
            if t is not None and t.device.type == "meta":
                raise ValueError(f"{name}.{key} was not in the checkpoint: the layer would be left uninitialised")
        layer.weight_scale_2 = stored_global_scale(f"{name}.weight_scale_2", layer.weight_scale_2, "modelopt")
        if layer.input_scale is not None:
            layer.input_scale = stored_global_scale(f"{name}.input_scale", layer.input_scale, "modelopt")
        codes = checked_bits(f"{name}.weight", layer.weight, (torch.uint8,), torch.uint8)
        scales = checked_bits(f"{name}.weight_scale", layer.weight_scale, (torch.float8_e4m3fn, torch.uint8),
                               torch.uint8)
        layer.set_plain(codes, scales)
