"""Argument checks shared by the public API, the op implementations and their fake kernels.

All checks read metadata only (dtype, shape, device, strides), never tensor values, so they run
under FakeTensorMode, under torch.compile and inside CUDA-graph capture without a host sync.
"""

import math

import torch
from torch import Tensor

from nvfp4_inductor.format import BLOCK_SIZE
from nvfp4_inductor.reference import kv_cache, swizzled_shape
from nvfp4_inductor.reference.tiled import GATED_GROUP, tiled_shapes

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ACTIVATIONS = ("bf16", "nvfp4")


def _dtype_names(dtypes) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_tensor(name: str, t, dtypes) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {_dtype_names(dtypes)}; got {t.dtype}")


def check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool; got {value!r}")


def check_same_device(name: str, t: Tensor, ref_name: str, ref: Tensor) -> None:
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}")


def check_k(name: str, k: int) -> None:
    if k <= 0 or k % BLOCK_SIZE:
        raise ValueError(
            f"{name}: K = {k} must be a positive multiple of {BLOCK_SIZE} (one e4m3 scale per "
            f"{BLOCK_SIZE} elements); pad K with zeros to the next multiple"
        )


def check_float_input(name: str, x) -> None:
    """x: (..., K) bf16/fp16/fp32 with K a positive multiple of 16 (any strides)."""
    check_tensor(name, x, FLOAT_DTYPES)
    if x.dim() == 0:
        raise ValueError(f"{name} must have at least one dimension (K, the last); got a scalar")
    check_k(f"{name}.shape[-1]", x.shape[-1])


def check_global_scale(name: str, g, lead: torch.Size, per_row: bool, ref_name: str, ref: Tensor):
    """g: fp32, shape () per tensor or `lead` (= data.shape[:-1]) per row, on ref's device."""
    check_tensor(name, g, (torch.float32,))
    check_same_device(name, g, ref_name, ref)
    expected = tuple(lead) if per_row else ()
    if tuple(g.shape) != expected:
        kind = "per row" if per_row else "per tensor"
        raise ValueError(f"{name} ({kind}) must have shape {expected}; got {tuple(g.shape)}")


def check_quantize_args(x, global_scale, per_row: bool) -> None:
    check_float_input("x", x)
    if global_scale is not None:
        check_global_scale("global_scale", global_scale, x.shape[:-1], per_row, "x", x)


def check_rms_norm_args(h, weight, eps: float) -> None:
    """h: (..., K) bf16 / fp16, K a multiple of 16; weight None or a float (K,) on h's device;
    eps finite and >= 0."""
    check_tensor("h", h, (torch.bfloat16, torch.float16))
    if h.dim() == 0:
        raise ValueError("h must have at least one dimension (K, the last); got a scalar")
    check_k("h.shape[-1]", h.shape[-1])
    if weight is not None:
        check_tensor("weight", weight, FLOAT_DTYPES)
        check_same_device("weight", weight, "h", h)
        if tuple(weight.shape) != (h.shape[-1],):
            raise ValueError(f"weight must have shape ({h.shape[-1]},) (h's last dim); got "
                             f"{tuple(weight.shape)}")
    check_eps("eps", eps)


def check_norm_input(norm_h, eps: float, x) -> None:
    """A deferred RMSNorm's input: None, or h bf16 / fp16 on x's device with x's rows (same last
    dim and element count: x may be a view of h's shape), eps finite and >= 0 (x is then h times
    the norm's weight)."""
    if norm_h is None:
        return
    check_tensor("norm_h", norm_h, (torch.bfloat16, torch.float16))
    check_same_device("norm_h", norm_h, "x", x)
    if norm_h.dim() == 0 or norm_h.shape[-1] != x.shape[-1] or norm_h.numel() != x.numel():
        raise ValueError(f"norm_h must have x's rows (shape {tuple(x.shape)} or a view of it with "
                         f"the same last dim); got {tuple(norm_h.shape)}")
    check_eps("norm_eps", eps)


def check_eps(name: str, eps: float) -> None:
    """An RMSNorm's eps: finite and >= 0."""
    if not (eps >= 0 and eps < float("inf")):
        raise ValueError(f"{name} must be finite and >= 0; got {eps}")


def check_silu_mul_linear_args(n: int, w_global_scale, x_global_scale) -> None:
    """n: a positive multiple of the interleave group; the global scales one per weight row; x's
    None or fp32 ()."""
    if n <= 0 or n % GATED_GROUP:
        raise ValueError(f"n = {n} must be a positive multiple of {GATED_GROUP} (gate and up rows are "
                         f"interleaved in groups of {GATED_GROUP})")
    check_tensor("w_global_scale", w_global_scale, (torch.float32,))
    if tuple(w_global_scale.shape) != (2 * n,):
        raise ValueError(f"w_global_scale must have shape ({2 * n},) (one per gate and up row); got "
                         f"{tuple(w_global_scale.shape)}")
    if x_global_scale is not None:
        check_tensor("x_global_scale", x_global_scale, (torch.float32,))
        if x_global_scale.dim() != 0:
            raise ValueError(f"x_global_scale must have shape (); got {tuple(x_global_scale.shape)}")


def check_nvfp4(name: str, data, scale, global_scale, swizzled: bool) -> int:
    """Packed NVFP4 parts (scales as uint8 e4m3 bits, the op-boundary convention); returns K."""
    check_tensor(f"{name}.data", data, (torch.uint8,))
    check_tensor(f"{name}.scale (e4m3 bits)", scale, (torch.uint8,))
    if data.dim() == 0:
        raise ValueError(f"{name}.data must have at least one dimension; got a scalar")
    k = data.shape[-1] * 2
    check_k(f"{name}.data (K = 2 * data.shape[-1])", k)
    lead = data.shape[:-1]
    if swizzled:
        expected = swizzled_shape(math.prod(lead), k // BLOCK_SIZE)  # not numel(): see ops._scale_shape
    else:
        expected = (*lead, k // BLOCK_SIZE)
    if tuple(scale.shape) != tuple(expected):
        layout = "swizzled" if swizzled else "plain"
        raise ValueError(
            f"{name}.scale ({layout}) must have shape {tuple(expected)} for data of shape "
            f"{tuple(data.shape)}; got {tuple(scale.shape)}"
        )
    for part, t in (("data", data), ("scale", scale)):
        if not t.is_contiguous():
            raise ValueError(f"{name}.{part} must be contiguous (packed NVFP4 layout)")
    check_same_device(f"{name}.scale", scale, f"{name}.data", data)
    per_row = isinstance(global_scale, Tensor) and global_scale.dim() > 0
    check_global_scale(f"{name}.global_scale", global_scale, lead, per_row, f"{name}.data", data)
    return k


def check_swizzle_args(scale) -> None:
    check_tensor("scale (e4m3 bits)", scale, (torch.uint8,))
    if scale.dim() != 2:
        raise ValueError(f"scale must be 2-D (rows, K/16); got shape {tuple(scale.shape)}")


def check_unswizzle_args(swizzled, rows: int, cols: int) -> None:
    check_tensor("swizzled (e4m3 bits)", swizzled, (torch.uint8,))
    if rows < 0 or cols < 0:
        raise ValueError(f"rows and cols must be >= 0; got rows={rows}, cols={cols}")
    expected = swizzled_shape(rows, cols)
    if tuple(swizzled.shape) != expected:
        raise ValueError(
            f"swizzled must have shape {expected} for rows={rows}, cols={cols}; "
            f"got {tuple(swizzled.shape)}"
        )


def _check_bias(bias, n: int, x) -> None:
    if bias is not None:
        check_tensor("bias", bias, FLOAT_DTYPES)
        check_same_device("bias", bias, "x", x)
        if tuple(bias.shape) != (n,):
            raise ValueError(f"bias must have shape ({n},) (N); got {tuple(bias.shape)}")


def check_linear_args(x, w_data, w_scale, w_global_scale, bias, w_swizzled, activation) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}; got {activation!r}")
    check_float_input("x", x)
    # named as nv.linear's argument (w_q), what the user passed
    k = check_nvfp4("w_q", w_data, w_scale, w_global_scale, w_swizzled)
    if w_data.dim() != 2:
        raise ValueError(f"w_q.data must be 2-D (N, K/2); got shape {tuple(w_data.shape)}")
    check_same_device("w_q.data", w_data, "x", x)
    if x.shape[-1] != k:
        raise ValueError(f"x.shape[-1] = {x.shape[-1]} does not match the weight's K = {k}")
    _check_bias(bias, w_data.shape[0], x)


def check_tile_args(data, scale) -> None:
    check_tensor("data", data, (torch.uint8,))
    check_tensor("scale", scale, (torch.uint8,))
    if data.dim() != 2 or tuple(scale.shape) != (data.shape[0], data.shape[1] * 2 // BLOCK_SIZE):
        raise ValueError(f"tile_weight needs data (N, K/2) and plain scales (N, K/16) with K % 16 == 0; "
                         f"got {tuple(data.shape)} and {tuple(scale.shape)}")
    check_same_device("scale", scale, "data", data)


def check_untile_args(data, scale, n, k) -> None:
    for name, value in (("n", n), ("k", k)):
        if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)) or value <= 0 or value % BLOCK_SIZE:
            raise ValueError(f"{name} must be a positive multiple of {BLOCK_SIZE}; got {value!r}")
    for name, t, shape in zip(("data", "scale"), (data, scale), tiled_shapes(n, k)):
        check_tensor(name, t, (torch.uint8,))
        if tuple(t.shape) != shape:
            raise ValueError(f"tiled {name} for N={n}, K={k} must have shape {shape}; got {tuple(t.shape)}")
    check_same_device("scale", scale, "data", data)


def check_linear_tiled_args(x, w_data, w_scale, w_global_scale, bias, n, activation) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}; got {activation!r}")
    check_float_input("x", x)
    if isinstance(n, bool) or not isinstance(n, (int, torch.SymInt)) or n <= 0 or n % BLOCK_SIZE:
        raise ValueError(f"n must be a positive multiple of {BLOCK_SIZE}; got {n!r}")
    data_shape, scale_shape = tiled_shapes(n, x.shape[-1])
    for name, t, shape in (("w.data", w_data, data_shape), ("w.scale", w_scale, scale_shape)):
        check_tensor(name, t, (torch.uint8,))
        check_same_device(name, t, "x", x)
        if tuple(t.shape) != shape:
            raise ValueError(f"tiled {name} for N={n}, K={x.shape[-1]} must have shape {shape}; got "
                             f"{tuple(t.shape)}")
        if not t.is_contiguous():  # the kernels read each tile as one contiguous run
            raise ValueError(f"tiled {name} must be contiguous (packed tiled layout)")
    check_tensor("w.global_scale", w_global_scale, (torch.float32,))
    check_same_device("w.global_scale", w_global_scale, "x", x)
    if tuple(w_global_scale.shape) not in ((), (n,)):
        raise ValueError(f"w.global_scale must have shape () or ({n},); got {tuple(w_global_scale.shape)}")
    _check_bias(bias, n, x)


def check_out_dtype(dtype) -> None:
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be one of {_dtype_names(FLOAT_DTYPES)}; got {dtype}")


def check_dequantize_args(data, scale, global_scale, swizzled, dtype) -> int:
    """NVFP4 parts and an output dtype -> K."""
    k = check_nvfp4("q", data, scale, global_scale, swizzled)
    check_out_dtype(dtype)
    return k


def check_dequantize_rows_args(data, scale, global_scale, swizzled, indices, dtype) -> int:
    k = check_dequantize_args(data, scale, global_scale, swizzled, dtype)
    if data.dim() != 2:
        raise ValueError(f"q must be 2-D (rows, K) to gather rows; got shape {(*data.shape[:-1], k)}")
    check_tensor("indices", indices, (torch.int32, torch.int64))
    check_same_device("indices", indices, "q.data", data)
    return k


WEIGHT_METHODS = ("rtn", "mse", "hessian")


def check_weight_method(method, hessian) -> None:
    """method: one of WEIGHT_METHODS; hessian given exactly when method is "hessian"."""
    if not isinstance(method, str):
        raise TypeError(f"method must be a str, one of {WEIGHT_METHODS}; got {type(method).__name__}")
    if method not in WEIGHT_METHODS:
        raise ValueError(f"method must be one of {WEIGHT_METHODS}; got {method!r}")
    if method == "hessian" and hessian is None:
        raise ValueError('method="hessian" needs hessian: the (K/16, 16, 16) calibration matrices '
                         "(nvfp4_inductor.collect_hessians)")
    if method != "hessian" and hessian is not None:
        raise ValueError(f'hessian is only used with method="hessian"; got method={method!r}')


def check_hessian_values(name: str, hessian) -> None:
    """Calibration blocks of X^T X are finite with a diagonal >= 0. A NaN (one NaN activation while
    calibrating) makes the search keep RTN silently, a negative diagonal choose far worse scales.
    Reads the values (a host sync: the eager search and convert() only, never the fake kernel)."""
    if not torch.isfinite(hessian).all():
        raise ValueError(f"{name} is not finite (a NaN or Inf input while calibrating?)")
    if (torch.diagonal(hessian, dim1=-2, dim2=-1) < 0).any():
        raise ValueError(f"{name} has a negative diagonal entry: not X^T X")


def check_quantize_weight_args(x, global_scale, method: str, hessian) -> None:
    """Weights (..., K) for a scale search: a per-tensor global scale (given or dynamic) and, for
    "hessian", fp32 matrices (K/16, 16, 16) on x's device."""
    check_quantize_args(x, global_scale, False)
    check_weight_method(method, hessian)
    if hessian is not None:
        check_tensor("hessian", hessian, (torch.float32,))
        check_same_device("hessian", hessian, "x", x)
        expected = (x.shape[-1] // BLOCK_SIZE, BLOCK_SIZE, BLOCK_SIZE)
        if tuple(hessian.shape) != expected:
            raise ValueError(f"hessian must have shape {expected} (K/16 blocks of 16x16 for K = "
                             f"{x.shape[-1]}); got {tuple(hessian.shape)}")


KV_DTYPES = FLOAT_DTYPES


def check_kv_cache(name: str, cache) -> tuple[int, int, int, int]:
    """An NVFP4 KV cache (reference/kv_cache.py: uint8 (B, H, T, 9D/16 + 4), contiguous, T a
    multiple of its SLOT_MULTIPLE) -> (B, H, T, D)."""
    check_tensor(name, cache, (torch.uint8,))
    if cache.dim() != 4:
        raise ValueError(f"{name} must be an NVFP4 KV cache, uint8 (B, H, T, 9 D / 16 + 4); got shape "
                         f"{tuple(cache.shape)}")
    batch, heads, slots, row = cache.shape
    dim = kv_cache.head_dim_of(cache)
    if dim <= 0 or dim % BLOCK_SIZE or kv_cache.row_bytes(dim) != row:
        raise ValueError(f"{name}: rows of {row} bytes are no NVFP4 cache rows (9 D / 16 + 4 bytes, D a multiple "
                         f"of {BLOCK_SIZE})")
    if slots % kv_cache.SLOT_MULTIPLE:
        raise ValueError(f"{name}: T = {slots} slots must be a multiple of {kv_cache.SLOT_MULTIPLE} "
                         f"(reference.kv_cache.cache_shape rounds it up)")
    if not cache.is_contiguous():
        raise ValueError(f"{name} must be contiguous (its bytes are planes)")
    return batch, heads, slots, dim


def _check_kv_states(name: str, x, batch: int, heads: int, dim: int, what: str) -> None:
    check_tensor(name, x, KV_DTYPES)
    if x.dim() != 4:
        raise ValueError(f"{name} must be 4-D (B, H, S, D); got shape {tuple(x.shape)}")
    if x.shape[0] > batch:
        raise ValueError(f"{name} holds {x.shape[0]} sequences but the cache was allocated for {batch} "
                         f"(max_batch_size)")
    if x.shape[-1] != dim:
        raise ValueError(f"{name} has head_dim {x.shape[-1]}; the cache holds head_dim {dim}")
    if (what == "kv" and x.shape[1] != heads) or (what == "q" and (x.shape[1] == 0 or x.shape[1] % heads)):
        need = f"{heads}" if what == "kv" else f"a multiple of {heads}"
        raise ValueError(f"{name} has {x.shape[1]} heads; the cache has {heads} kv heads (need {need})")


def _check_kv_caches(k_cache, v_cache) -> tuple[int, int, int, int]:
    """Both caches checked and alike -> (batch, kv heads, slots, head dim)."""
    sizes = check_kv_cache("k_cache", k_cache)
    check_kv_cache("v_cache", v_cache)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    return sizes


def check_kv_write_args(key, value, k_cache, v_cache, positions) -> None:
    batch, heads, _, dim = _check_kv_caches(k_cache, v_cache)
    _check_kv_states("key", key, batch, heads, dim, "kv")
    _check_kv_states("value", value, batch, heads, dim, "kv")
    if value.shape != key.shape or value.dtype != key.dtype:
        raise ValueError(f"value {tuple(value.shape)} {value.dtype} must match key {tuple(key.shape)} {key.dtype}")
    check_tensor("positions", positions, (torch.int32, torch.int64))
    if positions.dim() != 1 or positions.shape[0] != key.shape[2]:
        raise ValueError(f"positions must be 1-D with one slot per token ({key.shape[2]}); got shape "
                         f"{tuple(positions.shape)}")
    for name, t in (("value", value), ("k_cache", k_cache), ("v_cache", v_cache), ("positions", positions)):
        check_same_device(name, t, "key", key)


def check_kv_attention_args(query, k_cache, v_cache, mask, scale) -> None:
    batch, heads, slots, dim = _check_kv_caches(k_cache, v_cache)
    _check_kv_states("query", query, batch, heads, dim, "q")
    if not isinstance(scale, float):
        raise TypeError(f"scale must be a float; got {scale!r}")
    if mask is not None:
        check_tensor("mask", mask, (torch.bool,))
        b, s = query.shape[0], query.shape[2]
        if mask.dim() != 4 or mask.shape[0] not in (1, b) or mask.shape[1] != 1 or mask.shape[2] not in (1, s) \
                or mask.shape[3] != slots:
            raise ValueError(f"mask must be bool ({b} or 1, 1, {s} or 1, {slots}) for query {tuple(query.shape)} and "
                             f"{slots} cache slots; got shape {tuple(mask.shape)}")
        check_same_device("mask", mask, "query", query)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_same_device(name, t, "query", query)
