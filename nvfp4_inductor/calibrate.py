"""Calibration, from each nn.Linear's inputs X (T x K) seen on sample batches (forward hooks):
for `method="hessian"` the 16x16 diagonal blocks of H = X^T X; for W4A4 with static activation
scales, the global scale of X's largest magnitude.

Of H only the diagonal blocks matter: the block scales of group g change only the error in columns
16g .. 16g + 15, and the search minimizes each block's own term e_g^T H_g e_g (the cross-group
terms of the full e^T H e are not searched). Shape (K/16, 16, 16) fp32, accumulated in fp32.
"""

import warnings
from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn

from nvfp4_inductor import checks, reference
from nvfp4_inductor.format import BLOCK_SIZE
from nvfp4_inductor.reference import global_scale_from_amax

__all__ = ["collect_hessians", "collect_input_scales", "hessian_blocks"]


def hessian_blocks(x: Tensor) -> Tensor:
    """Inputs (..., K), K a multiple of 16 -> (K/16, 16, 16) fp32: sum over rows of x_g^T x_g per
    16-column group."""
    if not isinstance(x, Tensor) or x.dim() == 0:
        raise ValueError(f"hessian_blocks takes inputs (..., K); got {x!r:.80}")
    k = x.shape[-1]
    checks.check_k("x.shape[-1]", k)
    xg = x.reshape(-1, k // BLOCK_SIZE, BLOCK_SIZE).float()
    with reference.no_autocast(xg):  # calibration batches may run under a user's autocast
        return torch.einsum("tgi,tgj->gij", xg, xg)


def _observe_linear_inputs(model: nn.Module, batches: Iterable, include, observe, caller: str) -> None:
    """Run model on each batch (a tensor, a tuple or list of positional arguments, or a dict of
    keyword arguments) under no_grad, calling observe(name, x) with the input x of every nn.Linear
    whose in_features is a multiple of 16 (and that include(name, module) accepts)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    if model.training:
        warnings.warn(f"{caller}: the model is in training mode (dropout on while "
                      "calibrating); call model.eval() first", stacklevel=3)
    handles = []

    def hook(name):
        def pre_forward(module, args, kwargs):  # nn.Linear.forward(input)
            observe(name, (args[0] if args else kwargs["input"]).detach())
        return pre_forward

    for name, module in model.named_modules():
        if (type(module) is nn.Linear and module.in_features % BLOCK_SIZE == 0
                and (include is None or include(name, module))):
            handles.append(module.register_forward_pre_hook(hook(name), with_kwargs=True))
    try:
        with torch.no_grad():
            for batch in batches:
                if isinstance(batch, (tuple, list)):
                    model(*batch)
                elif isinstance(batch, dict):
                    model(**batch)
                else:
                    model(batch)
    finally:
        for handle in handles:
            handle.remove()


def collect_hessians(
    model: nn.Module,
    batches: Iterable,
    include: Callable[[str, nn.Module], bool] | None = None,
) -> dict[str, Tensor]:
    """Run model on each batch (a tensor, a tuple or list of positional arguments, or a dict of
    keyword arguments) under no_grad and return {linear name: (in_features/16, 16, 16) fp32 H} for
    every nn.Linear whose in_features is a multiple of 16 (and that include(name, module) accepts).
    Keys are the names convert() uses. The model runs in the mode it is in: eval() first (a model
    in training mode calibrates with dropout on, and a warning says so)."""
    hessians: dict[str, Tensor] = {}

    def accumulate(name, x):
        h = hessian_blocks(x)
        hessians[name] = h if name not in hessians else hessians[name] + h

    _observe_linear_inputs(model, batches, include, accumulate, "collect_hessians")
    return hessians


def collect_input_scales(
    model: nn.Module,
    batches: Iterable,
    include: Callable[[str, nn.Module], bool] | None = None,
) -> dict[str, Tensor]:
    """Static global scales for W4A4 activations: run model (bf16, before convert) on each batch as
    collect_hessians does and return {linear name: fp32 () scale}, the scale that x's largest
    magnitude over all batches gets from the dynamic rule (amax / (6 * 448)), for every
    nn.Linear whose in_features is a multiple of 16 (and that include accepts). Pass them as
    Config(activations="nvfp4", input_scales=...) to convert(). Inputs larger than that amax
    saturate later; a NaN or Inf input, or a layer that only saw zeros, is an error."""
    amax: dict[str, Tensor] = {}

    def track(name, x):
        a = x.float().abs().amax() if x.numel() else x.new_zeros((), dtype=torch.float32)
        amax[name] = a if name not in amax else torch.maximum(amax[name], a)

    _observe_linear_inputs(model, batches, include, track, "collect_input_scales")
    scales = {}
    for name, a in amax.items():
        if not torch.isfinite(a):
            raise ValueError(f"collect_input_scales: layer {name!r} saw a NaN or Inf input")
        if a == 0:
            raise ValueError(f"collect_input_scales: layer {name!r} saw only zeros (no scale to "
                             "derive; calibrate with other batches, or leave it out with include)")
        scales[name] = global_scale_from_amax(a)
    return scales
