"""Calibration for `method="hessian"`: per nn.Linear, the 16x16 diagonal blocks of H = X^T X over
the layer's inputs X (T x K) seen on sample batches, collected with forward hooks.

Only the diagonal blocks matter: the block scales of group g change only the error in columns
16g .. 16g + 15, and the search minimizes each block's own term e_g^T H_g e_g (the cross-group
terms of the full e^T H e are not searched). Shape (K/16, 16, 16) fp32, accumulated in fp32.
"""

import warnings
from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn

from .format import BLOCK_SIZE

__all__ = ["collect_hessians", "hessian_blocks"]


def hessian_blocks(x: Tensor) -> Tensor:
    """Inputs (..., K) -> (K/16, 16, 16) fp32: sum over rows of x_g^T x_g per 16-column group."""
    k = x.shape[-1]
    xg = x.reshape(-1, k // BLOCK_SIZE, BLOCK_SIZE).float()
    return torch.einsum("tgi,tgj->gij", xg, xg)


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
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    if model.training:
        warnings.warn("collect_hessians: the model is in training mode (dropout on while "
                      "calibrating); call model.eval() first", stacklevel=2)
    hessians: dict[str, Tensor] = {}
    handles = []

    def hook(name):
        def accumulate(module, args, kwargs):  # nn.Linear.forward(input)
            h = hessian_blocks((args[0] if args else kwargs["input"]).detach())
            hessians[name] = h if name not in hessians else hessians[name] + h
        return accumulate

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
    return hessians
