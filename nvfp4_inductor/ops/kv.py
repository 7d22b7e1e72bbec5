"""The NVFP4 KV cache's `nvfp4::` ops (layout: reference/kv_cache.py).

    kv_write(key, value, k_cache, v_cache, positions)    quantize into slots, in place (one op a
                                                          layer and step, both sides)
    kv_attention(query, k_cache, v_cache, mask, scale)   attention over the caches

The default implementation is the reference (any device). On CUDA the write is one Triton kernel
and attention at one query position (decode) is the split-KV kernel that reads the packed cache
(kernels/kv_cache.py); with more query positions (prefill) the caches are dequantized to the
query's dtype by the dequantize kernel and torch's scaled_dot_product_attention runs on them.
Positions outside [0, T) raise ValueError on the CPU; on CUDA they are not read back (no host
sync): the kernel writes nothing there.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from nvfp4_inductor import checks
from nvfp4_inductor.ops.dense import on_input_device
from nvfp4_inductor.reference import kv_cache as reference

__all__ = ["kv_write", "kv_attention", "kv_planes"]


def kv_planes(cache: Tensor, batch: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """A cache -> its (data, scale bits, g) planes, sequences 0 .. batch-1 (all when None)."""
    data, scale, g = reference.planes(cache)
    if batch is not None:
        data, scale, g = data[:batch], scale[:batch], g[:batch]
    return data, scale, g


def _check_positions(positions: Tensor, slots: int) -> None:
    if positions.numel() and ((positions < 0) | (positions >= slots)).any():
        bad = positions[(positions < 0) | (positions >= slots)][0].item()
        raise ValueError(f"positions: slot {bad} is outside the cache's {slots} slots (the cache is too short "
                         f"for the prompt and the new tokens: allocate a larger max_cache_len)")


@torch.library.custom_op("nvfp4::kv_write", mutates_args=("k_cache", "v_cache"))
def kv_write(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, positions: Tensor) -> None:
    """key, value (B', H, S, D) float -> NVFP4 rows (per-row global scale) in slots positions (S,)
    of sequences 0 .. B'-1 of k_cache, v_cache (B, H, T, 9D/16 + 4) uint8, in place."""
    checks.check_kv_write_args(key, value, k_cache, v_cache, positions)
    _check_positions(positions, k_cache.shape[2])
    reference.write(k_cache, key, positions)
    reference.write(v_cache, value, positions)


@kv_write.register_fake
def _(key, value, k_cache, v_cache, positions):
    checks.check_kv_write_args(key, value, k_cache, v_cache, positions)


@kv_write.register_kernel("cuda")
@on_input_device
def _(key, value, k_cache, v_cache, positions):
    from nvfp4_inductor.kernels.kv_cache import write

    checks.check_kv_write_args(key, value, k_cache, v_cache, positions)
    write(key, value, kv_planes(k_cache), kv_planes(v_cache), positions)


@torch.library.custom_op("nvfp4::kv_attention", mutates_args=())
def kv_attention(query: Tensor, k_cache: Tensor, v_cache: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """query (B', Hq, S, D) over the caches' sequences 0 .. B'-1 -> (B', Hq, S, D) in query's
    dtype; mask bool (B' or 1, 1, S or 1, T), True where a query attends a slot, None causal from
    slot 0 (reference.kv_cache.attention)."""
    checks.check_kv_attention_args(query, k_cache, v_cache, mask, scale)
    return reference.attention(query, k_cache, v_cache, mask, scale)


@kv_attention.register_fake
def _(query, k_cache, v_cache, mask, scale):
    checks.check_kv_attention_args(query, k_cache, v_cache, mask, scale)
    return torch.empty_like(query, memory_format=torch.contiguous_format)


@kv_attention.register_kernel("cuda")
@on_input_device
def _(query, k_cache, v_cache, mask, scale):
    from nvfp4_inductor.kernels.dequantize import dequantize
    from nvfp4_inductor.kernels.kv_cache import decode_attention

    checks.check_kv_attention_args(query, k_cache, v_cache, mask, scale)
    batch, _, seq, _ = query.shape
    if seq == 1:
        if mask is not None:
            mask = mask.expand(batch, 1, 1, k_cache.shape[2])[:, 0, 0, :]
        return decode_attention(query, kv_planes(k_cache, batch), kv_planes(v_cache, batch), mask, scale)
    k, v = (dequantize(*kv_planes(cache, batch), False, query.dtype) for cache in (k_cache, v_cache))
    return F.scaled_dot_product_attention(query, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                          enable_gqa=True).contiguous()
