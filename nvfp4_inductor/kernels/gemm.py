"""NVFP4 GEMM: y = (x @ W^T) * global scales (+ bias), W NVFP4 (N, K/2) + e4m3 scales (N, K/16).

One mainloop, two ways to multiply (MMA, a constexpr):
    MMA_DOT_SCALED  sm_100: A and B both NVFP4; tl.dot_scaled(a, sa, "e2m1", b, sb, "e2m1") ->
                    tcgen05.mma ... kind::mxf4nvf4.block_scale (verified by compiling for sm_100).
    MMA_DEQUANT     sm_90: the FP4 tiles are decoded in registers to fp16/bf16 (e2m1 * e4m3 block
                    scale: at most 6 significant bits, exact in either) and multiplied by tl.dot
                    (wgmma). A is bf16 (W4A16) or NVFP4 decoded the same way (W4A4).
The global scales (g_a * g_w) and the bias are applied once, in the epilogue, in fp32.

Index formulas. W4A4 and the dequant path split K into even and odd elements instead of
interleaving the two nibbles of a byte: for a K-tile of BLOCK_K elements starting at k0,
    acc += A[:, k0 + 2j] . B_low[j, :] + A[:, k0 + 2j + 1] . B_high[j, :],   j < BLOCK_K / 2
where B_low / B_high are the low / high nibbles of byte column k0 / 2 + j. Element k = k0 + 2j (+1)
has block scale column k // 16 = (k0 / 2 + j) // 8.
"""

import torch
import triton
import triton.language as tl

from ..format import BLOCK_SIZE
from .. import capability
from . import gemm_configs
from ._common import BLOCK, check_swizzled_offsets, e2m1_decode, e4m3_bits_to_f32, scale_offsets

MMA_DEQUANT: tl.constexpr = tl.constexpr(gemm_configs.MMA_DEQUANT)
MMA_DOT_SCALED: tl.constexpr = tl.constexpr(gemm_configs.MMA_DOT_SCALED)


@triton.jit
def _decode_nibbles(packed, scale_bits, OPERAND: tl.constexpr):
    """uint8 bytes and the int32 e4m3 bits of each byte's block -> (low, high) element values as
    OPERAND (fp16 / bf16): e2m1(code) * block scale, exact in either."""
    packed = packed.to(tl.int32)
    scale = e4m3_bits_to_f32(scale_bits.to(tl.int32))
    low = (e2m1_decode(packed & 0xF) * scale).to(OPERAND)
    high = (e2m1_decode(packed >> 4) * scale).to(OPERAND)
    return low, high


@triton.jit
def nvfp4_mainloop(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, M, N, K, stride_am, a_scale_cols_pad, b_scale_cols_pad,
    pid_m, pid_n, k_begin, k_end,
    MMA: tl.constexpr, A_FP4: tl.constexpr, SWIZZLED: tl.constexpr, OPERAND: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """fp32 (BLOCK_M, BLOCK_N) = sum over K in [k_begin, k_end) of A . B^T, block scales applied,
    global scales not. A: (M, K) rows of stride_am elements, or NVFP4 (M, K/2) + scales when A_FP4.
    B: NVFP4 (N, K/2) + scales. K-tiles past K read zeros (never out of bounds)."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    half = tl.arange(0, BLOCK_K // 2)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        byte_cols = k0 // 2 + half  # (BLOCK_K / 2,)
        in_k = byte_cols < K // 2
        # B as (BLOCK_K / 2, BLOCK_N): byte column j of weight row n.
        b_mask = in_k[:, None] & col_ok[None, :]
        b = tl.load(b_ptr + cols.to(tl.int64)[None, :] * (K // 2) + byte_cols[:, None], mask=b_mask,
                    other=0)
        a_mask = row_ok[:, None] & in_k[None, :]
        if MMA == MMA_DOT_SCALED:
            a = tl.load(a_ptr + rows.to(tl.int64)[:, None] * (K // 2) + byte_cols[None, :],
                        mask=a_mask, other=0)
            scale_cols = k0 // BLOCK + tl.arange(0, BLOCK_K // BLOCK)
            a_s = tl.load(a_scale_ptr + scale_offsets(rows[:, None], scale_cols[None, :], K,
                                                      a_scale_cols_pad, SWIZZLED),
                          mask=row_ok[:, None] & (scale_cols < K // BLOCK)[None, :], other=0)
            b_s = tl.load(b_scale_ptr + scale_offsets(cols[:, None], scale_cols[None, :], K,
                                                      b_scale_cols_pad, SWIZZLED),
                          mask=col_ok[:, None] & (scale_cols < K // BLOCK)[None, :], other=0)
            acc = tl.dot_scaled(a, a_s.to(tl.float8e4nv, bitcast=True), "e2m1",
                                b, b_s.to(tl.float8e4nv, bitcast=True), "e2m1", acc)
        else:
            b_bits = tl.load(b_scale_ptr + scale_offsets(cols[None, :], byte_cols[:, None] // (BLOCK // 2), K,
                                                         b_scale_cols_pad, SWIZZLED),
                             mask=b_mask, other=0)
            b_low, b_high = _decode_nibbles(b, b_bits, OPERAND)
            if A_FP4:
                a = tl.load(a_ptr + rows.to(tl.int64)[:, None] * (K // 2) + byte_cols[None, :],
                            mask=a_mask, other=0)
                a_bits = tl.load(a_scale_ptr + scale_offsets(rows[:, None], byte_cols[None, :] // (BLOCK // 2), K,
                                                             a_scale_cols_pad, SWIZZLED),
                                 mask=a_mask, other=0)
                a_even, a_odd = _decode_nibbles(a, a_bits, OPERAND)
            else:
                a_even_cols = 2 * byte_cols
                a_row_ptr = a_ptr + rows.to(tl.int64)[:, None] * stride_am
                a_even = tl.load(a_row_ptr + a_even_cols[None, :], mask=a_mask, other=0.0).to(OPERAND)
                a_odd = tl.load(a_row_ptr + a_even_cols[None, :] + 1, mask=a_mask, other=0.0).to(OPERAND)
            acc = tl.dot(a_even, b_low, acc)
            acc = tl.dot(a_odd, b_high, acc)
    return acc


@triton.jit
def _nvfp4_gemm_kernel(
    # pointers
    a_ptr, a_scale_ptr, a_g_ptr, b_ptr, b_scale_ptr, b_g_ptr, bias_ptr, c_ptr,
    # sizes
    M, N, K, a_scale_cols_pad, b_scale_cols_pad,
    # strides
    stride_am, stride_cm,
    # meta-parameters
    MMA: tl.constexpr, A_FP4: tl.constexpr, SWIZZLED: tl.constexpr, B_G_PER_ROW: tl.constexpr,
    HAS_BIAS: tl.constexpr, OPERAND: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    acc = nvfp4_mainloop(a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, M, N, K, stride_am,
                         a_scale_cols_pad, b_scale_cols_pad, pid_m, pid_n, 0, K,
                         MMA, A_FP4, SWIZZLED, OPERAND, BLOCK_M, BLOCK_N, BLOCK_K)
    # Epilogue: global scales, bias, output dtype.
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    if B_G_PER_ROW:
        acc = acc * tl.load(b_g_ptr + cols, mask=col_ok, other=0.0)[None, :]
    else:
        acc = acc * tl.load(b_g_ptr)
    if A_FP4:
        acc = acc * tl.load(a_g_ptr)
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    mask = (rows < M)[:, None] & col_ok[None, :]
    tl.store(c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :],
             acc.to(c_ptr.dtype.element_ty), mask=mask)


def gemm(a, a_scale, a_g, b, b_scale, b_g, bias, out_dtype, swizzled, a_fp4,
         mma=gemm_configs.MMA_DEQUANT, operand=torch.bfloat16, config=None):
    """2-D launcher. a: (M, K) float (a_fp4 False) or NVFP4 parts (M, K/2) + scale bits + g;
    b: NVFP4 (N, K/2) + scale bits + g; bias (N,) or None -> (M, N) out_dtype."""
    m = a.shape[0]
    n, k = b.shape[0], b.shape[1] * 2
    out = torch.empty((m, n), dtype=out_dtype, device=b.device)
    if m == 0 or n == 0:
        return out
    if swizzled:
        check_swizzled_offsets("w.scale", *b_scale.shape)
        if a_fp4:
            check_swizzled_offsets("x's scale", *a_scale.shape)
    if bias is not None:
        bias = bias.contiguous()  # read as (N,) with unit stride
    block_m, block_n, block_k, num_warps, num_stages = config or gemm_configs.gemm_config(m, n, k, mma)
    b_cols_pad = b_scale.shape[1] if swizzled else k // BLOCK_SIZE
    a_cols_pad = a_scale.shape[1] if (a_fp4 and swizzled) else k // BLOCK_SIZE
    dummy = b_g
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _nvfp4_gemm_kernel[grid](
        a, a_scale if a_fp4 else dummy, a_g if a_fp4 else dummy, b, b_scale, b_g,
        bias if bias is not None else dummy, out,
        m, n, k, a_cols_pad, b_cols_pad,
        a.stride(0), out.stride(0),
        MMA=mma, A_FP4=a_fp4, SWIZZLED=swizzled, B_G_PER_ROW=b_g.dim() > 0,
        HAS_BIAS=bias is not None, OPERAND=tl.float16 if operand == torch.float16 else tl.bfloat16,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def linear(x, w_data, w_scale, w_g, bias, w_swizzled: bool, activation: str):
    """nvfp4::linear on CUDA (arguments checked by the op): x (..., K) -> (..., N) in x.dtype."""
    from .dequantize import dequantize
    from .quantize import quantize

    lead, k = x.shape[:-1], x.shape[-1]
    n = w_data.shape[0]
    w_g = w_g.contiguous()  # per row: the kernels read it as a contiguous list
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    path = gemm_configs.linear_path(x2.shape[0], n, k, x.dtype, activation)
    if path == "splitk":
        return _linear_splitk(x2, w_data, w_scale, w_g, bias, w_swizzled, activation, x.dtype,
                              None).reshape(*lead, n)
    if path == "dequant_cublas":
        w = dequantize(w_data, w_scale, None, w_swizzled, torch.bfloat16)
        return _linear_dequant_cublas(x2, w, w_g, bias, activation, x.dtype).reshape(*lead, n)
    if activation == "nvfp4":
        a, a_scale, a_g = quantize(x2, None, False, w_swizzled)
        mma = (gemm_configs.MMA_DOT_SCALED if capability.block_scaled_mma(x.device) and w_swizzled
               else gemm_configs.MMA_DEQUANT)
        y = gemm(a, a_scale, a_g, w_data, w_scale, w_g, bias, x.dtype, w_swizzled, True, mma)
    else:
        a = x2 if x2.dtype == torch.bfloat16 else x2.to(torch.bfloat16)
        y = gemm(a, None, None, w_data, w_scale, w_g, bias, x.dtype, w_swizzled, False)
    return y.reshape(*lead, n)


def _activation_operand(x2, activation):
    """x (M, K) -> (bf16 operand, its global scale or None). W4A16 uses x as bf16; W4A4 quantizes
    x (dynamic per-tensor scale) and takes its values without the global scale (e2m1 * block
    scale, exact in bf16: quantize_values, one kernel), which goes to the epilogue with the
    weight's."""
    from .quantize import quantize

    if activation != "nvfp4":
        return x2.to(torch.bfloat16), None
    values, _, a_g = quantize(x2, None, False, False, values=True)
    return values, a_g


def _linear_splitk(x2, w_data, w_scale, w_g, bias, w_swizzled, activation, out_dtype, tiled_n):
    """Small M: the skinny kernel, both global scales in its epilogue, x a bf16 operand (W4A4:
    its quantized values). On sm_100 W4A4 on tiled weights keeps x as NVFP4 codes for the
    block-scaled MMA."""
    from .gemm_splitk import gemm_splitk
    from .quantize import quantize

    if activation == "nvfp4" and tiled_n is not None and capability.block_scaled_mma(x2.device):
        a, a_scale, a_g = quantize(x2, None, False, False)
        return gemm_splitk(a, w_data, w_scale, w_g * a_g, bias, out_dtype, w_swizzled,
                           tiled_n=tiled_n, x_scale=a_scale)
    a, a_g = _activation_operand(x2, activation)
    return gemm_splitk(a, w_data, w_scale, w_g if a_g is None else w_g * a_g, bias, out_dtype,
                       w_swizzled, tiled_n=tiled_n)


def _linear_dequant_cublas(x2, w, w_g, bias, activation, out_dtype):
    """x (M, K), W as bf16 e2m1 * block scale (exact in bf16; the global scale would not be:
    measured 3e-3 relative error when folded in): one cuBLASLt GEMM that reads the global scales
    from the device as alpha, adds the bias and rounds once to out_dtype (kernels/cublaslt.py)."""
    from .cublaslt import scaled_mm

    a, a_g = _activation_operand(x2, activation)
    return scaled_mm(a, w, w_g if a_g is None else w_g * a_g, bias, out_dtype)


def linear_tiled(x, w_data, w_scale, w_g, bias, n: int, activation: str, norm_h=None,
                 norm_eps: float = 0.0):
    """nvfp4::linear_tiled on CUDA: W in the tiled layout (nvfp4_inductor.tiled). Small M runs the
    skinny kernel on it; larger M dequantizes it (the dequantize kernel reads the tiled layout)
    for a cuBLAS GEMM, whatever x's dtype (x is used as bf16, as W4A16 defines). With norm_h (a
    deferred RMSNorm, which backend="nvfp4" compiles into its template) the eager op takes fp32
    products from cuBLAS and applies the norm's row factor, the global scale and the bias."""
    from .dequantize import dequantize

    lead, k = x.shape[:-1], x.shape[-1]
    w_g = w_g.contiguous()  # per row: the kernels read it as a contiguous list
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if norm_h is not None:
        from ..reference import rms_scale

        a, a_g = _activation_operand(x2, activation)
        y = mm_tiled_f32(a, w_data, w_scale, n) * rms_scale(norm_h.reshape(-1, k), norm_eps)
        y = y * (w_g if a_g is None else w_g * a_g)
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype).reshape(*lead, n)
    if gemm_configs.linear_path(x2.shape[0], n, k, x.dtype, activation, tiled=True) == "splitk":
        return _linear_splitk(x2, w_data, w_scale, w_g, bias, False, activation, x.dtype,
                              n).reshape(*lead, n)
    w = dequantize(w_data, w_scale, None, False, torch.bfloat16, tiled_nk=(n, k))
    return _linear_dequant_cublas(x2, w, w_g, bias, activation, x.dtype).reshape(*lead, n)


def mm_tiled_f32(x2, w_data, w_scale, n: int):
    """x (M, K) used as bf16 @ (e2m1 * block scale)^T, W tiled with N = n rows -> (M, N) fp32,
    global scale not applied (the Inductor template's extern choice: dequantize + cuBLAS)."""
    from .dequantize import dequantize

    w = dequantize(w_data, w_scale, None, False, torch.bfloat16, tiled_nk=(n, x2.shape[1]))
    return torch.mm(x2.to(torch.bfloat16), w.T, out_dtype=torch.float32)


def scaled_mm_tiled(x2, w_data, w_scale, g, bias, n: int, out_dtype):
    """x (M, K) used as bf16 (W4A4: its quantized values), W tiled with N = n rows, g fp32 () or
    (N,) on the device (W4A4: both global scales) -> (M, N) out_dtype = g * (x @ (e2m1 * block
    scale)^T) + bias: W dequantized, one cuBLASLt GEMM (the template's extern choice where it
    is the only one: no fp32 product for an epilogue kernel to read)."""
    from .cublaslt import scaled_mm
    from .dequantize import dequantize

    w = dequantize(w_data, w_scale, None, False, torch.bfloat16, tiled_nk=(n, x2.shape[1]))
    return scaled_mm(x2.to(torch.bfloat16), w, g, bias, out_dtype)

