"""The eager NVFP4 linears on CUDA: y = (x @ W^T) * global scales (+ bias), W NVFP4.

    linear         W row-major (N, K/2) codes + (N, K/16) scales, plain or swizzled (nvfp4::linear)
    linear_tiled   W in the tiled layout of nvfp4_inductor.reference.tiled (nvfp4::linear_tiled, what
                   backend="nvfp4" compiles; this is its eager form and its Inductor extern choice)

Which kernel runs is plan.plan_gemm's choice: the split-K GEMM (gemm_splitk.py) at decode sizes,
on sm_90 with tiled W the Hopper GEMM (hopper_gemm.py) where it is planned, else W dequantized to
bf16 (e2m1 * block scale: exact) and one cuBLASLt GEMM that reads the global scale on the device
(cublaslt.py). plan.plan_gemm also returns the split-K launch, which
gemm_splitk carries out. W4A4 quantizes x first: to its codes for sm_100's
block-scaled MMA, else to its values (e2m1 * block scale, exact in bf16) multiplied as W4A16.
"""

import torch

from nvfp4_inductor.kernels import cublaslt, plan
from nvfp4_inductor.reference import rms_scale


def _rows(x):
    """x (..., K) -> (M, K) with unit K stride."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def linear(x, w_data, w_scale, w_global_scale, bias, w_swizzled: bool, activation: str):
    """nvfp4::linear on CUDA (arguments checked by the op): x (..., K) -> (..., N) in x.dtype."""
    lead, n = x.shape[:-1], w_data.shape[0]
    return _linear(_rows(x), w_data, w_scale, w_global_scale, bias, n, activation, w_swizzled, None,
                   x.dtype).reshape(*lead, n)


def _product(w_global_scale, x_global_scale):
    """The global scale the epilogue applies: W's, times x's for W4A4 (the eager kernels' order)."""
    return w_global_scale if x_global_scale is None else w_global_scale * x_global_scale


def _activation_operand(x2, activation):
    """x (M, K) -> (bf16 operand, its global scale or None). W4A16 uses x as bf16; W4A4 quantizes
    x (dynamic per-tensor scale) and takes its values without the global scale (e2m1 * block
    scale, exact in bf16: quantize_values, one kernel), which goes to the epilogue with the
    weight's."""
    from nvfp4_inductor.kernels.quantize import quantize

    if activation != "nvfp4":
        return x2.to(torch.bfloat16), None
    values, _, x_global_scale = quantize(x2, None, False, False, values=True)
    return values, x_global_scale


def _linear(x2, w_data, w_scale, w_global_scale, bias, n, activation, w_swizzled, tiled_n, out_dtype):
    """x (M, K) with unit K stride -> (M, N) out_dtype: plan.plan_gemm's kernel, planned once with
    the operand it multiplies (x as bf16, W4A4 its quantized values; on sm_100 with tiled W x's
    codes and scales, for the block-scaled MMA)."""
    from nvfp4_inductor.kernels.dequantize import dequantize
    from nvfp4_inductor.kernels.gemm_splitk import gemm_splitk
    from nvfp4_inductor.kernels.quantize import quantize

    m, k = x2.shape
    tiled = tiled_n is not None
    w_global_scale = w_global_scale.contiguous()  # per row: the kernels read it as a contiguous list
    x_format = plan.x_format(activation, x2.device, tiled)
    a = x_global_scale = None
    if x_format == "bf16":
        a, x_global_scale = _activation_operand(x2, activation)
    # (an NVFP4 x takes the block-scaled MMA, whatever its alignment: x's own facts stand in)
    chosen = plan.plan_gemm(m, n, k, tiled=tiled, activation=activation, device=x2.device, swizzled=w_swizzled,
                            **plan.operand_facts(x2 if a is None else a, w_data, w_scale, tiled))
    if chosen.kernel == "splitk":
        a_scale = None
        if x_format == "nvfp4":  # (sm_100: both global scales in the epilogue's g)
            a, a_scale, x_global_scale = quantize(x2, None, False, False)
        return gemm_splitk(a, w_data, w_scale, _product(w_global_scale, x_global_scale), bias, out_dtype,
                           w_swizzled, tiled_n=tiled_n, x_scale=a_scale, launch=chosen.launch)
    if a is None:
        a, x_global_scale = _activation_operand(x2, activation)
    if chosen.kernel == "hopper":  # (sm_90, tiled W)
        from nvfp4_inductor.kernels.hopper_gemm import hopper_linear

        return hopper_linear(a, w_data, w_scale, _product(w_global_scale, x_global_scale), bias, out_dtype,
                             config=chosen.launch.config, n=n, tiled=True, splits=chosen.launch.splits)
    # W as bf16 e2m1 * block scale (exact in bf16; the global scale would not be: measured 3e-3
    # relative error when folded in), then one cuBLASLt GEMM that reads the global scales from the
    # device as alpha, adds the bias and rounds once to out_dtype (kernels/cublaslt.py)
    w = dequantize(w_data, w_scale, None, w_swizzled, torch.bfloat16, tiled_nk=None if tiled_n is None else (n, k))
    return cublaslt.scaled_mm(a, w, _product(w_global_scale, x_global_scale), bias, out_dtype)


def linear_tiled(x, w_data, w_scale, w_global_scale, bias, n: int, activation: str, norm_h=None,
                 norm_eps: float = 0.0):
    """nvfp4::linear_tiled on CUDA: W in the tiled layout (nvfp4_inductor.reference.tiled). Small M runs the
    skinny kernel on it; larger M dequantizes it (the dequantize kernel reads the tiled layout)
    for a cuBLAS GEMM, whatever x's dtype (x is used as bf16, as W4A16 defines). With norm_h (a
    deferred RMSNorm, which backend="nvfp4" compiles into its template) the eager op takes fp32
    products from cuBLAS and applies the norm's row factor, the global scale and the bias."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = _rows(x)
    if norm_h is not None:
        a, x_global_scale = _activation_operand(x2, activation)
        y = mm_tiled_f32(a, w_data, w_scale, n) * rms_scale(norm_h.reshape(-1, k), norm_eps)
        y = y * _product(w_global_scale.contiguous(), x_global_scale)
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype).reshape(*lead, n)
    return _linear(x2, w_data, w_scale, w_global_scale, bias, n, activation, False, n, x.dtype).reshape(*lead, n)


def bind_linear_tiled(x, w_data, w_scale, w_global_scale, bias, n: int, activation: str):
    """linear_tiled(x, ...) bound to these weights for xs like x (its shape, strides, dtype, device
    and 16-byte alignment): a callable x -> y or None (see launch.BoundLaunch), or None where
    linear_tiled would not launch the split-K kernel directly on such an x (W4A4, x not bf16 or
    not contiguous, more rows than decode sizes, no compiled launch yet)."""
    from nvfp4_inductor.kernels.gemm_splitk import bind_splitk

    if activation != "bf16" or not x.is_contiguous() or x.dim() == 0 or x.dtype != torch.bfloat16:
        return None  # (bind_splitk checks the rest)
    x2 = x.reshape(-1, x.shape[-1])
    chosen = plan.plan_gemm(x2.shape[0], n, x2.shape[1], tiled=True, activation=activation, device=x.device,
                            **plan.operand_facts(x2, w_data, w_scale, True))
    if chosen.kernel != "splitk" or chosen.x_format != "bf16":
        return None
    return bind_splitk(x2, w_data, w_scale, w_global_scale, bias, x.dtype, n, (*x.shape[:-1], n), chosen.launch)


def mm_tiled_f32(x2, w_data, w_scale, n: int):
    """x (M, K) used as bf16 @ (e2m1 * block scale)^T, W tiled with N = n rows -> (M, N) fp32,
    global scale not applied (the Inductor template's extern choice: dequantize + cuBLAS)."""
    from nvfp4_inductor.kernels.dequantize import dequantize

    w = dequantize(w_data, w_scale, None, False, torch.bfloat16, tiled_nk=(n, x2.shape[1]))
    return torch.mm(x2.to(torch.bfloat16), w.T, out_dtype=torch.float32)


def scaled_mm_tiled(x2, w_data, w_scale, g, bias, n: int, out_dtype):
    """x (M, K) used as bf16 (W4A4: its quantized values), W tiled with N = n rows, g fp32 () or
    (N,) on the device (W4A4: both global scales) -> (M, N) out_dtype = g * (x @ (e2m1 * block
    scale)^T) + bias: W dequantized, one cuBLASLt GEMM (the template's extern choice where it
    is the only one: no fp32 product for an epilogue kernel to read)."""
    from nvfp4_inductor.kernels.dequantize import dequantize

    w = dequantize(w_data, w_scale, None, False, torch.bfloat16, tiled_nk=(n, x2.shape[1]))
    return cublaslt.scaled_mm(x2.to(torch.bfloat16), w, g, bias, out_dtype)

