"""The tiled weight layout of the skinny GEMM (kernels/gemm_splitk.py): NVFP4 codes and plain scale
bits cut into (TILE_N, TILE_K) tiles, each tile's rows stored contiguously, tile after tile:

    data_tiled[((tn * tiles_k + tk) * TILE_N + r) * TILE_K/2 + b] = data[tn * TILE_N + r, tk * TILE_K/2 + b]
    scale_tiled[((tn * tiles_k + tk) * TILE_N + r) * TILE_K/16 + c] = scale[tn * TILE_N + r, tk * TILE_K/16 + c]

zero-padded to multiples of (TILE_N, TILE_K) (zero codes and zero scales contribute nothing). A
program of the skinny kernel then reads each K-step as one contiguous 2 KiB run (16-byte vectors,
every sector used) instead of 64 rows x 32 bytes: measured on an H200, 1.25-1.6x bf16 cuBLAS at
M = 1 instead of 0.76-0.85x (the row-major reads left the L1 pipe 88% busy at 15% of DRAM
bandwidth). Weights are laid out this way once, when they are quantized by the backend; the
interchange layout (SPEC §3) is what users and checkpoints see.

MMA code order (`to_mma_order`, read by the register-fed decode GEMM, kernels/gemm_mma.py): the
same tiles, each 32-bit word of 8 codes (k offsets o .. o + 7, natural: code i in bits 4i .. 4i + 3)
rearranged bit by bit so that code pair p = (2p, 2p + 1) decodes into one bf16x2 register (low
half: code 2p) with at most two shifts. A code lands as bf16 bits (magnitude << 6) | (sign << 15),
which is e2m1 * 2^-126 (kernels/gemm_splitk.py, 1.); pair p keeps its magnitude bits at
MMA_PAIR_BITS[p][0] + (0, 1, 2) and its sign at MMA_PAIR_BITS[p][1] (+ 16 for the high half):
    pair 0: magnitude 6..8,   sign 15    w & 0x81C081C0
    pair 1: magnitude 0..2,   sign 9     (w << 6) & 0x81C081C0
    pair 2: magnitude 3..5,   sign 10    ((w << 3) & 0x01C001C0) | ((w << 5) & 0x80008000)
    pair 3: magnitude 11..13, sign 14    ((w >> 5) & 0x01C001C0) | ((w << 1) & 0x80008000)
11 instructions a word against 16 in the natural order, where the sign sits 3 bits above its
magnitude instead of 9 (an exhaustive search over placements found none cheaper). Pairs of
consecutive k also let the GEMM hand x's bf16 words to the MMA as they are loaded.
"""

import torch
from torch import Tensor

from .format import BLOCK_SIZE

TILE_N = 64
TILE_K = 64
MMA_PAIR_BITS = ((6, 15), (0, 9), (3, 10), (11, 14))  # (lowest magnitude bit, sign bit) of pair p


def tiled_shapes(n: int, k: int) -> tuple[tuple[int], tuple[int]]:
    """(N, K) -> the 1-D shapes of the tiled codes and scale bits."""
    n_pad, k_pad = -(-n // TILE_N) * TILE_N, -(-k // TILE_K) * TILE_K
    return (n_pad * k_pad // 2,), (n_pad * k_pad // BLOCK_SIZE,)


def tile(data: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
    """uint8 (N, K/2) codes, uint8 plain (N, K/16) scale bits -> the tiled 1-D pair."""
    n, k = data.shape[0], data.shape[1] * 2
    n_pad, k_pad = -(-n // TILE_N) * TILE_N, -(-k // TILE_K) * TILE_K
    out = []
    for part, per in ((data, 2), (scale, BLOCK_SIZE)):
        padded = part.new_zeros((n_pad, k_pad // per))
        padded[:n, : k // per] = part
        out.append(padded.view(n_pad // TILE_N, TILE_N, k_pad // TILE_K, TILE_K // per)
                   .permute(0, 2, 1, 3).reshape(-1))
    return out[0], out[1]


def untile(data_tiled: Tensor, scale_tiled: Tensor, n: int, k: int) -> tuple[Tensor, Tensor]:
    """The inverse of tile: -> uint8 (N, K/2) codes and plain (N, K/16) scale bits."""
    n_pad, k_pad = -(-n // TILE_N) * TILE_N, -(-k // TILE_K) * TILE_K
    out = []
    for part, per in ((data_tiled, 2), (scale_tiled, BLOCK_SIZE)):
        full = (part.view(n_pad // TILE_N, k_pad // TILE_K, TILE_N, TILE_K // per)
                .permute(0, 2, 1, 3).reshape(n_pad, k_pad // per))
        out.append(full[:n, : k // per].contiguous())
    return out[0], out[1]


def _move_codes(words: Tensor, to_mma: bool) -> Tensor:
    """int64 words of 8 codes -> the same codes in the other order (see the module docstring)."""
    out = words.new_zeros(words.shape)
    for i in range(8):
        mag_bit, sign_bit = MMA_PAIR_BITS[i // 2]
        half = 16 * (i % 2)
        natural = (4 * i, 4 * i + 3)  # (magnitude, sign) bit positions of code i, natural order
        mma = (mag_bit + half, sign_bit + half)
        src, dst = (natural, mma) if to_mma else (mma, natural)
        out |= ((words >> src[0]) & 7) << dst[0]
        out |= ((words >> src[1]) & 1) << dst[1]
    return out


def _words(codes: Tensor) -> Tensor:
    if codes.dim() != 1 or codes.numel() % 4:
        raise ValueError(f"tiled codes must be a 1-D uint8 tensor of whole 32-bit words; got "
                         f"{tuple(codes.shape)}")
    return codes.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def to_mma_order(data_tiled: Tensor) -> Tensor:
    """uint8 tiled codes (natural order) -> the same codes in the MMA order."""
    moved = _move_codes(_words(data_tiled), True)
    return torch.where(moved >= 2**31, moved - 2**32, moved).to(torch.int32).view(torch.uint8)


def from_mma_order(data_tiled: Tensor) -> Tensor:
    """The inverse of to_mma_order."""
    moved = _move_codes(_words(data_tiled), False)
    return torch.where(moved >= 2**31, moved - 2**32, moved).to(torch.int32).view(torch.uint8)
