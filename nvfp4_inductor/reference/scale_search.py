"""Weight scale search: the pure-torch reference (a brute-force sweep) for `method="mse"` and
`method="hessian"`, and the CPU implementation of `nvfp4::quantize_weight`.

Round-to-nearest (`method="rtn"`, the README's numerics contract) takes the block scale
`e4m3(block_amax / (6 g))`. For weights quantized once, another of the 126 finite positive E4M3
scales (bits 0x01..0x7E) often gives a smaller error. The global scale g is the contract's; only the
per-block scale changes; the codes are always the reference's RNE encoding for the chosen scale
(`reference.quantize`'s order: `r = 1 / (float(s) * (g k))`, `y = (x k) * r`, k = 2^64 where
g < 2^-100, else 1).

Error of a block x (16 fp32) under scale bits c, in units of g^2 (g is common to every candidate
of a tensor, so it does not change the choice), in this fp32 order, which every kernel follows:

    s = float(e4m3 bits c), r = 1 / (s * (g k)), y_i = (|x_i| k) * r   (exactly as the quantizer)
    d_i = y_i - e2m1_nearest(y_i)                                   (the scaled residual)
    e_i = -d_i where x_i < 0, else d_i
    "mse":     E = (s * s) * tree_sum(d_i * d_i)
    "hessian": E = (s * s) * tree_sum(e_i * t_i),
               t_i = U_ii e_i + U_i,i+1 e_i+1 + ... + U_i,15 e_15    (left to right)
               U = diag(H) + strict upper triangle of (H + H^T)     (so e^T U e = e^T H e)
    tree_sum: adjacent pairs summed, four levels ((v0 + v1) + (v2 + v3)) + ...

so E * g^2 is the block's squared error sum((x - x_hat)^2) (resp. (x - x_hat)^T H (x - x_hat)).
Candidates whose codes are all zero (max_i y_i <= 0.25) dequantize to the same block, so they get
one error, E_zero, computed with s = 1 and r = 1 / (g k); bits 0 (the RTN scale of an underflowing
block) gets E_zero too. With H = identity, t_i = e_i exactly, so "hessian" computes the very same
fp32 numbers as "mse" and chooses the same scales.

Choice: the RTN bits c0 are kept if no candidate has a strictly smaller error; otherwise the
smallest bits among those with the smallest error. Blocks holding NaN / Inf, or a global scale
that is not finite and > 0, keep RTN (the NaN scale: the non-finite policy); all-zero blocks
keep RTN (every candidate ties).

Working in scaled units (d = y - q rather than x - q s g) is what makes the MSE search's upper
bound exact (kernels/scale_search.py: a scale s with max y <= 3 never beats s / 2).
"""

import torch
from torch import Tensor

from nvfp4_inductor import reference
from nvfp4_inductor.format import BLOCK_SIZE, E4M3_NAN_BITS

__all__ = [
    "METHODS", "CANDIDATE_BITS", "hessian_operand", "tree_sum", "block_errors",
    "candidate_errors", "choose_bits", "search_scales", "encode", "quantize",
]

METHODS = ("rtn", "mse", "hessian")
CANDIDATE_BITS = range(0x01, 0x7F)  # the 126 finite positive e4m3 values
ALL_ZERO_MAX_Y = 0.25  # |y| <= 0.25 rounds to code 0 (the tie goes to the even code 0)
_CHUNK_BLOCKS = 2048  # blocks per step of the brute-force sweep (x 128 candidates x 16 fp32)


def hessian_operand(hessian: Tensor) -> Tensor:
    """(K/16, 16, 16) H -> fp32 U = diag(H) + strict upper triangle of (H + H^T): e^T U e = e^T H e
    (only the symmetric part of H counts), with half the products."""
    h = hessian.float()
    upper = torch.triu(h + h.transpose(-1, -2), diagonal=1)
    return upper + torch.diag_embed(torch.diagonal(h, dim1=-2, dim2=-1))


def tree_sum(v: Tensor) -> Tensor:
    """(..., 16) -> (...): adjacent pairs summed level by level (the kernels' fixed order)."""
    while v.shape[-1] > 1:
        v = v[..., 0::2] + v[..., 1::2]
    return v[..., 0]


def _quadratic_form(e: Tensor, u: Tensor) -> Tensor:
    """e (..., 16), U (..., 16, 16) broadcastable -> tree_sum(e_i * t_i), t_i summed left to right."""
    t = torch.diagonal(u, dim1=-2, dim2=-1) * e
    for m in range(1, BLOCK_SIZE):
        upper_m = torch.diagonal(u, offset=m, dim1=-2, dim2=-1)  # U[i, i + m], i < 16 - m
        t = torch.cat([t[..., :BLOCK_SIZE - m] + upper_m * e[..., m:], t[..., BLOCK_SIZE - m:]], -1)
    return tree_sum(e * t)


def _form(d: Tensor, negative: Tensor, u: Tensor | None) -> Tensor:
    if u is None:
        return tree_sum(d * d)
    return _quadratic_form(torch.where(negative, -d, d), u)


def block_errors(x_blocks: Tensor, g: Tensor, bits: Tensor, u: Tensor | None = None) -> Tensor:
    """Errors (module docstring) of fp32 blocks x (B, 16) under scale bits (B, C) -> (B, C);
    u: hessian_operand per block (B, 16, 16), or None for "mse". Bits 0x7F, a non-finite block or
    a bad g: NaN."""
    factor, g_k = reference.reciprocal_operands(g)
    xa = x_blocks.abs() * factor  # exact
    negative = x_blocks < 0
    bits = bits.long()
    s = bits.clamp(0, 0x7E).to(torch.uint8).view(torch.float8_e4m3fn).float()
    s = torch.where(bits == 0, torch.ones_like(s), s)
    r = 1.0 / (s * g_k)                                       # (B, C)
    y = xa.unsqueeze(1) * r.unsqueeze(-1)                     # (B, C, 16)
    q = reference.e2m1_decode(reference.e2m1_encode(y))
    u_c = None if u is None else u.unsqueeze(1)
    errors = (s * s) * _form(y - q, negative.unsqueeze(1), u_c)
    e_zero = _form(xa * (1.0 / g_k), negative, u).unsqueeze(-1)  # s = 1, r = 1 / (g k)
    all_zero = (bits == 0) | (xa.amax(-1, keepdim=True) * r <= ALL_ZERO_MAX_Y)
    errors = torch.where(all_zero, e_zero.expand_as(errors), errors)
    ok = (torch.isfinite(x_blocks).all(-1) & torch.isfinite(g_k) & (g_k > 0)).unsqueeze(-1)
    return torch.where(ok & (bits != E4M3_NAN_BITS), errors, torch.nan)


def candidate_errors(x_blocks: Tensor, g: Tensor, u: Tensor | None = None) -> Tensor:
    """(B, 16) fp32 blocks (+ u (B, 16, 16)) -> (B, 128) errors of every scale bits 0..127
    (column 0: all-zero codes, 127: NaN)."""
    bits = torch.arange(0x80, device=x_blocks.device).expand(*x_blocks.shape[:-1], 0x80)
    return block_errors(x_blocks, g, bits, u)


def choose_bits(errors: Tensor, rtn_bits: Tensor) -> Tensor:
    """(B, 128) candidate errors + RTN bits (B,) -> chosen bits (B,) int64: RTN unless a
    candidate 1..126 is strictly better; else the smallest bits with the smallest error."""
    rtn_bits = rtn_bits.long()
    cand = errors[:, 1:0x7F]
    best = cand.min(dim=-1).values
    first = (cand == best.unsqueeze(-1)).float().argmax(dim=-1) + 1
    rtn_error = errors.gather(1, rtn_bits.unsqueeze(-1)).squeeze(-1)
    keep = ~(best < rtn_error)  # NaN (non-finite block) keeps RTN
    return torch.where(keep, rtn_bits, first)


def _blocks(x: Tensor) -> Tensor:
    return x.float().reshape(-1, x.shape[-1] // BLOCK_SIZE, BLOCK_SIZE)


def search_scales(
    x: Tensor, global_scale: Tensor, method: str, hessian: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """(..., K) weights + fp32 g () -> (chosen e4m3 bits uint8 (..., K/16), their errors fp32),
    by evaluating every candidate (the brute force the kernels are tested against)."""
    blocks = _blocks(x)
    groups = blocks.shape[1]
    g = global_scale.float()
    rtn_bits = reference.block_scales(blocks, g).view(torch.uint8).long().reshape(-1)
    flat = blocks.reshape(-1, BLOCK_SIZE)
    u = None
    if method == "hessian":  # (groups, 16, 16); block b (row-major over (rows, groups)) takes u[b % groups]
        u = hessian_operand(hessian).to(flat.device)
    bits = torch.empty_like(rtn_bits)
    errors = torch.empty(flat.shape[0], dtype=torch.float32, device=flat.device)
    for start in range(0, flat.shape[0], _CHUNK_BLOCKS):
        part = slice(start, start + _CHUNK_BLOCKS)
        u_part = None
        if u is not None:  # this chunk's operands (u expanded to every block took rows x K/16 KiB)
            u_part = u[torch.arange(start, min(start + _CHUNK_BLOCKS, flat.shape[0]), device=u.device) % groups]
        table = candidate_errors(flat[part], g, u_part)
        bits[part] = choose_bits(table, rtn_bits[part])
        errors[part] = table.gather(1, bits[part].unsqueeze(-1)).squeeze(-1)
    shape = (*x.shape[:-1], groups)
    return bits.to(torch.uint8).reshape(shape), errors.reshape(shape)


def encode(x: Tensor, scale_bits: Tensor, global_scale: Tensor) -> Tensor:
    """(..., K) + chosen e4m3 bits (..., K/16) + g -> packed codes (..., K/2), encoded exactly as
    reference.quantize encodes with those scales (zero and NaN scales: all-zero codes)."""
    lead, k = x.shape[:-1], x.shape[-1]
    x_blocks = x.float().reshape(*lead, k // BLOCK_SIZE, BLOCK_SIZE)
    codes = reference.encode_blocks(x_blocks, scale_bits.view(torch.float8_e4m3fn), global_scale)
    return reference.pack_nibbles(codes.reshape(*lead, k))


def quantize(
    x: Tensor, global_scale: Tensor | None, method: str, hessian: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """(..., K) weights -> (data uint8 (..., K/2), scale e4m3 (..., K/16), g fp32 ()) with the
    block scales chosen by `method` over every candidate; g dynamic (per tensor) when None."""
    if global_scale is None:
        global_scale = reference.compute_global_scale(x)
    else:
        global_scale = global_scale.to(torch.float32, copy=True)
    if method == "rtn":
        return reference.quantize(x, global_scale)
    bits, _ = search_scales(x, global_scale, method, hessian)
    return encode(x, bits, global_scale), bits.view(torch.float8_e4m3fn), global_scale
