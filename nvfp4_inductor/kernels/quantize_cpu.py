"""NVFP4 quantize on the CPU, bit for bit `reference.quantize` with a per-tensor global scale,
faster: the reference spells the contract out (seven midpoint comparisons per element, every
step a full-size fp32 temporary), which runs a large weight at about a third of the speed a
model-folder export needs on a small CPU.

The same fp32 operations in the same order (reference.py's docstring), arranged for the CPU:
    - rows in chunks of about CHUNK_ELEMENTS elements, so that each step's temporaries stay in
      the cache instead of streaming every intermediate through memory;
    - a block holds a NaN or an Inf exactly when its amax over |x| does (amax propagates NaN),
      so the block-finite test reads the (K/16) amaxes, not the K elements;
    - k = 2^64 only where g < 2^-100: with k = 1 the products x * k and g * k are x and g;
    - the E2M1 rounding as one binary search over the midpoints (torch.bucketize counts the
      boundaries strictly below |y|): the midpoints whose tie rounds up (0.75, 1.75, 3.5, the
      odd ones) enter as the next fp32 value below them, so `|y| > boundary` is `|y| >= midpoint`
      there, and the index is the reference's count of midpoints below |y|.
"""

import math

import torch
from torch import Tensor

from .. import reference
from ..format import BLOCK_SIZE, E2M1_MAX, E2M1_MIDPOINTS, E2M1_SIGN_BIT, E4M3_MAX, TINY_GLOBAL_SCALE

__all__ = ["quantize"]

# Elements per chunk of rows: 64 Ki fp32 values (256 KiB) per temporary keeps the handful alive at
# once within a core's L2.
CHUNK_ELEMENTS = 1 << 16


def _boundaries() -> Tensor:
    """The seven E2M1 midpoints, the odd ones moved one fp32 ulp down (ties to the even index)."""
    mids = torch.tensor(E2M1_MIDPOINTS, dtype=torch.float32)
    below = torch.nextafter(mids, torch.zeros_like(mids))
    odd = torch.arange(len(E2M1_MIDPOINTS)) % 2 == 1
    return torch.where(odd, below, mids)


_BOUNDARIES = _boundaries()


def _encode_rows(x: Tensor, g: Tensor, g_k: Tensor, factor: float, data: Tensor, scale: Tensor) -> None:
    """One chunk: x (R, K) float, fp32 g () -> data (R, K/2) uint8 and scale (R, K/16) e4m3, in place."""
    rows, k = x.shape
    xf = x.float()
    if xf.data_ptr() == x.data_ptr():  # (an fp32 x: work on a copy, never on the caller's tensor)
        xf = xf.clone()
    blocks = xf.view(rows, k // BLOCK_SIZE, BLOCK_SIZE)
    block_amax = blocks.abs().amax(dim=-1)
    block_ok = torch.isfinite(block_amax)
    scale_f32 = torch.clamp(block_amax / (g * E2M1_MAX), max=E4M3_MAX)
    scale_f32 = torch.where(block_ok, scale_f32, torch.full_like(scale_f32, math.nan))
    block_scale = scale_f32.to(torch.float8_e4m3fn)
    scale.copy_(block_scale)
    s = block_scale.float()
    usable = (s > 0) & torch.isfinite(s)
    recip = 1.0 / torch.where(usable, s * g_k, torch.ones_like(s))
    if factor != 1.0:
        blocks.mul_(factor)
    blocks.mul_(recip.unsqueeze(-1))
    sign = torch.signbit(xf).view(torch.uint8)
    index = torch.bucketize(xf.abs_(), _BOUNDARIES, out_int32=True).to(torch.uint8)
    codes = index.bitwise_or_(sign.mul_(E2M1_SIGN_BIT)).view(rows, k // BLOCK_SIZE, BLOCK_SIZE)
    codes.mul_(usable.unsqueeze(-1).view(torch.uint8))
    codes = codes.view(rows, k)
    torch.bitwise_or(codes[:, 0::2], codes[:, 1::2] << 4, out=data)


def quantize(x: Tensor, global_scale: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(N, K) float CPU + fp32 g () -> (data uint8 (N, K/2), scale e4m3 (N, K/16), g fp32 ()),
    equal to reference.quantize(x, global_scale)."""
    if x.dim() != 2 or x.shape[-1] % BLOCK_SIZE or x.device.type != "cpu" or global_scale.numel() != 1:
        raise ValueError(f"quantize_cpu.quantize takes a 2-D CPU tensor with K % {BLOCK_SIZE} == 0 and a "
                         f"per-tensor global scale; got {tuple(x.shape)} on {x.device}, global scale "
                         f"shape {tuple(global_scale.shape)}")
    g = global_scale.to(torch.float32, copy=True).reshape(())
    n, k = x.shape
    data = torch.empty((n, k // 2), dtype=torch.uint8)
    scale = torch.empty((n, k // BLOCK_SIZE), dtype=torch.float8_e4m3fn)
    if not bool(torch.isfinite(g) & (g > 0)):  # (NaN blocks everywhere: the reference's rule)
        return reference.quantize(x, g)
    factor, g_k = reference.reciprocal_operands(g)
    factor = float(factor)
    step = max(1, CHUNK_ELEMENTS // max(k, 1))
    for start in range(0, n, step):
        rows = slice(start, start + step)
        _encode_rows(x[rows], g, g_k, factor, data[rows], scale[rows])
    return data, scale, g
