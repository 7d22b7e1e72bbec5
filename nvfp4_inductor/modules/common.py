"""What the NVFP4 modules share: checks of loaded NVFP4 tensors, casts that keep the NVFP4
buffers' dtypes, and putting a new module in an old one's place."""

import torch
from torch import nn

from nvfp4_inductor import checks

__all__ = ["checked_global_scale", "checked_bits", "checked_input_scale", "apply_keeping_buffer_dtypes",
           "replace_module"]


def checked_global_scale(name: str, scale) -> torch.Tensor:
    """A global scale (a loaded weight_scale_2, whose shape load_state_dict checks against the
    module's; or x's, checked_input_scale): fp32, every element finite and > 0."""
    checks.check_tensor(name, scale, (torch.float32,))
    if not bool(torch.isfinite(scale).all() and (scale > 0).all()):  # set once, not per call: a sync is fine
        got = scale.item() if scale.numel() == 1 else scale.detach().flatten()[:4].tolist()
        raise ValueError(f"{name} must be finite and > 0; got {got}")
    return scale


def checked_bits(name: str, value, dtypes: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A loaded tensor of codes or scale bytes (one of dtypes: bits, as ModelOpt's e4m3 scales
    also travel as uint8 bytes) -> those bits as the module's buffer dtype. A value conversion
    would turn scale byte 0x76 into 118.0: other dtypes are refused."""
    checks.check_tensor(name, value, dtypes)
    return value.view(dtype)


def checked_input_scale(name: str, input_scale) -> torch.Tensor:
    """A static global scale of x: an fp32 tensor of one element, finite and > 0 -> its 0-d view."""
    checks.check_tensor(name, input_scale, (torch.float32,))
    if input_scale.numel() != 1:
        raise ValueError(f"{name} must hold one per-tensor scale; got shape {tuple(input_scale.shape)}")
    return checked_global_scale(name, input_scale.detach().reshape(()))


def apply_keeping_buffer_dtypes(module: nn.Module, apply, fn, recurse, names) -> nn.Module:
    """nn.Module._apply (`apply`, the caller's super()._apply) with the buffers named in names
    moved to fn's device but kept in their dtypes (NVFP4 codes, e4m3 scales, fp32 global scales:
    a cast such as `.half()` would change their meaning)."""
    before = {name: module._buffers[name] for name in names if module._buffers.get(name) is not None}
    apply(fn, recurse)
    for name, old in before.items():
        new = module._buffers[name]
        if new.dtype != old.dtype:
            module._buffers[name] = old.to(new.device)
    return module


# nn.Module's hook dicts: moved (the same dict objects, so the handles a user holds still remove
# them) from a replaced Linear to its NVFP4Linear
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
               "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_backward_pre_hooks",
               "_backward_hooks", "_state_dict_pre_hooks", "_state_dict_hooks",
               "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


def replace_module(model: nn.Module, name: str, old: nn.Module, new: nn.Module) -> None:
    """Put new in old's place at `name` in model, with old's mode and hooks."""
    _carry_module_state(old, new)
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def _carry_module_state(old: nn.Module, new: nn.Module) -> None:
    """The replaced Linear's train / eval mode and its hooks go to its replacement."""
    new.train(old.training)
    for name in _HOOK_DICTS + ("_is_full_backward_hook",):
        if name in old.__dict__:
            setattr(new, name, old.__dict__[name])
