"""The tiled weight layout of the skinny GEMM (kernels/gemm_splitk.py): NVFP4 codes and plain scale
bits cut into (TILE_N, TILE_K) tiles, tile after tile, each tile's codes its rows stored
contiguously and its 256 scale bytes in the order the register-fed decode GEMM reads them
(kernels/device/mma.py: thread 32u + 4g + q multiplies tile rows 32u + g + 8j, j = 0..3, at block
q, and loads their four scales as one word):

    data_tiled[((tn * tiles_k + tk) * TILE_N + r) * TILE_K/2 + b] = data[tn * TILE_N + r, tk * TILE_K/2 + b]
    scale_tiled[(tn * tiles_k + tk) * TILE_SCALES + scale_index(r, c)]
        = scale[tn * TILE_N + r, tk * TILE_K/16 + c],
    scale_index(r, c) = 128 * (r // 32) + 16 * (r % 8) + 4 * c + (r % 32) // 8

zero-padded to multiples of (TILE_N, TILE_K) (zero codes and zero scales contribute nothing). A
program of the skinny kernel then reads each K-step as one contiguous 2 KiB run (16-byte vectors,
every sector used) instead of 64 rows x 32 bytes, whose reads bind the kernel on the L1 pipe
(docs/gemm.md). The scale order: a word load a thread instead of four byte loads, the same
128-byte line a warp. Weights are laid out this way once, when they are quantized by the backend;
the interchange layout (the README's numerics contract) is what users and checkpoints see.
"""

import torch
from torch import Tensor

from nvfp4_inductor.format import BLOCK_SIZE

TILE_N = 64
TILE_K = 64
TILE_SCALES = TILE_N * TILE_K // BLOCK_SIZE  # scale bytes a tile (256)


def scale_index(r, c):
    """Tile row r, block c (ints or tensors) -> the byte of its scale in the tile's TILE_SCALES
    (module docstring; kernels/device/common.tiled_scale_offset is the kernels' copy)."""
    return 128 * (r // 32) + 16 * (r % 8) + 4 * c + (r % 32) // 8


def _scale_places(device) -> Tensor:
    """(TILE_SCALES,) the stored byte of each of a tile's scales, (row, block) in row-major order."""
    r = torch.arange(TILE_N, device=device)[:, None]
    return scale_index(r, torch.arange(TILE_K // BLOCK_SIZE, device=device)[None, :]).reshape(-1)


# A gated MLP's gate and up weights multiplied as one GEMM whose epilogue takes silu(gate) * up
# (nvfp4::linear_tiled_silu_mul): their rows interleaved in groups of GATED_GROUP, so that every
# TILE_N-row tile holds 32 gate rows and the same 32 up rows.
GATED_GROUP = TILE_N // 2


def interleave_halves(gate: Tensor, up: Tensor) -> Tensor:
    """(n, ...) gate rows and (n, ...) up rows, n a multiple of GATED_GROUP -> (2n, ...): gate rows
    0-31, up rows 0-31, gate rows 32-63, ..."""
    n, rest = gate.shape[0], gate.shape[1:]
    groups = [t.reshape(n // GATED_GROUP, GATED_GROUP, *rest) for t in (gate, up)]
    return torch.stack(groups, 1).reshape(2 * n, *rest)


def split_halves(y: Tensor) -> tuple[Tensor, Tensor]:
    """(..., 2n) columns in interleave_halves' order -> (gate, up), each (..., n)."""
    lead, n = y.shape[:-1], y.shape[-1] // 2
    groups = y.reshape(*lead, n // GATED_GROUP, 2, GATED_GROUP)
    return groups[..., 0, :].reshape(*lead, n), groups[..., 1, :].reshape(*lead, n)


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
    scales = torch.empty_like(out[1]).view(-1, TILE_SCALES)
    scales[:, _scale_places(scale.device)] = out[1].view(-1, TILE_SCALES)
    return out[0], scales.view(-1)


def untile(data_tiled: Tensor, scale_tiled: Tensor, n: int, k: int) -> tuple[Tensor, Tensor]:
    """The inverse of tile: -> uint8 (N, K/2) codes and plain (N, K/16) scale bits."""
    n_pad, k_pad = -(-n // TILE_N) * TILE_N, -(-k // TILE_K) * TILE_K
    scale_rows = scale_tiled.view(-1, TILE_SCALES)[:, _scale_places(scale_tiled.device)]
    out = []
    for part, per in ((data_tiled, 2), (scale_rows, BLOCK_SIZE)):
        full = (part.reshape(n_pad // TILE_N, k_pad // TILE_K, TILE_N, TILE_K // per)
                .permute(0, 2, 1, 3).reshape(n_pad, k_pad // per))
        out.append(full[:n, : k // per].clone(memory_format=torch.contiguous_format))  # (never a view of the input)
    return out[0], out[1]


# Mixture-of-experts weights (E, N, K): each expert tiled on its own, one after another, so that
# expert e's tiles are rows [e * tile_rows, (e + 1) * tile_rows) of tiles of one (E * N_pad, K)
# tiled weight. A gated gate_up (2I rows: gate [0, I), up [I, 2I)) is stored as
# interleave_halves of its halves, each first padded with zero rows to a multiple of GATED_GROUP,
# so that every tile holds 32 gate rows and the same 32 up rows (the kernels' SiLU * up epilogue).

def expert_rows(n: int, gated: bool) -> int:
    """An expert's rows as stored (N_pad: a multiple of TILE_N) for N logical rows (2I, gated)."""
    if gated:
        return 2 * (-(-(n // 2) // GATED_GROUP) * GATED_GROUP)
    return -(-n // TILE_N) * TILE_N


def stored_rows(part: Tensor, gated: bool) -> Tensor:
    """(E, N, C) per-row values of each expert (codes, scale bits, a bias) in the logical row
    order -> (E, N_pad, C) in the stored order (zero rows as padding)."""
    e, n = part.shape[0], part.shape[1]
    rows = expert_rows(n, gated)
    if not gated:
        padded = part.new_zeros((e, rows, part.shape[2]))
        padded[:, :n] = part
        return padded
    half = rows // 2
    gate, up = (part.new_zeros((e, half, part.shape[2])) for _ in range(2))
    gate[:, : n // 2], up[:, : n // 2] = part[:, : n // 2], part[:, n // 2:]
    return torch.stack([t.view(e, half // GATED_GROUP, GATED_GROUP, -1) for t in (gate, up)], 2).view(e, rows, -1)


def tile_experts(data: Tensor, scale: Tensor, gated: bool) -> tuple[Tensor, Tensor]:
    """uint8 (E, N, K/2) codes, plain (E, N, K/16) scale bits (N = 2I gate-then-up rows with
    gated) -> (E, N_pad * K_pad / 2) tiled codes, (E, N_pad * K_pad / 16) tiled scale bits."""
    e = data.shape[0]
    codes, scales = tile(*(stored_rows(part, gated).flatten(0, 1) for part in (data, scale)))
    return codes.view(e, -1), scales.view(e, -1)


def untile_experts(codes: Tensor, scales: Tensor, n: int, k: int, gated: bool) -> tuple[Tensor, Tensor]:
    """The inverse of tile_experts: -> uint8 (E, N, K/2) codes, plain (E, N, K/16) scale bits."""
    e, rows = codes.shape[0], expert_rows(n, gated)
    out = []
    for part in untile(codes.reshape(-1), scales.reshape(-1), e * rows, k):
        part = part.view(e, rows, -1)
        if gated:
            halves = part.view(e, rows // (2 * GATED_GROUP), 2, GATED_GROUP, -1)
            part = torch.cat([halves[:, :, j].reshape(e, rows // 2, -1)[:, : n // 2] for j in (0, 1)], 1)
        else:
            part = part[:, :n]
        out.append(part.contiguous())
    return out[0], out[1]
