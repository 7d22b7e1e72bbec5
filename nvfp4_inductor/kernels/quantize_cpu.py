"""NVFP4 quantize on the CPU, bit for bit `reference.quantize` with a per-tensor global scale,
compiled by Inductor's C++ backend into one fused loop.

The reference spells the contract out step by step, each step a full-size fp32 temporary that
streams through memory (the numbers: docs/checkpoints.md). Compiled, the block amax, the block
scale, the reciprocal, the product and the encode run per block in registers. The operations are
the reference's, in its order (reference/__init__.py's docstring), with two rearrangements that
give the same bits:
    - the block-finite test reads the block amax (amax propagates NaN, and is inf for an inf);
    - the code is summed in fp32, sign * 8 plus one per midpoint below |y| (a tie counting for
      the odd midpoints only), and the two codes of a byte as low + 16 * high: every partial sum
      is a small integer, exact in fp32, so the conversion to uint8 at the end is exact too
      (fp32 vectors run faster there than uint8 ones).
Inductor's C++ flags keep IEEE fp32 semantics (no fast-math contraction or reassociation); the
tests compare with the reference on special blocks (zeros, ties, saturating, subnormal, NaN /
Inf, tiny global scales).
"""

import functools
import math
import warnings

import torch
from torch import Tensor

from nvfp4_inductor import reference
from nvfp4_inductor.format import BLOCK_SIZE, E2M1_MAX, E2M1_MIDPOINTS, E2M1_SIGN_BIT, E4M3_MAX

__all__ = ["quantize", "finite_amax"]


def _encode(x: Tensor, g: Tensor, g_k: Tensor, factor: Tensor) -> tuple[Tensor, Tensor]:
    """x (N, K) float, fp32 g, g * k, k () -> (data uint8 (N, K/2), scale e4m3 (N, K/16))."""
    n, k = x.shape
    blocks = x.float().view(n, k // BLOCK_SIZE, BLOCK_SIZE)
    block_amax = blocks.abs().amax(dim=-1)
    scale_f32 = torch.clamp(block_amax / (g * E2M1_MAX), max=E4M3_MAX)
    scale_f32 = torch.where(torch.isfinite(block_amax), scale_f32, torch.full_like(scale_f32, math.nan))
    scale = scale_f32.to(torch.float8_e4m3fn)
    s = scale.float()
    usable = (s > 0) & torch.isfinite(s)
    recip = 1.0 / torch.where(usable, s * g_k, torch.ones_like(s))
    y = (blocks * factor) * recip.unsqueeze(-1)
    y_abs = y.abs()
    code = torch.signbit(y).float() * float(E2M1_SIGN_BIT)
    for i, midpoint in enumerate(E2M1_MIDPOINTS):
        code = code + ((y_abs >= midpoint) if i % 2 else (y_abs > midpoint)).float()
    code = torch.where(usable.unsqueeze(-1), code, torch.zeros_like(code)).view(n, k)
    return (code[:, 0::2] + code[:, 1::2] * 16.0).to(torch.uint8), scale


def _finite_amax(x: Tensor) -> Tensor:
    return reference.finite_amax(x)


@functools.cache
def _compiled(fn):
    return torch.compile(fn, dynamic=True)


def _run(fn, *args):
    """fn compiled, or, where Inductor cannot build C++ here, as it is (the same bits, slower)."""
    try:
        return _compiled(fn)(*args)
    except Exception as error:  # (no C++ compiler, or another backend failure: correctness first)
        warnings.warn(f"kernels.quantize_cpu: torch.compile failed ({type(error).__name__}: {error}); "
                      "running eagerly", stacklevel=3)
        return fn(*args)


def finite_amax(x: Tensor) -> Tensor:
    """(..., K) float CPU -> fp32 () max |x| over the finite elements, as reference.finite_amax."""
    return _run(_finite_amax, x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1))


def quantize(x: Tensor, global_scale: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(N, K) float CPU + fp32 g () -> (data uint8 (N, K/2), scale e4m3 (N, K/16), g fp32 ()),
    equal to reference.quantize(x, global_scale)."""
    if x.dim() != 2 or x.shape[-1] % BLOCK_SIZE or x.device.type != "cpu" or global_scale.numel() != 1:
        raise ValueError(f"quantize_cpu.quantize takes a 2-D CPU tensor with K % {BLOCK_SIZE} == 0 and a "
                         f"per-tensor global scale; got {tuple(x.shape)} on {x.device}, global scale "
                         f"shape {tuple(global_scale.shape)}")
    g = global_scale.to(torch.float32, copy=True).reshape(())
    if not bool(torch.isfinite(g) & (g > 0)) or x.numel() == 0:  # (NaN blocks everywhere: the reference's rule)
        return reference.quantize(x, g)
    factor, g_k = reference.reciprocal_operands(g)
    data, scale = _run(_encode, x, g, g_k, factor)
    return data, scale, g
