"""`NVFP4Cache`: a static transformers `Cache` holding keys and values as NVFP4, and the
`attn_implementation="nvfp4"` attention that reads it (transformers 5.x).

    cache = nv.NVFP4Cache(model.config, max_batch_size=B, max_cache_len=T, device="cuda", dtype=torch.bfloat16)
    model.set_attn_implementation("nvfp4")
    out = model.generate(ids, past_key_values=cache, max_new_tokens=n)

Each layer keeps two preallocated (B, H_kv, T, 9D/16 + 4) uint8 caches (reference/kv_cache.py:
codes, e4m3 block scales along the head dimension, one fp32 global scale per token and kv head),
at static addresses, with a device-side length as transformers' StaticLayer keeps it: `update`
quantizes the step's keys and values (after RoPE) into their slots with one `nvfp4::kv_write`
and returns the two caches themselves. The "nvfp4" attention recognises them (uint8 keys) and
runs `nvfp4::kv_attention`: the decode kernel reads the packed caches directly. With another
attention implementation `update` returns the caches dequantized to `dtype` instead (correct,
and no faster than a bf16 cache). Nothing reads the device back to the host, so decode steps
compile and capture into CUDA graphs; the length check is done on the host where the step runs
eagerly (it counts tokens), and under torch.compile the kernel writes nothing past the cache.

Importing this module registers "nvfp4" with transformers' AttentionInterface and, for its
masks, the boolean SDPA masks (AttentionMaskInterface). `cache_implementation="nvfp4"` is not
offered: transformers validates cache_implementation against a fixed tuple, with no registry.
"""

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.cache_utils import Cache, StaticLayer, get_layer_types_and_kwargs
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from nvfp4_inductor import checks, ops
from nvfp4_inductor.format import BLOCK_SIZE
from nvfp4_inductor.reference import kv_cache as layout

ATTN_IMPLEMENTATION = "nvfp4"

__all__ = ["NVFP4Cache", "NVFP4Layer", "ATTN_IMPLEMENTATION", "nvfp4_attention"]


def _mark_static(*tensors: Tensor) -> None:
    """Fixed addresses for torch.compile and CUDA graphs, as transformers' StaticLayer marks its own."""
    if not torch.compiler.is_compiling():
        for t in tensors:
            torch._dynamo.mark_static_address(t)


class NVFP4Layer(StaticLayer):
    """One attention layer's NVFP4 keys and values: `keys` and `values` are (B, H, T, 9D/16 + 4)
    uint8 caches (reference/kv_cache.py), allocated at construction."""

    def __init__(self, max_batch_size: int, num_heads: int, max_cache_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = layout.cache_shape(max_batch_size, num_heads, max_cache_len, head_dim)
        super().__init__(max_cache_len=shape[2])
        self.batch_size, self.num_heads, self.head_dim = max_batch_size, num_heads, head_dim
        self.k_head_dim = self.v_head_dim = head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.keys = torch.zeros(shape, dtype=torch.uint8, device=self.device)
        self.values = torch.zeros(shape, dtype=torch.uint8, device=self.device)
        self.cumulative_length = self.cumulative_length.to(self.device)
        _mark_static(self.keys, self.values, self.cumulative_length)
        self.is_initialized = True
        self.written = 0  # tokens written by eager steps (the host-side length check)

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        """Allocated at construction: nothing to do."""

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Quantize the step's keys and values into the next slots -> (keys, values) caches."""
        if key_states.dtype != self.dtype:
            raise TypeError(f"NVFP4Cache was allocated for {self.dtype} keys and values; got {key_states.dtype}")
        steps = key_states.shape[-2]
        if not torch.compiler.is_compiling():
            if self.written + steps > self.max_cache_len:  # (checked before anything is written)
                raise ValueError(f"NVFP4Cache is too short: {self.written + steps} tokens (prompt and new tokens) "
                                 f"do not fit its {self.max_cache_len} slots (max_cache_len, rounded up to a multiple "
                                 f"of {layout.SLOT_MULTIPLE}); allocate a larger one")
            self.written += steps
        positions = torch.arange(steps, device=self.device) + self.cumulative_length
        self.cumulative_length.add_(steps)
        ops.kv_write(key_states, value_states, self.keys, self.values, positions)
        return self.keys, self.values

    def reset(self) -> None:
        super().reset()
        self.written = 0

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        self.written = max(0, self.written - abs(tokens_to_remove))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorders the sequences (beam search), plane by plane, in place (the addresses stay)."""
        for cache in (self.keys, self.values):
            for plane in ops.kv_planes(cache):
                plane.copy_(plane.index_select(0, beam_idx.to(plane.device)))

    def dequantized(self, batch: int, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        """-> keys and values of sequences 0 .. batch-1 as (batch, H, T, D) of dtype (the layer's)."""
        dtype = dtype or self.dtype
        return tuple(ops.dequantize(*ops.kv_planes(c, batch), False, dtype) for c in (self.keys, self.values))


class NVFP4Cache(Cache):
    """A static KV cache holding keys and values as NVFP4 (per-token, per-kv-head fp32 scale), for
    `generate(past_key_values=...)` and compiled decoding; read directly by attn_implementation
    "nvfp4" (module docstring).

    config: the model's config (full-attention decoder layers; head_dim a multiple of 16);
    max_batch_size, max_cache_len: the sequences and token slots allocated (slots rounded up to a
    multiple of 16); dtype: the model's (bf16, fp16 or fp32) keys and values.
    """

    def __init__(self, config, max_batch_size: int, max_cache_len: int, device=None,
                 dtype: torch.dtype = torch.bfloat16):
        text = config.get_text_config(decoder=True)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        if head_dim % BLOCK_SIZE:
            raise ValueError(f"NVFP4Cache needs head_dim a multiple of {BLOCK_SIZE} (one e4m3 scale per "
                             f"{BLOCK_SIZE} values); the model has head_dim {head_dim}")
        if dtype not in checks.KV_DTYPES:
            raise TypeError(f"NVFP4Cache takes keys and values of dtype bf16, fp16 or fp32; got {dtype}")
        for name, value in (("max_batch_size", max_batch_size), ("max_cache_len", max_cache_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int; got {value!r}")
        layer_types, _ = get_layer_types_and_kwargs(text)
        other = sorted(set(layer_types) - {"full_attention"})
        if other:
            raise NotImplementedError(f"NVFP4Cache holds full-attention layers only; this model also has {other}")
        device = torch.device(device if device is not None else "cpu")
        layers = [NVFP4Layer(max_batch_size, kv_heads, max_cache_len, head_dim, dtype, device)
                  for _ in layer_types]
        super().__init__(layers=layers)
        self.config = text
        self.head_dim, self.dtype = head_dim, dtype  # (sizes: batch_size, get_max_length(), as transformers')

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        """Write the step's keys and values; -> the layer's caches for the "nvfp4" attention, or
        their dequantized values (batch, H, T, D) for any other."""
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if self.config._attn_implementation == ATTN_IMPLEMENTATION:
            return keys, values
        keys, values = self.layers[layer_idx].dequantized(key_states.shape[0])
        if not torch.compiler.is_compiling():  # (nvfp4_attention refuses them: the cache's config is not the model's)
            keys._nvfp4_dequantized = values._nvfp4_dequantized = (self.config._attn_implementation, )
        return keys, values

    def gather(self, layer: int, indices: Tensor, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        """Selected slots of one layer, dequantized: indices (B', H, n) or (n,) int slot numbers ->
        (keys, values), each (B', H, n, D) of dtype (the cache's), reading only those rows
        (`nvfp4::dequantize_rows`). Eager mode raises IndexError for a slot outside [0, T)."""
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < len(self.layers):
            raise IndexError(f"layer must be an int in 0 .. {len(self.layers) - 1}; got {layer!r}")
        keys = self.layers[layer].keys
        batch, heads, slots, _ = keys.shape
        checks.check_tensor("indices", indices, (torch.int32, torch.int64))
        if indices.dim() == 1:
            indices = indices.expand(batch, heads, -1)
        if indices.dim() != 3 or indices.shape[0] > batch or indices.shape[1] != heads:
            raise ValueError(f"indices must be (n,) or (B', {heads}, n) with B' <= {batch}; got {tuple(indices.shape)}")
        capturing = indices.is_cuda and torch.cuda.is_current_stream_capturing()
        if not (torch.compiler.is_compiling() or capturing) and indices.numel():
            bad = (indices < 0) | (indices >= slots)
            if bad.any():
                raise IndexError(f"indices: slot {indices[bad][0].item()} is out of range for a cache of {slots} slots "
                                 f"(valid: 0 .. {slots - 1})")
        b = torch.arange(indices.shape[0], device=indices.device)[:, None, None]
        h = torch.arange(heads, device=indices.device)[None, :, None]
        in_range = (indices >= 0) & (indices < slots)
        rows = torch.where(in_range, (b * heads + h) * slots + indices.long(), -1)  # -1: a NaN row under capture
        dtype = dtype or self.dtype
        out = []
        for cache in (keys, self.layers[layer].values):
            data, scale, g = ops.kv_planes(cache)
            out.append(ops.dequantize_rows(data.reshape(-1, data.shape[-1]), scale.reshape(-1, scale.shape[-1]),
                                           g.reshape(-1), False, rows, dtype))
        return out[0], out[1]


def nvfp4_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, scaling=None,
                    dropout: float = 0.0, **kwargs):
    """transformers' attention-interface signature -> ((B, S, Hq, D) output, None). Keys and values
    from an NVFP4Cache (uint8) go to `nvfp4::kv_attention`; any others to transformers' SDPA."""
    if key.dtype != torch.uint8:
        other = None if torch.compiler.is_compiling() else getattr(key, "_nvfp4_dequantized", None)
        if other is not None:
            raise ValueError(f"attn_implementation 'nvfp4' got keys an NVFP4Cache dequantized for {other[0]!r} "
                             "attention: the cache reads the attention from the config it was built with, which "
                             "is not this model's; build it with NVFP4Cache(model.config, ...)")
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    if dropout:
        raise NotImplementedError("attn_implementation 'nvfp4' runs no attention dropout (inference only)")
    for unsupported in ("sliding_window", "softcap", "s_aux"):
        if kwargs.get(unsupported) is not None:
            raise NotImplementedError(f"attn_implementation 'nvfp4' does not take {unsupported}")
    mask = attention_mask
    if mask is not None and mask.dtype != torch.bool:  # an additive mask: attended where above its minimum
        mask = mask > torch.finfo(mask.dtype).min / 2
    if mask is None and query.shape[2] == 1:
        raise ValueError("attn_implementation 'nvfp4' needs the attention mask at one query position "
                         "(a static cache holds unwritten slots)")
    if mask is not None and mask.shape[-1] != key.shape[2]:
        raise ValueError(f"the attention mask covers {mask.shape[-1]} slots; the NVFP4 cache has {key.shape[2]}")
    scale = float(query.shape[-1] ** -0.5 if scaling is None else scaling)
    out = ops.kv_attention(query, key, value, mask, scale)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_IMPLEMENTATION, nvfp4_attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
