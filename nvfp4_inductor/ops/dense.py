"""The `nvfp4::` custom ops: schemas, fake (meta) kernels and the default implementation.

The default implementation is the pure-torch reference (it runs on any device); the Triton kernels
are registered for the CUDA dispatch key (imported on first use, so the package imports without
Triton). Scales cross op boundaries as uint8 holding e4m3 bits: `opcheck` cannot handle float8
op inputs on the CPU build, and the bits are the interchange format anyway (the public API views
them as float8_e4m3fn).
"""

import functools
import math

import torch
from torch import Tensor

from nvfp4_inductor import checks, reference
from nvfp4_inductor.format import BLOCK_SIZE
from nvfp4_inductor.kernels import gemm as eager_gemm  # (no Triton import: gemm.py imports its kernels when they launch)
from nvfp4_inductor.reference import scale_search, tiled

__all__ = [
    "quantize", "quantize_values", "rms_norm_quantize_values", "quantize_weight", "dequantize",
    "dequantize_rows", "swizzle_scales", "unswizzle_scales", "linear", "tile_weight", "untile_weight",
    "linear_tiled",
    "linear_tiled_silu_mul",
]

_E4M3 = torch.float8_e4m3fn


def on_input_device(impl):
    """A CUDA implementation, run with its first tensor argument's device current: Triton launches
    its kernels on the current device, and a layer placed on cuda:1 (device_map="auto", pipeline
    stages) is called while cuda:0 is current."""
    @functools.wraps(impl)
    def run(*args, **kwargs):
        first = next(a for a in (*args, *kwargs.values()) if isinstance(a, Tensor))
        with torch.cuda.device(first.device):
            return impl(*args, **kwargs)
    return run


def _scale_shape(lead: torch.Size, k: int, swizzle: bool):
    cols = k // BLOCK_SIZE
    # math.prod, not Size.numel(): numel() of symbolic sizes guards on their values (a recompile a size)
    return reference.swizzled_shape(math.prod(lead), cols) if swizzle else (*lead, cols)


def _plain_scale(scale: Tensor, lead: torch.Size, k: int, swizzled: bool) -> Tensor:
    """uint8 scale bits, plain or swizzled -> plain e4m3 (*lead, K/16)."""
    cols = k // BLOCK_SIZE
    if swizzled:
        scale = reference.unswizzle_scales(scale, math.prod(lead), cols).reshape(*lead, cols)
    return scale.view(_E4M3)


@torch.library.custom_op("nvfp4::quantize", mutates_args=())
def quantize(
    x: Tensor, global_scale: Tensor | None, per_row: bool, swizzle: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """(..., K) float -> (data uint8 (..., K/2), scale bits uint8, global scale fp32)."""
    checks.check_quantize_args(x, global_scale, per_row)
    lead, k = x.shape[:-1], x.shape[-1]
    data, scale, g = reference.quantize(x, global_scale, per_row)
    scale = scale.view(torch.uint8)
    if swizzle:
        scale = reference.swizzle_scales(scale.reshape(lead.numel(), k // BLOCK_SIZE))
    return data, scale, g


@quantize.register_fake
def _(x, global_scale, per_row, swizzle):
    checks.check_quantize_args(x, global_scale, per_row)
    lead, k = x.shape[:-1], x.shape[-1]
    data = x.new_empty((*lead, k // 2), dtype=torch.uint8)
    scale = x.new_empty(_scale_shape(lead, k, swizzle), dtype=torch.uint8)
    g = x.new_empty(lead if per_row else (), dtype=torch.float32)
    return data, scale, g


@torch.library.custom_op("nvfp4::quantize_weight", mutates_args=())
def quantize_weight(
    x: Tensor, global_scale: Tensor | None, method: str, hessian: Tensor | None, swizzle: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """(..., K) weights -> quantize's outputs, block scales chosen by method ("rtn", "mse",
    "hessian" with H (K/16, 16, 16) fp32); per-tensor global scale, dynamic when None."""
    checks.check_quantize_weight_args(x, global_scale, method, hessian)
    if hessian is not None:
        checks.check_hessian_values("hessian", hessian)
    lead, k = x.shape[:-1], x.shape[-1]
    data, scale, g = scale_search.quantize(x, global_scale, method, hessian)
    scale = scale.view(torch.uint8)
    if swizzle:
        scale = reference.swizzle_scales(scale.reshape(lead.numel(), k // BLOCK_SIZE))
    return data, scale, g


@quantize_weight.register_fake
def _(x, global_scale, method, hessian, swizzle):
    checks.check_quantize_weight_args(x, global_scale, method, hessian)
    lead, k = x.shape[:-1], x.shape[-1]
    data = x.new_empty((*lead, k // 2), dtype=torch.uint8)
    scale = x.new_empty(_scale_shape(lead, k, swizzle), dtype=torch.uint8)
    return data, scale, x.new_empty((), dtype=torch.float32)


@quantize_weight.register_kernel("cuda")
@on_input_device
def _(x, global_scale, method, hessian, swizzle):
    from nvfp4_inductor.kernels.quantize import quantize as quantize_triton
    from nvfp4_inductor.kernels.scale_search import search

    checks.check_quantize_weight_args(x, global_scale, method, hessian)
    if method == "rtn":
        return quantize_triton(x, global_scale, False, swizzle)
    if hessian is not None:
        checks.check_hessian_values("hessian", hessian)
    lead, k = x.shape[:-1], x.shape[-1]
    data, scale, g, _ = search(x, global_scale, method, hessian)
    if swizzle:
        scale = reference.swizzle_scales(scale.reshape(lead.numel(), k // BLOCK_SIZE))
    return data, scale, g


@torch.library.custom_op("nvfp4::dequantize", mutates_args=())
def dequantize(
    data: Tensor, scale: Tensor, global_scale: Tensor, swizzled: bool, dtype: torch.dtype
) -> Tensor:
    """NVFP4 parts -> (..., K) of dtype (bf16, fp16 or fp32)."""
    k = checks.check_dequantize_args(data, scale, global_scale, swizzled, dtype)
    plain = _plain_scale(scale, data.shape[:-1], k, swizzled)
    return reference.dequantize(data, plain, global_scale, dtype)


@dequantize.register_fake
def _(data, scale, global_scale, swizzled, dtype):
    k = checks.check_dequantize_args(data, scale, global_scale, swizzled, dtype)
    return data.new_empty((*data.shape[:-1], k), dtype=dtype)


@quantize.register_kernel("cuda")
@on_input_device
def _(x, global_scale, per_row, swizzle):
    from nvfp4_inductor.kernels.quantize import quantize as quantize_triton

    checks.check_quantize_args(x, global_scale, per_row)
    return quantize_triton(x, global_scale, per_row, swizzle)


@torch.library.custom_op("nvfp4::quantize_values", mutates_args=())
def quantize_values(x: Tensor, global_scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(..., K) float -> (values bf16 (..., K), global scale fp32 ()): x quantized to NVFP4 (per-tensor
    scale, as quantize: dynamic when None, else the given fp32 () one) and decoded without its
    global scale, e2m1 * block scale, which is exact in bf16. W4A4 on GPUs without FP4 tensor
    cores multiplies these (one kernel instead of quantize + dequantize, and no decode of x inside
    the GEMM); the global scale joins the weight's in the epilogue."""
    checks.check_quantize_args(x, global_scale, False)
    return reference.quantize_values(x, global_scale)


@quantize_values.register_fake
def _(x, global_scale=None):
    checks.check_quantize_args(x, global_scale, False)
    return x.new_empty(x.shape, dtype=torch.bfloat16), x.new_empty((), dtype=torch.float32)


@quantize_values.register_kernel("cuda")
@on_input_device
def _(x, global_scale=None):
    from nvfp4_inductor.kernels.quantize import quantize as quantize_triton

    checks.check_quantize_args(x, global_scale, False)
    values, _, g = quantize_triton(x, global_scale, False, False, values=True)
    return values, g


@torch.library.custom_op("nvfp4::rms_norm_quantize_values", mutates_args=())
def rms_norm_quantize_values(h: Tensor, weight: Tensor | None, eps: float,
                             weight_after_cast: bool) -> tuple[Tensor, Tensor]:
    """quantize_values(reference.rms_norm(h, weight, eps, weight_after_cast)): an RMSNorm whose
    output only feeds W4A4 linears, as one kernel on CUDA for decode-sized h (backend="nvfp4"
    puts it in place of such a norm and its quantize_values). h (..., K) bf16 / fp16."""
    checks.check_rms_norm_args(h, weight, eps)
    return reference.quantize_values(reference.rms_norm(h, weight, eps, weight_after_cast))


@rms_norm_quantize_values.register_fake
def _(h, weight, eps, weight_after_cast):
    checks.check_rms_norm_args(h, weight, eps)
    return h.new_empty(h.shape, dtype=torch.bfloat16), h.new_empty((), dtype=torch.float32)


@rms_norm_quantize_values.register_kernel("cuda")
@on_input_device
def _(h, weight, eps, weight_after_cast):
    from nvfp4_inductor.kernels.quantize import rms_norm_quantize_values as run

    checks.check_rms_norm_args(h, weight, eps)
    return run(h, weight, eps, weight_after_cast)


@dequantize.register_kernel("cuda")
@on_input_device
def _(data, scale, global_scale, swizzled, dtype):
    from nvfp4_inductor.kernels.dequantize import dequantize as dequantize_triton

    checks.check_dequantize_args(data, scale, global_scale, swizzled, dtype)
    return dequantize_triton(data, scale, global_scale, swizzled, dtype)


def _check_indices_in_range(indices: Tensor, rows: int) -> None:
    """Eager-mode range check of gather indices; it reads them back, so it is skipped inside a
    CUDA-graph capture (where the kernel turns an out-of-range index into a NaN row)."""
    if indices.numel() == 0 or (indices.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    bad = (indices < 0) | (indices >= rows)
    if bad.any():
        raise IndexError(
            f"indices: {indices[bad][0].item()} is out of range for q with {rows} rows "
            f"(valid: 0 .. {rows - 1})"
        )


@torch.library.custom_op("nvfp4::dequantize_rows", mutates_args=())
def dequantize_rows(
    data: Tensor, scale: Tensor, global_scale: Tensor, swizzled: bool, indices: Tensor,
    dtype: torch.dtype,
) -> Tensor:
    """Rows `indices` (any shape, int32/int64) of a 2-D NVFP4 (rows, K) -> indices.shape + (K,)."""
    k = checks.check_dequantize_rows_args(data, scale, global_scale, swizzled, indices, dtype)
    _check_indices_in_range(indices, data.shape[0])
    plain = _plain_scale(scale, data.shape[:-1], k, swizzled)
    index = indices.reshape(-1).long()
    g = global_scale if global_scale.dim() == 0 else global_scale[index]
    out = reference.dequantize(data[index], plain[index], g, dtype)
    return out.reshape(*indices.shape, k)


@dequantize_rows.register_fake
def _(data, scale, global_scale, swizzled, indices, dtype):
    k = checks.check_dequantize_rows_args(data, scale, global_scale, swizzled, indices, dtype)
    return data.new_empty((*indices.shape, k), dtype=dtype)


@dequantize_rows.register_kernel("cuda")
@on_input_device
def _(data, scale, global_scale, swizzled, indices, dtype):
    from nvfp4_inductor.kernels.dequantize import dequantize as dequantize_triton

    checks.check_dequantize_rows_args(data, scale, global_scale, swizzled, indices, dtype)
    _check_indices_in_range(indices, data.shape[0])
    return dequantize_triton(data, scale, global_scale, swizzled, dtype, indices)


@torch.library.custom_op("nvfp4::swizzle_scales", mutates_args=())
def swizzle_scales(scale: Tensor) -> Tensor:
    """(rows, cols) uint8 e4m3 bits -> (ceil(rows/128)*128, ceil(cols/4)*4) in 128x4-tile order."""
    checks.check_swizzle_args(scale)
    return reference.swizzle_scales(scale)


@swizzle_scales.register_fake
def _(scale):
    checks.check_swizzle_args(scale)
    return scale.new_empty(reference.swizzled_shape(*scale.shape))


@torch.library.custom_op("nvfp4::unswizzle_scales", mutates_args=())
def unswizzle_scales(swizzled: Tensor, rows: int, cols: int) -> Tensor:
    """Swizzled uint8 e4m3 bits -> the plain (rows, cols) matrix."""
    checks.check_unswizzle_args(swizzled, rows, cols)
    return reference.unswizzle_scales(swizzled, rows, cols)


@unswizzle_scales.register_fake
def _(swizzled, rows, cols):
    checks.check_unswizzle_args(swizzled, rows, cols)
    return swizzled.new_empty((rows, cols))


@torch.library.custom_op("nvfp4::linear", mutates_args=())
def linear(
    x: Tensor,
    w_data: Tensor,
    w_scale: Tensor,
    w_global_scale: Tensor,
    bias: Tensor | None,
    w_swizzled: bool,
    activation: str,
) -> Tensor:
    """x (..., K) @ W^T with W NVFP4 (N, K/2) (+ bias (N,)) -> (..., N) in x.dtype."""
    checks.check_linear_args(x, w_data, w_scale, w_global_scale, bias, w_swizzled, activation)
    k = x.shape[-1]
    plain = _plain_scale(w_scale, w_data.shape[:-1], k, w_swizzled)
    return reference.linear(x, w_data, plain, w_global_scale, bias, activation)


@linear.register_kernel("cuda")
@on_input_device
def _(x, w_data, w_scale, w_global_scale, bias, w_swizzled, activation):
    checks.check_linear_args(x, w_data, w_scale, w_global_scale, bias, w_swizzled, activation)
    with reference.no_autocast(x):  # its dequantize + cuBLAS path multiplies through torch.mm
        return eager_gemm.linear(x, w_data, w_scale, w_global_scale, bias, w_swizzled, activation)


@linear.register_fake
def _(x, w_data, w_scale, w_global_scale, bias, w_swizzled, activation):
    checks.check_linear_args(x, w_data, w_scale, w_global_scale, bias, w_swizzled, activation)
    return x.new_empty((*x.shape[:-1], w_data.shape[0]))


@torch.library.custom_op("nvfp4::no_gradient", mutates_args=())
def no_gradient(like: Tensor, message: str) -> Tensor:
    """The gradient of an input that has none (W4A4's quantized x): raises RuntimeError(message)
    when a backward runs it. For the tracer it is a tensor like `like`: torch.compile traces the
    backward with the forward, and raising there would fail the compile of a forward that never
    backpropagates (x requiring grad outside no_grad)."""
    raise RuntimeError(message)


@no_gradient.register_fake
def _(like, message):
    return torch.empty_like(like)


def _linear_setup_context(ctx, inputs, output):
    x, w_data, w_scale, w_global_scale, bias, w_swizzled, activation = inputs
    ctx.save_for_backward(w_data, w_scale, w_global_scale)
    ctx.w_swizzled, ctx.activation = w_swizzled, activation
    ctx.x_shape, ctx.x_dtype, ctx.bias_dtype = x.shape, x.dtype, None if bias is None else bias.dtype


def _x_and_bias_grads(ctx, grad, op: str, weight):
    """Gradients for x (W4A16: x is rounded to bf16 and multiplied by W, so dL/dx = dL/dy @ W, the
    rounding passed straight through, as autograd does for a cast) and bias; the NVFP4 weight is
    constant data. W4A4 quantizes x (a step function): no gradient, an error rather than zeros
    (no_gradient: when the backward runs). weight(dtype) -> W dequantized, (N, K)."""
    grad_x = grad_bias = None
    if ctx.needs_input_grad[0]:
        if ctx.activation != "bf16":
            grad_x = no_gradient(grad.new_empty(ctx.x_shape, dtype=ctx.x_dtype),
                                 f"{op} with activation={ctx.activation!r} quantizes x, "
                                 "which has no gradient; use activation='bf16' (W4A16) to "
                                 "backpropagate through an NVFP4 linear")
        else:
            with reference.no_autocast(grad):
                grad_x = (grad @ weight(grad.dtype)).to(ctx.x_dtype)
    if ctx.needs_input_grad[4]:
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0).to(ctx.bias_dtype)
    return grad_x, grad_bias


def _linear_backward(ctx, grad):
    w_data, w_scale, w_global_scale = ctx.saved_tensors
    grad_x, grad_bias = _x_and_bias_grads(
        ctx, grad, "nvfp4::linear",
        lambda dtype: dequantize(w_data, w_scale, w_global_scale, ctx.w_swizzled, dtype))
    return grad_x, None, None, None, grad_bias, None, None


linear.register_autograd(_linear_backward, setup_context=_linear_setup_context)


def _no_gradient(ctx, inputs, output):
    ctx.mark_non_differentiable(*output)


def _never_called(ctx, *grads):
    raise AssertionError("outputs marked non-differentiable")


# Quantization is a step function: its outputs (codes, scales, the global scale) carry no
# gradient, rather than requiring one that backward cannot give.
quantize.register_autograd(_never_called, setup_context=_no_gradient)
quantize_weight.register_autograd(_never_called, setup_context=_no_gradient)


def _values_setup_context(ctx, inputs, output):
    ctx.mark_non_differentiable(output[1])  # the global scale
    ctx.x_dtype = inputs[0].dtype


def _values_backward(ctx, grad_values, grad_g):
    """quantize_values' values stand for x in W4A4 (nv.linear with a static x_global_scale
    multiplies them as W4A16 does): as nvfp4::linear's W4A4, an error rather than zeros."""
    message = ("W4A4 (activation='nvfp4') quantizes x, which has no gradient; use activation='bf16' "
               "(W4A16) to backpropagate through an NVFP4 linear")
    return no_gradient(torch.empty_like(grad_values, dtype=ctx.x_dtype), message), None


quantize_values.register_autograd(_values_backward, setup_context=_values_setup_context)


@torch.library.custom_op("nvfp4::tile_weight", mutates_args=())
def tile_weight(data: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
    """uint8 (N, K/2) codes + plain (N, K/16) scale bits -> the tiled layout (nvfp4_inductor.reference.tiled)."""
    checks.check_tile_args(data, scale)
    return tiled.tile(data, scale)


@tile_weight.register_fake
def _(data, scale):
    checks.check_tile_args(data, scale)
    data_shape, scale_shape = tiled.tiled_shapes(data.shape[0], data.shape[1] * 2)
    return data.new_empty(data_shape), scale.new_empty(scale_shape)


@torch.library.custom_op("nvfp4::untile_weight", mutates_args=())
def untile_weight(data: Tensor, scale: Tensor, n: int, k: int) -> tuple[Tensor, Tensor]:
    """The tiled layout of an (N, K) weight -> uint8 (N, K/2) codes + plain (N, K/16) scale bits
    (tile_weight's inverse)."""
    checks.check_untile_args(data, scale, n, k)
    return tiled.untile(data, scale, n, k)


@untile_weight.register_fake
def _(data, scale, n, k):
    checks.check_untile_args(data, scale, n, k)
    return data.new_empty((n, k // 2)), scale.new_empty((n, k // BLOCK_SIZE))


@torch.library.custom_op("nvfp4::linear_tiled", mutates_args=())
def linear_tiled(
    x: Tensor,
    w_data: Tensor,
    w_scale: Tensor,
    w_global_scale: Tensor,
    bias: Tensor | None,
    n: int,
    activation: str,
    norm_h: Tensor | None = None,
    norm_eps: float = 0.0,
) -> Tensor:
    """nvfp4::linear with W (N = n rows) in the tiled layout -> (..., N) in x.dtype.

    The tiled layout pads N and K to whole 64 x 64 tiles and records neither: n must be the
    weight's row count and x's K its column count (checked only up to the padding: a K or n short
    of the weight's by less than a tile reads part of it).

    norm_h: an RMSNorm deferred into the linear (backend="nvfp4" at W4A16 decode): x is the norm's
    input h times its weight, norm_h is h, and each row's products are multiplied by
    rsqrt(mean(h^2) + norm_eps) (reference.rms_scale) before the global scale and the bias."""
    checks.check_linear_tiled_args(x, w_data, w_scale, w_global_scale, bias, n, activation)
    checks.check_norm_input(norm_h, norm_eps, x)
    data, scale = tiled.untile(w_data, w_scale, n, x.shape[-1])
    row_scale = (None if norm_h is None
                 else reference.rms_scale(norm_h, norm_eps).reshape(*x.shape[:-1], 1))
    return reference.linear(x, data, scale.view(_E4M3), w_global_scale, bias, activation, row_scale)


@linear_tiled.register_kernel("cuda")
@on_input_device
def _(x, w_data, w_scale, w_global_scale, bias, n, activation, norm_h=None, norm_eps=0.0):
    checks.check_linear_tiled_args(x, w_data, w_scale, w_global_scale, bias, n, activation)
    checks.check_norm_input(norm_h, norm_eps, x)
    with reference.no_autocast(x):  # its dequantize + cuBLAS path multiplies through torch.mm
        return eager_gemm.linear_tiled(x, w_data, w_scale, w_global_scale, bias, n, activation, norm_h, norm_eps)


@linear_tiled.register_fake
def _(x, w_data, w_scale, w_global_scale, bias, n, activation, norm_h=None, norm_eps=0.0):
    checks.check_linear_tiled_args(x, w_data, w_scale, w_global_scale, bias, n, activation)
    checks.check_norm_input(norm_h, norm_eps, x)
    return x.new_empty((*x.shape[:-1], n))


def _linear_tiled_setup_context(ctx, inputs, output):
    x, w_data, w_scale, w_global_scale, bias, n, activation, norm_h, norm_eps = inputs
    ctx.save_for_backward(w_data, w_scale, w_global_scale)
    ctx.n, ctx.activation, ctx.deferred_norm = n, activation, norm_h is not None
    ctx.x_shape, ctx.x_dtype, ctx.bias_dtype = x.shape, x.dtype, None if bias is None else bias.dtype


def _linear_tiled_backward(ctx, grad):
    """As nvfp4::linear's backward. A deferred RMSNorm (norm_h, which only backend="nvfp4"'s
    inference graphs pass) has none."""
    w_data, w_scale, w_global_scale = ctx.saved_tensors
    if ctx.deferred_norm and any(ctx.needs_input_grad):
        raise RuntimeError("nvfp4::linear_tiled with a deferred RMSNorm (norm_h) has no gradient")

    def weight(dtype):
        data, scale = untile_weight(w_data, w_scale, ctx.n, ctx.x_shape[-1])
        return dequantize(data, scale, w_global_scale, False, dtype)

    grad_x, grad_bias = _x_and_bias_grads(ctx, grad, "nvfp4::linear_tiled", weight)
    return grad_x, None, None, None, grad_bias, None, None, None, None


linear_tiled.register_autograd(_linear_tiled_backward, setup_context=_linear_tiled_setup_context)


@torch.library.custom_op("nvfp4::linear_tiled_silu_mul", mutates_args=())
def linear_tiled_silu_mul(
    x: Tensor, w_data: Tensor, w_scale: Tensor, w_global_scale: Tensor,
    x_global_scale: Tensor | None, n: int, activation: str, norm_h: Tensor | None = None,
    norm_eps: float = 0.0,
) -> Tensor:
    """A gated MLP's F.silu(gate(x)) * up(x), the two bias-less linears as one tiled weight of 2n
    rows interleaved by tiled.interleave_halves (w_global_scale (2n,) likewise) -> (..., n) in
    x.dtype: each linear rounded to x.dtype, then reference.silu_mul. x_global_scale (fp32 ()):
    x is W4A4's quantized values (from a fused producer), multiplied as bf16 with the global
    scales w_global_scale * x_global_scale. backend="nvfp4" puts it in place of such an MLP's
    merged GEMM at decode; its Inductor template applies SiLU * mul in the GEMM's epilogue.
    norm_h, norm_eps: a deferred RMSNorm, as for linear_tiled."""
    checks.check_silu_mul_linear_args(n, w_global_scale, x_global_scale)
    g = w_global_scale if x_global_scale is None else w_global_scale * x_global_scale
    y = torch.ops.nvfp4.linear_tiled(x, w_data, w_scale, g, None, 2 * n, activation, norm_h, norm_eps)
    gate, up = tiled.split_halves(y)
    return reference.silu_mul(gate, up)


@linear_tiled_silu_mul.register_fake
def _(x, w_data, w_scale, w_global_scale, x_global_scale, n, activation, norm_h=None, norm_eps=0.0):
    checks.check_silu_mul_linear_args(n, w_global_scale, x_global_scale)
    checks.check_linear_tiled_args(x, w_data, w_scale, w_global_scale, None, 2 * n, activation)
    checks.check_norm_input(norm_h, norm_eps, x)
    return x.new_empty((*x.shape[:-1], n))
