"""The public API: an `NVFP4` tensor container and the functions that make and use it.

Each function checks its arguments, converts between the user-facing float8_e4m3fn scales and the
uint8 bits that cross op boundaries, and calls the matching `nvfp4::` op (so torch.compile sees
one opaque op per call, and device kernels registered for the op are used eagerly).
"""

import math
import numbers
from typing import NamedTuple

import torch
from torch import Tensor

from nvfp4_inductor import checks, ops

__all__ = [
    "NVFP4", "quantize", "dequantize", "dequantize_rows", "swizzle_scales", "unswizzle_scales",
    "linear",
]

_E4M3 = torch.float8_e4m3fn
_SCALE_DTYPES = (_E4M3, torch.uint8)


class NVFP4(NamedTuple):
    """An NVFP4 tensor of logical shape (..., K).

    data: uint8 (..., K/2), two E2M1 codes per byte (element 2i in the low nibble).
    scale: float8_e4m3fn (..., K/16), or, with swizzled, (ceil(rows/128)*128, ceil(K/64)*4) in the
        128x4-tile order that cuBLAS and block-scaled MMA read (rows = prod of the leading dims).
    global_scale: float32, shape () per tensor or (...,) per row.
    """

    data: Tensor
    scale: Tensor
    global_scale: Tensor
    shape: torch.Size
    swizzled: bool = False

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> Tensor:
        """-> (..., K) of dtype."""
        return dequantize(self, dtype)


def _scale_bits(name: str, scale) -> Tensor:
    checks.check_tensor(name, scale, _SCALE_DTYPES)
    return scale.view(torch.uint8)


def _global_scale_tensor(global_scale, x: Tensor, per_row: bool,
                         name: str = "global_scale") -> Tensor | None:
    """None, a positive finite Python number, or an fp32 tensor -> None or an fp32 tensor."""
    if global_scale is None or isinstance(global_scale, Tensor):
        if isinstance(global_scale, Tensor) and not per_row and global_scale.numel() == 1:
            return global_scale.reshape(())  # accept (1,) / (1, 1) per-tensor scales
        return global_scale
    if isinstance(global_scale, bool) or not isinstance(global_scale, numbers.Real):
        raise TypeError(
            f"{name} must be None, a float or a float32 tensor; got {type(global_scale).__name__}"
        )
    if per_row:
        raise ValueError(f"per_row=True needs a {name} tensor of shape x.shape[:-1], not a number")
    try:
        value = float(global_scale)
    except OverflowError:  # an int beyond any float (10**400): not finite in float32 either
        value = math.inf
    g = torch.tensor(value, dtype=torch.float32)  # the value used: fp32
    # Inside torch.compile a float argument may be symbolic (specialize_float=False): reading it
    # back would break the graph, so there it follows the tensor rule (not finite and > 0: NaN
    # blocks, the README's NaN policy) instead of raising here.
    if not torch.compiler.is_compiling() and not (math.isfinite(g.item()) and g.item() > 0):
        raise ValueError(f"{name} must be finite and > 0 in float32; got {global_scale} "
                         f"({g.item()} in float32)")
    # Filled on x's device, not copied from the host: a host-to-GPU copy synchronizes, and inside a
    # CUDA-graph capture it fails ("Cannot copy between CPU and CUDA tensors during CUDA graph
    # capture unless the CPU tensor is pinned").
    return torch.full((), value, dtype=torch.float32, device=x.device)


def quantize(x: Tensor, global_scale=None, *, swizzle: bool = False, per_row: bool = False,
             method: str = "rtn", hessian: Tensor | None = None) -> NVFP4:
    """(..., K) bf16/fp16/fp32, K % 16 == 0 -> NVFP4.

    global_scale None: computed on the device from amax (per tensor, or per row with per_row).
    Given (a float, or an fp32 tensor of shape () or, with per_row, x.shape[:-1]): used as is,
    the static scale for calibrated / CUDA-graph use. swizzle: scales in the 128x4-tile layout.
    method (for weights, per-tensor global scale only): "rtn" (round to nearest, the default),
    "mse" (per block the e4m3 scale with the smallest squared error), "hessian" (the smallest
    (w - w_hat)^T H (w - w_hat); hessian: fp32 (K/16, 16, 16) blocks of X^T X, see
    collect_hessians). The codes are always round-to-nearest-even for the chosen scale.
    """
    checks.check_float_input("x", x)
    checks.check_bool("swizzle", swizzle)
    checks.check_bool("per_row", per_row)
    checks.check_weight_method(method, hessian)
    if hessian is not None:
        checks.check_tensor("hessian", hessian, (torch.float32,))
    if method != "rtn" and per_row:
        raise ValueError(f'method={method!r} needs a per-tensor global scale; per_row=True is only '
                         'supported with method="rtn"')
    g = _global_scale_tensor(global_scale, x, per_row)
    if method == "rtn":
        data, scale, g = ops.quantize(x, g, per_row, swizzle)
    else:
        if g is not None and g.dim() != 0:
            raise ValueError(f"method={method!r} needs a per-tensor global scale of shape (); got "
                             f"shape {tuple(g.shape)}")
        data, scale, g = ops.quantize_weight(x, g, method, hessian, swizzle)
    return NVFP4(data, scale.view(_E4M3), g, x.shape, swizzle)


def _check_nvfp4(name: str, q) -> tuple[Tensor, Tensor]:
    """q: an NVFP4 whose data agrees with its logical shape -> (its scale as uint8 bits, its global
    scale; a one-element per-tensor scale of shape (1,) reshaped to ())."""
    if not isinstance(q, NVFP4):
        raise TypeError(f"{name} must be an nvfp4_inductor.NVFP4; got {type(q).__name__}")
    checks.check_tensor(f"{name}.data", q.data, (torch.uint8,))
    checks.check_bool(f"{name}.swizzled", q.swizzled)
    checks.check_tensor(f"{name}.global_scale", q.global_scale, (torch.float32,))
    expected = (*q.data.shape[:-1], q.data.shape[-1] * 2) if q.data.dim() else None
    if tuple(q.shape) != expected:
        raise ValueError(
            f"{name}.shape {tuple(q.shape)} does not match {name}.data of shape {tuple(q.data.shape)}"
        )
    g = q.global_scale
    if g.numel() == 1 and tuple(g.shape) != tuple(q.data.shape[:-1]):
        g = g.reshape(())
    return _scale_bits(f"{name}.scale", q.scale), g


def _check_dtype(dtype) -> None:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype; got {dtype!r}")


def dequantize(q: NVFP4, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """NVFP4 (..., K) -> (..., K) of dtype: e2m1(code) * block scale * global scale."""
    scale, g = _check_nvfp4("q", q)
    _check_dtype(dtype)
    return ops.dequantize(q.data, scale, g, q.swizzled, dtype)


def dequantize_rows(q: NVFP4, indices: Tensor, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """Rows of a 2-D NVFP4 (rows, K) named by int32/int64 indices (any shape) -> indices.shape + (K,).

    Reads only the selected rows. Eager mode raises IndexError for an index outside [0, rows);
    inside a CUDA-graph capture indices cannot be checked and such a row comes out NaN.
    """
    scale, g = _check_nvfp4("q", q)
    _check_dtype(dtype)
    checks.check_tensor("indices", indices, (torch.int32, torch.int64))
    return ops.dequantize_rows(q.data, scale, g, q.swizzled, indices, dtype)


def swizzle_scales(scale: Tensor) -> Tensor:
    """(rows, cols) e4m3 scales -> (ceil(rows/128)*128, ceil(cols/4)*4), 128x4-tile order, same dtype."""
    return ops.swizzle_scales(_scale_bits("scale", scale)).view(scale.dtype)


def unswizzle_scales(swizzled: Tensor, rows: int, cols: int) -> Tensor:
    """Swizzled e4m3 scales -> the plain (rows, cols) matrix, same dtype."""
    for name, value in (("rows", rows), ("cols", cols)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int; got {value!r}")
    return ops.unswizzle_scales(_scale_bits("swizzled", swizzled), rows, cols).view(swizzled.dtype)


def linear(x: Tensor, w_q: NVFP4, bias: Tensor | None = None, *, activations: str = "bf16",
           x_global_scale=None) -> Tensor:
    """y = x @ W^T (+ bias): x (..., K), w_q NVFP4 (N, K) -> (..., N) in x.dtype.

    activations (as Config.activations names it): "bf16": x is used as bf16 (W4A16); "nvfp4": x
    is quantized on the fly (W4A4) with a per-tensor global scale, computed from x on the device, or x_global_scale where given (a
    float, or an fp32 tensor of shape (); a calibrated static scale, see collect_input_scales:
    x's amax is then not computed, and values beyond 6 * 448 * x_global_scale saturate; the
    product of the two global scales multiplies the result, as in the CUDA kernels).
    W4A4 has no gradient for x: a backward through it raises.
    """
    checks.check_tensor("x", x, checks.FLOAT_DTYPES)
    w_scale, g = _check_nvfp4("w_q", w_q)
    if bias is not None:
        checks.check_tensor("bias", bias, checks.FLOAT_DTYPES)
    activation = activations
    if not isinstance(activation, str):
        raise TypeError(f"activations must be a str, one of {checks.ACTIVATIONS}; got {activation!r}")
    if x_global_scale is None:
        return ops.linear(x, w_q.data, w_scale, g, bias, w_q.swizzled, activation)
    if activation != "nvfp4":
        raise ValueError(f'x_global_scale quantizes x: it needs activations="nvfp4"; got {activation!r}')
    x_global_scale = _global_scale_tensor(x_global_scale, x, False, "x_global_scale")
    checks.check_global_scale("x_global_scale", x_global_scale, x.shape[:-1], False, "x", x)
    # W4A4 as its CUDA kernels compute it: x's codes times their block scales (exact in bf16, and
    # in x.dtype) multiplied as W4A16, the two global scales applied as one product in the
    # epilogue. (The CPU reference of dynamic W4A4 applies x's to x first: fp32 rounding apart.)
    # A backward through it raises, as W4A4's does (quantize_values has no gradient).
    values, x_global_scale = ops.quantize_values(x, x_global_scale)
    return ops.linear(values.to(x.dtype), w_q.data, w_scale, g * x_global_scale, bias, w_q.swizzled, "bf16")
