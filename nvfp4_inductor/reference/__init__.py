"""The NVFP4 contract in executable form: pure torch, fp32 inside, any device.

Every kernel in this package (eager Triton, Inductor-generated) must reproduce these codes and
scales bit for bit. The exact fp32 operation order, chosen once:

    amax   = max |x| over the finite elements (per tensor, or per row)
    g      = amax / 2688                      (fp32 division); g = 1 where that is 0
    s_b    = e4m3_rne(min(block_amax / (g * 6), 448))      (g * 6 rounded first)
    k      = 2^64 where g < 2^-100, else 1    (per tensor or row; x * k and g * k are exact)
    r_b    = 1 / (float(s_b) * (g * k))       (per block: the product rounded, then fp32 division)
    y      = (x * k) * r_b                    (per element: fp32 multiplies)
    code   = signbit(x) << 3 | e2m1_rne_index(|y|)         (saturating at 6)

Multiplying by a per-block reciprocal rather than dividing every element is a choice for the
kernels: a memory-bound quantizer has only a few instructions per byte moved (the issue rate
over the HBM bandwidth), and a correctly rounded fp32 division costs about ten. It is also what
the widely used CUDA NVFP4 quantizers do. Ties stay ties wherever s * g is a power of two (the
reciprocal is then exact). The factor k changes nothing where g >= 2^-100 (k = 1); below, it
keeps s * g k and r_b within fp32's normal range, so y is what the same operations give with no
lower exponent limit (without it, a block amax below ~1.8e-38 overflows r_b: nonzero codes
saturate, zeros become 0 * inf).

Non-finite policy ("propagate, locally"): a block holding a NaN or +-Inf gets the NaN block scale
(0x7F) and zero codes, so it dequantizes to NaN and poisons exactly the GEMM outputs that use it;
other blocks are unaffected because the dynamic amax skips non-finite elements. A given global scale
that is not finite and > 0 makes every block NaN in the same way. Blocks whose scale rounds to 0
(underflow) get all-zero codes (+0). No check here reads a value back to the host.
"""

import contextlib
import math

import torch
from torch import Tensor

from nvfp4_inductor.format import (
    BLOCK_SIZE,
    E2M1_MAX,
    E2M1_MIDPOINTS,
    E2M1_SIGN_BIT,
    E2M1_VALUES,
    E4M3_MAX,
    GLOBAL_SCALE_DIVISOR,
    SWIZZLE_ROW_GROUP,
    SWIZZLE_TILE_COLS,
    SWIZZLE_TILE_ROWS,
    TINY_GLOBAL_SCALE,
    TINY_SCALE_FACTOR,
)

__all__ = [
    "global_scale_from_amax",
    "compute_global_scale",
    "block_scales",
    "reciprocal_operands",
    "encode_blocks",
    "e2m1_encode",
    "e2m1_decode",
    "pack_nibbles",
    "unpack_nibbles",
    "quantize",
    "quantize_values",
    "rms_norm",
    "silu_mul",
    "dequantize",
    "swizzled_shape",
    "swizzle_scales",
    "unswizzle_scales",
    "linear",
]


def global_scale_from_amax(amax: Tensor) -> Tensor:
    """fp32 amax (any shape) -> fp32 decode global scale g = amax / 2688, 1 where that is 0."""
    amax = amax.float()
    # Divide by a tensor, not a Python number: on CUDA, `tensor / scalar` is computed as
    # tensor * (1 / scalar), which can be one ulp off the correctly rounded quotient the kernels
    # compute (div_rn), and the device-side scale search calls this on CUDA tensors.
    g = amax / torch.full_like(amax, GLOBAL_SCALE_DIVISOR)
    return torch.where(g == 0, torch.ones_like(g), g)


def finite_amax(x: Tensor, per_row: bool = False) -> Tensor:
    """(..., K) float -> fp32 max |x| over its finite elements (0 where there are none), shape ()
    or (...,) with per_row."""
    xabs = x.float().abs()
    xabs = torch.where(torch.isfinite(xabs), xabs, torch.zeros_like(xabs))
    if per_row:
        return xabs.amax(dim=-1)
    return xabs.amax() if xabs.numel() else xabs.new_zeros(())


def compute_global_scale(x: Tensor, per_row: bool = False) -> Tensor:
    """(..., K) float -> fp32 global scale, shape () or (...,) with per_row; skips non-finite x."""
    return global_scale_from_amax(finite_amax(x, per_row))


def _row_broadcast(global_scale: Tensor, lead_dims: int) -> Tensor:
    """Global scale () or (...,) -> a view that broadcasts against (..., K/16) block tensors."""
    if global_scale.dim() == 0:
        return global_scale
    assert global_scale.dim() == lead_dims
    return global_scale.unsqueeze(-1)


def block_scales(x_blocks: Tensor, global_scale: Tensor) -> Tensor:
    """(..., K/16, 16) fp32 blocks + g broadcastable to (..., K/16) -> e4m3 block scales (..., K/16)."""
    g = global_scale.float()
    g_ok = torch.isfinite(g) & (g > 0)
    block_amax = x_blocks.abs().amax(dim=-1)
    block_ok = torch.isfinite(x_blocks).all(dim=-1) & g_ok
    # Overflow saturates at 448 (never NaN, never an e4m3 "inf"); only bad input gives NaN.
    scale_f32 = torch.clamp(block_amax / (g * E2M1_MAX), max=E4M3_MAX)
    scale_f32 = torch.where(block_ok, scale_f32, torch.full_like(scale_f32, math.nan))
    return scale_f32.to(torch.float8_e4m3fn)


def reciprocal_operands(global_scale: Tensor) -> tuple[Tensor, Tensor]:
    """fp32 g (any shape) -> (k, g * k): k = 2^64 where g < 2^-100, else 1. The element step is
    y = (x * k) * (1 / (s * (g * k))); both products with k are exact."""
    g = global_scale.float()
    k = torch.where(g < TINY_GLOBAL_SCALE, torch.full_like(g, TINY_SCALE_FACTOR), torch.ones_like(g))
    return k, g * k


def encode_blocks(x_blocks: Tensor, scale: Tensor, global_scale: Tensor) -> Tensor:
    """(..., K/16, 16) fp32 blocks, their e4m3 block scales (..., K/16) and g broadcastable to the
    scales -> uint8 codes (..., K/16, 16): the element step of the module docstring (zero and NaN
    scales: all-zero codes)."""
    scale_f32 = scale.float()
    usable = (scale_f32 > 0) & torch.isfinite(scale_f32)
    factor, g_k = reciprocal_operands(global_scale)
    recip = 1.0 / torch.where(usable, scale_f32 * g_k, torch.ones_like(scale_f32))
    y = (x_blocks * factor.unsqueeze(-1)) * recip.unsqueeze(-1)
    return torch.where(usable.unsqueeze(-1), e2m1_encode(y), 0)


def e2m1_encode(y: Tensor) -> Tensor:
    """fp32 values already divided by their scale -> uint8 E2M1 codes (sign << 3 | index).

    Round to nearest, ties to the even mantissa bit, saturating at +-6: the magnitude index is
    the number of midpoints below |y|, a tie counting as "below" only for odd midpoints.
    """
    yabs = y.abs()
    index = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for i, midpoint in enumerate(E2M1_MIDPOINTS):
        above = (yabs >= midpoint) if i % 2 else (yabs > midpoint)
        index += above.to(torch.uint8)
    sign = torch.signbit(y).to(torch.uint8) * E2M1_SIGN_BIT
    return sign | index


def _e2m1_table(device: torch.device) -> Tensor:
    """The 16 E2M1 code values as fp32, indexed by code (codes 8..15 negative, 8 is -0.0)."""
    magnitudes = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat([magnitudes, -magnitudes])


def e2m1_decode(codes: Tensor) -> Tensor:
    """uint8 E2M1 codes (low nibble) -> fp32 values."""
    return _e2m1_table(codes.device)[codes.long()]


def pack_nibbles(codes: Tensor) -> Tensor:
    """(..., K) uint8 codes -> (..., K/2) uint8; element 2i in the low nibble, 2i+1 in the high."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(data: Tensor) -> Tensor:
    """(..., K/2) uint8 -> (..., K) uint8 codes; inverse of pack_nibbles."""
    low = data & 0x0F
    high = data >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


def quantize(
    x: Tensor, global_scale: Tensor | None = None, per_row: bool = False
) -> tuple[Tensor, Tensor, Tensor]:
    """(..., K) float -> (data uint8 (..., K/2), scale e4m3 (..., K/16), g fp32 () or (...,)).

    global_scale None computes it from x (per tensor, or per row); a given one is used as is.
    """
    lead, k = x.shape[:-1], x.shape[-1]
    if global_scale is None:
        global_scale = compute_global_scale(x, per_row)
    else:
        global_scale = global_scale.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    x_blocks = x.float().reshape(*lead, k // BLOCK_SIZE, BLOCK_SIZE)
    g_blocks = _row_broadcast(global_scale, len(lead))
    scale = block_scales(x_blocks, g_blocks)

    data = pack_nibbles(encode_blocks(x_blocks, scale, g_blocks).reshape(*lead, k))
    return data, scale, global_scale


def quantize_values(x: Tensor, global_scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(..., K) float -> (values bf16 (..., K), g fp32 ()): x quantized with a per-tensor global
    scale (computed from x when None, else the given one, e.g. calibrated) and decoded without
    it, e2m1 * block scale (exact in bf16)."""
    data, scale, g = quantize(x, global_scale, False)
    return dequantize(data, scale, torch.ones_like(g), torch.bfloat16), g


def rms_norm(h: Tensor, weight: Tensor | None, eps: float, weight_after_cast: bool = False) -> Tensor:
    """RMSNorm as models write it: h in fp32 times rsqrt(mean(h^2) + eps), rounded to h's dtype.
    weight (K,) multiplies in fp32 before that rounding ((h * r * w).to(dtype)), or with
    weight_after_cast after it (w * (h * r).to(dtype), rounded again: the Hugging Face Llama form)."""
    hf = h.float()
    n = hf * rms_scale(hf, eps)
    if weight is None:
        return n.to(h.dtype)
    if weight_after_cast:
        return (weight.float() * n.to(h.dtype).float()).to(h.dtype)
    return (n * weight.float()).to(h.dtype)


def rms_scale(h: Tensor, eps: float) -> Tensor:
    """An RMSNorm's row factor: rsqrt(mean(h^2, last dim) + eps) in fp32, shape (..., 1)."""
    hf = h.float()
    return torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """A gated MLP's F.silu(gate) * up in gate's dtype: silu in fp32 rounded to that dtype, then the
    product (torch computes it in fp32) rounded again."""
    return torch.nn.functional.silu(gate.float()).to(gate.dtype) * up


def dequantize(
    data: Tensor, scale: Tensor, global_scale: Tensor, dtype: torch.dtype = torch.float32
) -> Tensor:
    """(..., K/2) uint8 + plain e4m3 scale (..., K/16) + g () or (...,) -> (..., K) of dtype.

    e2m1 * block scale is exact (at most 6 significant bits); the product with g rounds once.
    """
    lead = data.shape[:-1]
    k = data.shape[-1] * 2
    values = e2m1_decode(unpack_nibbles(data)).reshape(*lead, k // BLOCK_SIZE, BLOCK_SIZE)
    g_blocks = _row_broadcast(global_scale.float(), len(lead))
    out = (values * scale.float().unsqueeze(-1)) * g_blocks.unsqueeze(-1)
    return out.reshape(*lead, k).to(dtype)


def swizzled_shape(rows: int, cols: int) -> tuple[int, int]:
    """Plain scale matrix (rows, cols) -> padded shape (ceil(rows/128)*128, ceil(cols/4)*4)."""
    tr, tc = SWIZZLE_TILE_ROWS, SWIZZLE_TILE_COLS
    return -(-rows // tr) * tr, -(-cols // tc) * tc


def swizzle_scales(scale: Tensor) -> Tensor:
    """(rows, cols) scales -> (rows_pad, cols_pad) holding the bytes in 128x4-tile order.

    Padded matrix entry (r, c) lands at flat offset
    ((r // 128) * (cols_pad // 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4.
    """
    rows, cols = scale.shape
    rows_pad, cols_pad = swizzled_shape(rows, cols)
    padded = scale.new_zeros((rows_pad, cols_pad))
    padded[:rows, :cols] = scale
    groups = SWIZZLE_TILE_ROWS // SWIZZLE_ROW_GROUP
    tiles = padded.view(
        rows_pad // SWIZZLE_TILE_ROWS, groups, SWIZZLE_ROW_GROUP, cols_pad // SWIZZLE_TILE_COLS,
        SWIZZLE_TILE_COLS,
    )  # (row tile, r // 32 in tile, r % 32, col tile, c % 4)
    return tiles.permute(0, 3, 2, 1, 4).contiguous().view(rows_pad, cols_pad)


def unswizzle_scales(swizzled: Tensor, rows: int, cols: int) -> Tensor:
    """(rows_pad, cols_pad) swizzled scales -> the plain (rows, cols) matrix (padding dropped)."""
    rows_pad, cols_pad = swizzled_shape(rows, cols)
    groups = SWIZZLE_TILE_ROWS // SWIZZLE_ROW_GROUP
    tiles = swizzled.reshape(
        rows_pad // SWIZZLE_TILE_ROWS, cols_pad // SWIZZLE_TILE_COLS, SWIZZLE_ROW_GROUP, groups,
        SWIZZLE_TILE_COLS,
    )  # (row tile, col tile, r % 32, r // 32 in tile, c % 4)
    plain = tiles.permute(0, 3, 2, 1, 4).reshape(rows_pad, cols_pad)
    return plain[:rows, :cols].clone(memory_format=torch.contiguous_format)  # never a view


def no_autocast(t: Tensor):
    """A context in which t's device runs no torch.autocast region: the products this package
    computes in fp32 stay fp32 (inside a user's autocast, a matmul would run in bf16 or fp16)."""
    if t.device.type in ("cpu", "cuda"):
        return torch.autocast(t.device.type, enabled=False)
    return contextlib.nullcontext()


def linear(
    x: Tensor,
    w_data: Tensor,
    w_scale: Tensor,
    w_global_scale: Tensor,
    bias: Tensor | None = None,
    activation: str = "bf16",
    row_scale: Tensor | None = None,
) -> Tensor:
    """y = x @ W^T (+ bias): x (..., K), W NVFP4 (N, K/2) + plain scales (N, K/16) -> (..., N).

    activation "bf16": x enters the product rounded to bf16 (W4A16); "nvfp4": x is quantized with
    a dynamic per-tensor global scale and dequantized (W4A4). Products and sums in fp32; the result
    is cast to x.dtype once. row_scale (fp32 (..., 1)) multiplies each row's products before the
    bias (a deferred RMSNorm's factor, rms_scale).
    """
    w = dequantize(w_data, w_scale, w_global_scale, torch.float32)
    if activation == "nvfp4":
        x_f32 = dequantize(*quantize(x), torch.float32)
    else:
        x_f32 = x.to(torch.bfloat16).float()
    with no_autocast(x):
        y = x_f32 @ w.T
    if row_scale is not None:
        y = y * row_scale
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
