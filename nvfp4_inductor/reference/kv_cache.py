"""The NVFP4 KV cache in executable form: its layout, the write, the dequantize and attention.

A cache holds one layer's keys (or values) for B sequences, H kv heads and T token slots, each
row of D values quantized along D with its own fp32 global scale (one per token and kv head:
`reference.quantize(x, per_row=True)`). It is one uint8 tensor of shape (B, H, T, R),
R = D/2 + D/16 + 4 bytes a row, whose bytes are three planes, one after the other:

    data  (B, H, T, D/2)  uint8 codes     at byte  i_row * D/2 + j                  (j < D/2)
    scale (B, H, T, D/16) e4m3 bits       at byte  n * D/2 + i_row * D/16 + c       (c < D/16)
    g     (B, H, T)       fp32            at byte  n * 9D/16 + 4 * i_row
    i_row = (b * H + h) * T + t,  n = B * H * T

The shape tells the kernels B, H, T and D (D = 16 (R - 4) / 9) and gives the tensor the size and
the (B, H, T, .) look of a cache; the planes make every token's codes and scales contiguous,
each plane a contiguous tensor (so `dequantize_rows` reads it as 2-D rows), and every plane
starts 16-byte aligned when T is a multiple of 16 (`SLOT_MULTIPLE`). At D = 128 a row is 76
bytes against 256 for bf16: 0.297x.

Attention over such caches (`attention`) is the specification of the decode kernel: keys and
values dequantized to fp32 (e2m1 * s * g, one rounding), scores, softmax and sums in fp32.
"""

import math

import torch
from torch import Tensor

from nvfp4_inductor.format import BLOCK_SIZE
from nvfp4_inductor.reference import dequantize as dequantize_nvfp4
from nvfp4_inductor.reference import quantize

# Token slots are allocated in multiples of this: every plane then starts 16-byte aligned.
SLOT_MULTIPLE = 16
_G_BYTES = 4  # one fp32 global scale a row

__all__ = ["SLOT_MULTIPLE", "row_bytes", "head_dim_of", "cache_shape", "planes", "write", "dequantize",
           "attention"]


def row_bytes(head_dim: int) -> int:
    """Bytes of one cached row of head_dim values: codes, block scales, global scale."""
    return head_dim // 2 + head_dim // BLOCK_SIZE + _G_BYTES


def head_dim_of(cache: Tensor) -> int:
    """A cache (B, H, T, R) -> D, from R = 9D/16 + 4."""
    return (cache.shape[-1] - _G_BYTES) * BLOCK_SIZE // (BLOCK_SIZE // 2 + 1)


def cache_shape(batch: int, heads: int, slots: int, head_dim: int) -> tuple[int, int, int, int]:
    """The (B, H, T, R) uint8 shape of a cache; T rounded up to a multiple of SLOT_MULTIPLE."""
    slots = -(-slots // SLOT_MULTIPLE) * SLOT_MULTIPLE
    return batch, heads, slots, row_bytes(head_dim)


def planes(cache: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(B, H, T, R) uint8 cache -> views (data uint8 (B, H, T, D/2), scale bits uint8
    (B, H, T, D/16), g fp32 (B, H, T)) of its bytes (the module docstring's layout)."""
    b, h, t, _ = cache.shape
    d = head_dim_of(cache)
    n = b * h * t
    flat = cache.view(-1)
    data = flat[: n * d // 2].view(b, h, t, d // 2)
    scale = flat[n * d // 2: n * (d // 2 + d // BLOCK_SIZE)].view(b, h, t, d // BLOCK_SIZE)
    g = flat[n * (d // 2 + d // BLOCK_SIZE):].view(torch.float32).view(b, h, t)
    return data, scale, g


def write(cache: Tensor, x: Tensor, positions: Tensor) -> None:
    """Quantize x (B', H, S, D) float (B' <= B) row by row, per-row global scale, into slots
    positions (S,) of sequences 0 .. B'-1 of the cache, in place. Positions must lie in [0, T)."""
    data, scale, g = planes(cache)
    x_data, x_scale, x_g = quantize(x, None, per_row=True)
    batch = x.shape[0]
    index = positions.long()
    data[:batch].index_copy_(2, index, x_data)
    scale[:batch].index_copy_(2, index, x_scale.view(torch.uint8))
    g[:batch].index_copy_(2, index, x_g)


def dequantize(cache: Tensor, dtype: torch.dtype = torch.float32, batch: int | None = None) -> Tensor:
    """Cache (B, H, T, R) -> (batch or B, H, T, D) of dtype: e2m1 * s * g, rounded once."""
    data, scale, g = planes(cache)
    batch = cache.shape[0] if batch is None else batch
    return dequantize_nvfp4(data[:batch], scale[:batch].view(torch.float8_e4m3fn), g[:batch], dtype)


def attention(query: Tensor, k_cache: Tensor, v_cache: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """softmax(q k^T * scale) v over NVFP4 caches -> (B', Hq, S, D) in query's dtype.

    query (B', Hq, S, D), Hq a multiple of the caches' H (query head i reads kv head i // (Hq / H));
    mask (B', 1, S, T) bool (or broadcastable to it), True where a query attends a slot; None is
    causal from slot 0 (query s attends slots 0 .. s). A query that attends no slot gets zeros.
    """
    batch, q_heads, seq, _ = query.shape
    group = q_heads // k_cache.shape[1]
    k = dequantize(k_cache, torch.float32, batch).repeat_interleave(group, dim=1)
    v = dequantize(v_cache, torch.float32, batch).repeat_interleave(group, dim=1)
    slots = k.shape[2]
    if mask is None:
        mask = torch.ones(seq, slots, dtype=torch.bool, device=query.device).tril()
    scores = (query.float() @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, -math.inf)
    top = scores.amax(dim=-1, keepdim=True)
    p = torch.exp(scores - torch.where(top == -math.inf, 0.0, top))
    total = p.sum(dim=-1, keepdim=True)
    out = (p @ v) / torch.where(total == 0, 1.0, total)
    return out.to(query.dtype)
