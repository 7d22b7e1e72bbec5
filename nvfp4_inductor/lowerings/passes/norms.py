"""RMSNorms at decode that only feed NVFP4 linears: W4A4 quantizes in the norm's kernel, W4A16
defers the norm into the GEMM.

W4A4.

After the linear rewrite, a W4A4 linear is `linear_tiled(x, ..., g, b, N, "nvfp4")`: quantize_values
(x) -> (values, x_global_scale), the W4A16 GEMM on the values, (g * x_global_scale) in the
epilogue. Where x is an
RMSNorm of h (a decoder's attention and MLP inputs), two kernels run before the GEMM (the norm
Inductor generates, the quantize kernel); this pass makes them one,

    values, x_global_scale = nvfp4.rms_norm_quantize_values(h, weight, eps, weight_after_cast)
    y = nvfp4.linear_tiled(values, ..., g * x_global_scale, b, N, "bf16")

the same numbers as quantize_values of the norm (reference.rms_norm) multiplied as W4A4 does. The
residual add that fed the norm then fuses into the GEMM that produces it (its epilogue).
Only for bf16 h (the linear's output takes its x's dtype, the values' bf16) of at most MAX_ROWS
rows (every program of the fused kernel normalizes all of h for the global amax, so at 4 rows the
two kernels are faster: docs/backend.md), static shapes,
where every use of the norm's output is the x of such a linear, and not on GPUs with FP4 tensor
cores (W4A4 there quantizes x to codes for the block-scaled MMA).

The norm is recognised in the traced forms of the usual modules (torch 2.11 and 2.13 trace
nn.RMSNorm and the hand-written ones alike):

    hf = convert_element_type(h, float32)                   h bf16 / fp16
    n  = hf * rsqrt(mean(hf ** 2 | hf * hf, [-1], keepdim=True) + eps)
    y  = convert_element_type(n [* w], h.dtype)             weight_after_cast False (or no weight)
    y  = w * convert_element_type(n, h.dtype)               True: w in h's dtype (Hugging Face)

W4A16 (defer_rms_norms). Otherwise the norm is a kernel of its own between the GEMM that produced
h (its residual add fused into that GEMM's epilogue) and the linears reading y: one launch and an
8 KB round trip on the critical path a norm (docs/decisions.md). This pass writes

    x = h * w                      rounded to h's dtype as the norm rounds y (w in fp32 first,
                                   or after the cast), Inductor fuses it into h's producer
    out = nvfp4.linear_tiled(x, ..., norm_h=h, norm_eps=eps)

and the GEMM multiplies each row's products by rsqrt(mean(h^2) + eps): the last split of each of
the template's tiles reads h whole, its loads in flight with the partial sums'
(templates/nvfp4_tiled_gemm.py.jinja, RMS). The result is the norm's up to rounding: the factor
multiplies fp32 products instead of h before its rounding to bf16 (the same error against float64
as the norm then the linear: docs/backend.md).
For static bf16 h (in fp16, h * w rounded before the norm's factor can overflow where the normalized
output does not) where plan.norm_deferred says so (at most DEFER_NORM_MAX_ROWS rows and
RMS_MAX_ELEMENTS elements, rows and K rounded up to powers of two: 1 row of 4096), on a device the
template runs on, where every use of the norm's output is the x of a W4A16 linear. (Sums of squares
split like the products, for any size, cost more than the norm's kernel at 16 rows:
docs/decisions.md.)
"""

import operator

import torch
from torch import fx

from nvfp4_inductor.capability import template_device
from nvfp4_inductor.kernels import plan
from nvfp4_inductor.kernels.plan import norm_deferred
from nvfp4_inductor.lowerings.passes.fx import CONVERT as _CONVERT
from nvfp4_inductor.lowerings.passes.fx import (
    call as _call, LINEAR, pairs as _pairs, tensor_val as _tensor_val, VIEWS as _VIEWS,
)
from nvfp4_inductor.lowerings.passes.fx import val as _val, view_root

aten = torch.ops.aten
# the ops whose x a W4A4 linear quantizes; x is their first argument, the activation the last
LINEARS = (LINEAR, torch.ops.nvfp4.linear_tiled_silu_mul.default)
FUSED = torch.ops.nvfp4.rms_norm_quantize_values.default
_HALF = (torch.bfloat16, torch.float16)
MAX_ROWS = 2  # rows of h up to which the fused kernel measured faster (module docstring)


def _rms(n: fx.Node):
    """n = hf * rsqrt(mean(hf^2, last dim, keepdim) + eps) -> (h, eps), else None."""
    if not _call(n, aten.mul.Tensor) or n.kwargs:
        return None
    for hf, r in _pairs(n):
        if not (_call(hf, _CONVERT) and hf.args[1] == torch.float32 and _call(r, aten.rsqrt.default)):
            continue
        h, add = hf.args[0], r.args[0]
        h_val = _tensor_val(h)
        if h_val is None or h_val.dtype not in _HALF:
            continue
        if not (_call(add, aten.add.Tensor, aten.add.Scalar) and not add.kwargs
                and isinstance(add.args[1], (int, float)) and _call(add.args[0], aten.mean.dim)):
            continue
        mean = add.args[0]
        ndim = h_val.dim()
        dim = mean.args[1] if len(mean.args) > 1 else mean.kwargs.get("dim")
        if not isinstance(dim, (list, tuple)):  # dim=None: the mean over the whole tensor
            continue
        dims = [d % ndim for d in dim]
        keepdim = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
        square = mean.args[0]
        squares = ((_call(square, aten.pow.Tensor_Scalar) and square.args[0] is hf and square.args[1] == 2)
                   or (_call(square, aten.mul.Tensor) and square.args[:2] == (hf, hf)))
        if dims == [ndim - 1] and keepdim and squares and "dtype" not in mean.kwargs:
            return h, float(add.args[1])
    return None


def _weight_ok(w, h: fx.Node, dtypes) -> bool:
    val = _tensor_val(w)  # None where the factor is a size or a scalar (dynamic shapes)
    return val is not None and tuple(val.shape) == (_val(h).shape[-1],) and val.dtype in dtypes


def match_rms_norm(y: fx.Node):
    """y = an RMSNorm's output in a traced form (module docstring) -> (h, weight or None, eps,
    weight_after_cast), else None."""
    if _call(y, aten.mul.Tensor) and not y.kwargs:  # w * n.to(dtype)
        for w, c in _pairs(y):
            if _call(c, _CONVERT) and (rms := _rms(c.args[0])):
                h, eps = rms
                if c.args[1] == _val(h).dtype and _weight_ok(w, h, (_val(h).dtype,)):
                    return h, w, eps, True
        return None
    if not _call(y, _CONVERT):
        return None
    n = y.args[0]
    if (rms := _rms(n)) is not None:
        weight = None
    elif _call(n, aten.mul.Tensor) and not n.kwargs:  # n * w in fp32
        for m, w in _pairs(n):
            if (rms := _rms(m)) is not None and _weight_ok(w, rms[0], (torch.float32, *_HALF)):
                weight = w
                break
        else:
            return None
    else:
        return None
    h, eps = rms
    return (h, weight, eps, False) if y.args[1] == _val(h).dtype else None


def _linear_uses(y: fx.Node, activation: str = "nvfp4"):
    """The linears with these activations reading y (through views) as x, none of them with a
    deferred norm -> list, or None where anything else does."""
    linears, pending = [], [y]
    width = _val(y).shape[-1]
    while pending:
        node = pending.pop()
        for user in node.users:
            # views that keep the norm's rows (its last dim): the fused kernel and the deferred norm
            # take x's rows as h's
            if (_call(user, *_VIEWS) and user.args[0] is node and _val(user) is not None
                    and _val(user).shape[-1] == width):
                pending.append(user)
            elif (_call(user, *LINEARS) and user.args[-1] == activation and user.args[0] is node
                  and node not in user.args[1:] and not user.kwargs):
                linears.append(user)
            else:
                return None
    return linears


def _fits(h_val) -> bool:
    from nvfp4_inductor.kernels.quantize import fits_fused_amax  # imports Triton: only when the pass runs

    shape = h_val.shape
    if not all(isinstance(d, int) for d in shape) or not 0 < shape.numel() <= MAX_ROWS * shape[-1]:
        return False
    if plan.x_format("nvfp4", h_val.device) == "nvfp4":  # (W4A4 takes x's codes there)
        return False
    return fits_fused_amax(shape.numel() // shape[-1], shape[-1])


def _fake(node: fx.Node, target, args):
    """node.meta["val"] from target on the arguments' fake values, where they all have one (the
    linear rewrite's weight-side nodes have none, and need none: freezing folds them)."""
    vals = [_val(a) if isinstance(a, fx.Node) else a for a in args]
    if any(v is None for v, a in zip(vals, args) if isinstance(a, fx.Node)):
        return None
    fake_mode = next(v for v in vals if isinstance(v, torch.Tensor)).fake_mode
    with fake_mode:
        node.meta["val"] = target(*vals)
    return node.meta["val"]


def fuse_rms_norms(graph: fx.Graph) -> int:
    """Rewrites every RMSNorm -> W4A4 linear(s) the module docstring describes; -> how many."""
    roots = []
    for node in graph.nodes:
        if _call(node, *LINEARS) and node.args[-1] == "nvfp4":
            root = view_root(node.args[0])
            if root not in roots:
                roots.append(root)
    fused = 0
    for y in roots:
        # bf16 only: the linear then multiplies the values as its x, and its output takes x's dtype
        # (an fp16 linear would come out bf16)
        match = match_rms_norm(y) if _val(y) is not None and _val(y).dtype == torch.bfloat16 else None
        linears = _linear_uses(y) if match else None
        if not linears or not _fits(_val(match[0])):
            continue
        with graph.inserting_after(y):
            call = graph.call_function(FUSED, match)
        with graph.inserting_after(call):
            values = graph.call_function(operator.getitem, (call, 0))
        with graph.inserting_after(values):
            x_global_scale = graph.call_function(operator.getitem, (call, 1))
        out = _fake(call, FUSED, match)
        values.meta["val"], x_global_scale.meta["val"] = out
        y.replace_all_uses_with(values)
        for linear in linears:
            args = list(linear.args)
            if linear.target == LINEAR:
                with graph.inserting_before(linear):
                    # (g * x_global_scale): W4A4's order
                    global_scales = graph.call_function(aten.mul.Tensor, (args[3], x_global_scale))
                _fake(global_scales, aten.mul.Tensor, (args[3], x_global_scale))
                args[3] = global_scales
            else:  # linear_tiled_silu_mul takes x's global scale itself (its template multiplies)
                args[4] = x_global_scale
            args[-1] = "bf16"  # x: the values, multiplied as bf16
            linear.args = tuple(args)
        fused += 1
    return fused


def _defer_fits(h_val) -> bool:
    shape = h_val.shape
    if not all(isinstance(d, int) for d in shape) or shape.numel() == 0:
        return False
    rows = shape.numel() // shape[-1]
    return norm_deferred(rows, shape[-1]) and template_device(h_val.device)


def _insert(graph: fx.Graph, after: fx.Node, target, args) -> fx.Node:
    with graph.inserting_after(after):
        node = graph.call_function(target, args)
    _fake(node, target, args)
    return node


def defer_rms_norms(graph: fx.Graph) -> int:
    """W4A16 at decode: RMSNorm(h) -> linears becomes (module docstring, second part)
        x = h * weight (rounded as the norm rounds its output); linear(x, ..., norm_h=h, norm_eps=eps)
    for every norm whose output only W4A16 linears read as x; -> how many."""
    fused = 0
    for y in list(graph.nodes):
        # bf16 only: x = h * w is rounded to h's dtype before the norm's factor, which in fp16
        # overflows where eager's normalized y does not (|h * w| > 65504)
        y_val = _val(y)
        bf16 = isinstance(y_val, torch.Tensor) and y_val.dtype == torch.bfloat16
        match = match_rms_norm(y) if bf16 else None
        linears = _linear_uses(y, "bf16") if match else None
        if not linears or not _defer_fits(_val(match[0])):
            continue
        h, weight, eps, weight_after_cast = match
        if weight is None:
            x = h
        elif weight_after_cast:  # w * h in h's dtype
            x = _insert(graph, y, aten.mul.Tensor, (weight, h))
        else:  # (h * w) in fp32, rounded to h's dtype
            hf = _insert(graph, y, _CONVERT, (h, torch.float32))
            x = _insert(graph, hf, aten.mul.Tensor, (hf, weight))
            x = _insert(graph, x, _CONVERT, (x, _val(h).dtype))
        y.replace_all_uses_with(x)
        for linear in linears:
            linear.kwargs = {"norm_h": h, "norm_eps": eps}
        fused += 1
    return fused
