"""The package's options: `Config`, and which layers it converts (`layer_skip_reason`), as
`convert()` and `backend="nvfp4"` both decide them."""

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from nvfp4_inductor import capability, checks
from nvfp4_inductor.format import BLOCK_SIZE

__all__ = ["Config"]

ACTIVATION_MODES = ("auto", "nvfp4", "bf16")
# Names of output heads, skipped by default: their error reaches the logits directly.
OUTPUT_HEAD_NAMES = ("lm_head", "output", "head", "classifier")


@dataclass(frozen=True)
class Config:
    """User options for NVFP4 conversion.

    activations: "bf16" (W4A16), "nvfp4" (W4A4), or "auto": W4A4 where the GPU multiplies NVFP4
        natively (sm_100 and newer), else W4A16.
    include: called with (qualified name, module); a layer is converted only where it returns
        True. None converts every eligible layer.
    skip_output_head: leave layers whose last name component is one of OUTPUT_HEAD_NAMES in bf16.
    Under backend="nvfp4", include receives the weight's module path where Dynamo records it
    (else the graph's parameter name) and module None.
    min_weight_numel: leave smaller layers (out * in below this) in bf16.
    weight_method: how block scales are chosen: "rtn" (round to nearest), "mse" (smallest squared
        error per block) or "hessian" (smallest (w - w_hat)^T H (w - w_hat) per block).
    hessians: for "hessian", {layer name: (in_features/16, 16, 16) fp32}, e.g. from
        nvfp4_inductor.collect_hessians; every converted layer needs one. Not supported under
        backend="nvfp4" (convert() first, then compile).
    input_scales: {layer name: fp32 () global scale of its input}, e.g. from
        nvfp4_inductor.collect_input_scales: W4A4 layers (activations "nvfp4", or "auto" where it
        means W4A4) then quantize their input with this static (calibrated) scale instead of one
        computed from each input; every converted layer needs one. Not supported under
        backend="nvfp4" (convert() first, then compile).
    merge_linears: under backend="nvfp4", linears that read the same input (q / k / v, gate /
        up) become one GEMM at decode sizes (at most 64 rows), each weight keeping its own global
        scale (nvfp4_inductor/lowerings/passes/linear.py).
    fuse_norms: under backend="nvfp4", an RMSNorm whose output only feeds NVFP4 linears at decode
        sizes leaves its own kernel: W4A4 quantizes in the norm's kernel (at most 2 rows), W4A16
        GEMMs apply the norm themselves (h of up to 4096 elements with rows and K each rounded up
        to a power of two: one row of 4096, 16 rows of 256; rounded otherwise than the norm, no
        less accurately: nvfp4_inductor/lowerings/passes/norms.py). False keeps Inductor's norm kernels.
    share_global_scales: nv.convert gives the layers that serving engines fuse (q / k / v, gate /
        up: nvfp4_inductor.modules.convert.FUSED_GROUPS, siblings of one parent) one global scale, the
        largest of theirs, as ModelOpt and llmcompressor export them: vLLM, SGLang and TensorRT-LLM
        read one scale per fused group, and decode per-layer scales wrongly. For checkpoints meant
        for them (save_checkpoint warns about groups without it).
    """

    activations: str = "auto"
    include: Callable[[str, nn.Module], bool] | None = None
    skip_output_head: bool = True
    min_weight_numel: int = 0
    weight_method: str = "rtn"
    hessians: dict | None = field(default=None, compare=False)  # tensors: not hashed / compared
    input_scales: dict | None = field(default=None, compare=False)
    merge_linears: bool = True
    fuse_norms: bool = True
    share_global_scales: bool = False

    def __post_init__(self):
        check_activations(self.activations)
        if self.include is not None and not callable(self.include):
            raise TypeError(f"include must be callable (name, module) -> bool or None; got {self.include!r}")
        checks.check_bool("skip_output_head", self.skip_output_head)
        if (not isinstance(self.min_weight_numel, int) or isinstance(self.min_weight_numel, bool)
                or self.min_weight_numel < 0):
            raise ValueError(f"min_weight_numel must be an int >= 0; got {self.min_weight_numel!r}")
        if self.hessians is not None and not isinstance(self.hessians, dict):
            raise TypeError(f"hessians must be a dict {{layer name: tensor}} or None; got "
                            f"{type(self.hessians).__name__}")
        checks.check_weight_method(self.weight_method, self.hessians)
        if self.input_scales is not None:
            if not isinstance(self.input_scales, dict):
                raise TypeError(f"input_scales must be a dict {{layer name: tensor}} or None; got "
                                f"{type(self.input_scales).__name__}")
            if self.activations == "bf16":
                raise ValueError('input_scales quantize activations: they need activations="nvfp4" '
                                 '(or "auto", W4A4 where the GPU multiplies NVFP4); got "bf16"')
        checks.check_bool("merge_linears", self.merge_linears)
        checks.check_bool("fuse_norms", self.fuse_norms)
        checks.check_bool("share_global_scales", self.share_global_scales)


def check_activations(mode) -> None:
    if mode not in ACTIVATION_MODES:
        raise ValueError(f"activations must be one of {ACTIVATION_MODES}; got {mode!r}")


def resolve_activation(mode: str, device: torch.device) -> str:
    """The activation format Config's `mode` means on `device` ("auto": NVFP4 x where the hardware
    multiplies it, sm_100+)."""
    if mode != "auto":
        return mode
    if capability.block_scaled_mma(device):
        return "nvfp4"
    return "bf16"


def _is_output_head(name: str) -> bool:
    """A module path ("model.lm_head") whose last component is one of OUTPUT_HEAD_NAMES. A flat
    Dynamo parameter name ("L__self___lm_head_weight", where the backend finds no module path)
    has no component boundaries: there the name ending in "_" + head counts."""
    if "." in name or not name.startswith("L_"):
        return name.rpartition(".")[2] in OUTPUT_HEAD_NAMES
    stem = name.removesuffix("_weight")
    return any(stem.endswith("_" + head) for head in OUTPUT_HEAD_NAMES)


def layer_skip_reason(config: Config, name: str, shape, module: nn.Module | None = None) -> str | None:
    """Why Config leaves the linear `name` with an (out, in) weight in bf16, or None to convert.
    Used by convert() and by backend="nvfp4" (which knows no module: module None there)."""
    out_features, in_features = shape
    if not out_features or not in_features:
        return f"shape ({out_features}, {in_features}) has no weights"
    if config.skip_output_head and _is_output_head(name):  # (whatever its shape: the reason that holds)
        return "output head (Config.skip_output_head)"
    if in_features % BLOCK_SIZE or out_features % BLOCK_SIZE:
        return f"shape ({out_features}, {in_features}) is not a multiple of {BLOCK_SIZE}"
    if out_features * in_features < config.min_weight_numel:
        return f"{out_features * in_features} weights < Config.min_weight_numel"
    if config.include is not None and not config.include(name, module):
        return "excluded by Config.include"
    return None
