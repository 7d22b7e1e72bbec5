"""The grouped (mixture-of-experts) NVFP4 ops.

`nvfp4::grouped_linear_tiled` is the expert GEMM of an MoE layer: tokens sorted by expert,
`offsets` (E,) int32 the cumulative ends of the experts' groups (the `torch._grouped_mm`
convention: expert e owns rows [offsets[e - 1], offsets[e]), offsets[-1] read as 0; rows from
offsets[E - 1] on belong to no expert and come out zero), expert weights (E, N, K) in NVFP4 with
one global scale per expert (as ModelOpt's MoE exports carry them), their codes and scales laid
out by `tiled.tile_experts` (each expert in the dense GEMM's tiled layout, one after another):

    x (T, K) float, W tiled codes (E, N_pad * K_pad / 2) uint8, tiled e4m3 scale bits
    (E, N_pad * K_pad / 16) uint8, global scales (E,) fp32, bias (E, N) or None, N
    -> (T, N) in x.dtype

It computes exactly a loop of the dense reference linear, `reference.linear`, over each expert's
slice of x (W4A16: x rounded to bf16; W4A4: each expert's group of rows quantized with its own
per-tensor global scale, as the dense reference quantizes x). `nvfp4::grouped_linear_tiled_silu_mul`
is the gated form over each expert's N = 2I rows in Hugging Face's concatenated order (gate rows
[0, I), up rows [I, 2I)), tiled with the halves interleaved (`tile_experts(..., gated=True)`):
silu(gate) * up -> (T, I), each linear rounded to x.dtype first (reference.silu_mul), as
`nvfp4::linear_tiled_silu_mul` defines it.

On CUDA kernels/grouped.py runs them (its Triton kernel, or above the rows an expert its
mainloops serve, every expert dequantized, torch._grouped_mm and its epilogue kernel) without
reading the offsets back (no host sync: CUDA-graph safe); elsewhere the reference loop, which
checks the offsets' values.
"""

import torch
from torch import Tensor

from nvfp4_inductor import checks, reference
from nvfp4_inductor.format import BLOCK_SIZE
from nvfp4_inductor.kernels import plan
from nvfp4_inductor.ops import dense
from nvfp4_inductor.reference import tiled

__all__ = ["grouped_linear_tiled", "grouped_linear_tiled_silu_mul", "quantize_experts_tiled", "check_grouped_args",
           "grouped_cuda", "group_quantize", "group_quantized_values", "quantize_experts"]

_E4M3 = torch.float8_e4m3fn


def check_grouped_args(x, offsets, w_data, w_scale, w_global_scale, bias, n, activation, gated: bool) -> None:
    """Metadata checks (no values read: fake tensors, CUDA-graph capture) of the grouped ops."""
    if activation not in checks.ACTIVATIONS:
        raise ValueError(f"activation must be one of {checks.ACTIVATIONS}; got {activation!r}")
    checks.check_float_input("x", x)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (tokens sorted by expert, K); got shape {tuple(x.shape)}")
    checks.check_tensor("w_data", w_data, (torch.uint8,))
    checks.check_tensor("w_scale (e4m3 bits)", w_scale, (torch.uint8,))
    if w_data.dim() != 2 or w_data.shape[0] == 0:
        raise ValueError(f"w_data must be 2-D (E, tiled codes) with E > 0, as tiled.tile_experts makes it; "
                         f"got shape {tuple(w_data.shape)}")
    if n <= 0 or (gated and n % 2):
        raise ValueError(f"n (the logical rows an expert) must be positive{' and even (gate rows, then as many up rows)' if gated else ''}; got {n}")
    e, k = w_data.shape[0], x.shape[1]
    if k % BLOCK_SIZE:
        raise ValueError(f"x.shape[-1] = {k} must be a multiple of {BLOCK_SIZE}")
    (codes,), (scales,) = tiled.tiled_shapes(tiled.expert_rows(n, gated), k)
    if tuple(w_data.shape) != (e, codes) or tuple(w_scale.shape) != (e, scales):
        raise ValueError(f"tiled experts of {n} rows{' (gated)' if gated else ''} and K = {k} must have codes "
                         f"{(e, codes)} and scale bits {(e, scales)} (tiled.tile_experts); got "
                         f"{tuple(w_data.shape)} and {tuple(w_scale.shape)}")
    for name, t in (("w_data", w_data), ("w_scale", w_scale)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (packed NVFP4 layout)")
    checks.check_tensor("w_global_scale", w_global_scale, (torch.float32,))
    if tuple(w_global_scale.shape) != (e,):
        raise ValueError(f"w_global_scale must have shape ({e},) (one per expert); got "
                         f"{tuple(w_global_scale.shape)}")
    checks.check_tensor("offsets", offsets, (torch.int32,))
    if tuple(offsets.shape) != (e,):
        raise ValueError(f"offsets must have shape ({e},) (the cumulative end of each expert's rows, "
                         f"as torch._grouped_mm takes them); got {tuple(offsets.shape)}")
    if bias is not None:
        checks.check_tensor("bias", bias, checks.FLOAT_DTYPES)
        if tuple(bias.shape) != (e, n):
            raise ValueError(f"bias must have shape {(e, n)} (E, N); got {tuple(bias.shape)}")
    for name, t in (("offsets", offsets), ("w_data", w_data), ("w_scale", w_scale),
                    ("w_global_scale", w_global_scale), ("bias", bias)):
        if t is not None:
            checks.check_same_device(name, t, "x", x)


def _check_offset_values(offsets: Tensor, t: int) -> list[int]:
    """The reference's value check (it reads the offsets back anyway) -> the offsets as ints."""
    ends = offsets.tolist()
    previous = 0
    for e, end in enumerate(ends):
        if end < previous or end > t:
            raise ValueError(f"offsets must be non-decreasing cumulative row counts within [0, T = {t}]; "
                             f"got offsets[{e}] = {end} after {previous}")
        previous = end
    return ends


def _reference_grouped(x, offsets, w_data, w_scale, w_global_scale, bias, n, activation, gated) -> Tensor:
    """The loop of dense reference linears, one per expert's rows, on the experts' codes and scales
    in the logical row order; rows past the last group zero."""
    ends = _check_offset_values(offsets, x.shape[0])
    w_data, w_scale = tiled.untile_experts(w_data, w_scale, n, x.shape[1], gated)
    out = x.new_zeros((x.shape[0], n))
    start = 0
    for e, end in enumerate(ends):
        if end > start:
            out[start:end] = reference.linear(x[start:end], w_data[e], w_scale[e].view(_E4M3),
                                              w_global_scale[e], None if bias is None else bias[e],
                                              activation)
        start = end
    return out


def group_quantize(x: Tensor, offsets: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """W4A4's x on the device: each expert's rows quantized with its group's global scale (what
    reference.linear does to each slice) -> (codes (T, K/2), scale bits (T, K/16), (T,) fp32 each
    row's global scale). No host sync: the group of a row comes from searchsorted."""
    e = offsets.shape[0]
    rows = torch.arange(x.shape[0], dtype=torch.int32, device=x.device)
    group = torch.searchsorted(offsets, rows, right=True)  # E for rows past the last group
    row_amax = reference.finite_amax(x, per_row=True)
    row_amax = torch.where(group < e, row_amax, torch.zeros_like(row_amax))
    group_amax = row_amax.new_zeros(e + 1).scatter_reduce(0, group, row_amax, "amax")
    g_rows = reference.global_scale_from_amax(group_amax)[group]
    data, scale, _ = dense.quantize(x, g_rows, True, False)
    return data, scale, g_rows


def group_quantized_values(x: Tensor, offsets: Tensor) -> tuple[Tensor, Tensor]:
    """group_quantize, decoded without the global scale -> (bf16 values e2m1 * s_x, exact, (T,)
    fp32 each row's global scale)."""
    data, scale, g_rows = group_quantize(x, offsets)
    return dense.dequantize(data, scale, torch.ones_like(g_rows), False, torch.bfloat16), g_rows


def grouped_cuda(x, offsets, w_data, w_scale, w_global_scale, bias, n, activation, gated):
    """The grouped ops' CUDA path (kernels/grouped.py; on CPU tensors under the Triton interpreter):
    their arguments (gated: grouped_linear_tiled_silu_mul's) -> (T, n), gated (T, n/2), in x's
    dtype. W4A4 quantizes x per expert group first: its codes and scale bits on GPUs with the
    block-scaled MMA, its values elsewhere."""
    from nvfp4_inductor.kernels.grouped import grouped_linear as grouped_triton

    x_global_scale = x_scale = None
    out_dtype = x.dtype
    if activation == "nvfp4" and x.shape[0]:
        if plan.x_format(activation, x.device) == "nvfp4":  # sm_100: x's codes to the block-scaled MMA
            x, x_scale, x_global_scale = group_quantize(x, offsets)
        else:
            x, x_global_scale = group_quantized_values(x, offsets)
    return grouped_triton(x, offsets, w_data, w_scale, w_global_scale, bias, n, gated, x_global_scale,
                          out_dtype, x_scale=x_scale)


@torch.library.custom_op("nvfp4::grouped_linear_tiled", mutates_args=())
def grouped_linear_tiled(x: Tensor, offsets: Tensor, w_data: Tensor, w_scale: Tensor, w_global_scale: Tensor,
                         bias: Tensor | None, n: int, activation: str) -> Tensor:
    """x (T, K) sorted by expert, offsets (E,) int32 cumulative ends, W NVFP4 of n rows an expert
    tiled by tiled.tile_experts (codes (E, ...) + scale bits (E, ...)) + (E,) fp32, bias (E, n) or
    None -> (T, n) in x.dtype. activation: "bf16" (W4A16) or "nvfp4" (W4A4: each expert's rows
    quantized with one global scale of their own)."""
    check_grouped_args(x, offsets, w_data, w_scale, w_global_scale, bias, n, activation, False)
    return _reference_grouped(x, offsets, w_data, w_scale, w_global_scale, bias, n, activation, False)


@grouped_linear_tiled.register_fake
def _(x, offsets, w_data, w_scale, w_global_scale, bias, n, activation):
    check_grouped_args(x, offsets, w_data, w_scale, w_global_scale, bias, n, activation, False)
    return x.new_empty((x.shape[0], n))


@grouped_linear_tiled.register_kernel("cuda")
@dense.on_input_device
def _(x, offsets, w_data, w_scale, w_global_scale, bias, n, activation):
    check_grouped_args(x, offsets, w_data, w_scale, w_global_scale, bias, n, activation, False)
    return grouped_cuda(x, offsets, w_data, w_scale, w_global_scale, bias, n, activation, False)


@torch.library.custom_op("nvfp4::grouped_linear_tiled_silu_mul", mutates_args=())
def grouped_linear_tiled_silu_mul(x: Tensor, offsets: Tensor, w_data: Tensor, w_scale: Tensor,
                                  w_global_scale: Tensor, bias: Tensor | None, n: int, activation: str) -> Tensor:
    """grouped_linear_tiled over each expert's n = 2I rows (gate rows [0, I), up rows [I, 2I):
    Hugging Face's gate_up_proj), tiled with gated=True -> (T, I) silu(gate) * up in x.dtype, each
    linear rounded to x.dtype."""
    check_grouped_args(x, offsets, w_data, w_scale, w_global_scale, bias, n, activation, True)
    y = _reference_grouped(x, offsets, w_data, w_scale, w_global_scale, bias, n, activation, True)
    return reference.silu_mul(y[:, : n // 2], y[:, n // 2:])


@grouped_linear_tiled_silu_mul.register_fake
def _(x, offsets, w_data, w_scale, w_global_scale, bias, n, activation):
    check_grouped_args(x, offsets, w_data, w_scale, w_global_scale, bias, n, activation, True)
    return x.new_empty((x.shape[0], n // 2))


@grouped_linear_tiled_silu_mul.register_kernel("cuda")
@dense.on_input_device
def _(x, offsets, w_data, w_scale, w_global_scale, bias, n, activation):
    check_grouped_args(x, offsets, w_data, w_scale, w_global_scale, bias, n, activation, True)
    return grouped_cuda(x, offsets, w_data, w_scale, w_global_scale, bias, n, activation, True)


# --- the experts module ------------------------------------------------------------------------


def quantize_experts(w: Tensor, method: str) -> tuple[Tensor, Tensor, Tensor]:
    """(E, N, K) float expert weights -> (codes (E, N, K/2), e4m3 scales (E, N, K/16), (E,) fp32
    global scales), each expert quantized as one tensor (its own per-tensor global scale)."""
    parts = [dense.quantize(w[e], None, False, False) if method == "rtn" else
             dense.quantize_weight(w[e], None, method, None, False) for e in range(w.shape[0])]
    data, scale, g = (torch.stack(part) for part in zip(*parts))
    return data, scale.view(_E4M3), g


@torch.library.custom_op("nvfp4::quantize_experts_tiled", mutates_args=())
def quantize_experts_tiled(w: Tensor, method: str, gated: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(E, N, K) float expert weights -> (tiled codes (E, ...) uint8, tiled e4m3 scale bits (E, ...)
    uint8, (E,) fp32 global scales): NVFP4Experts.from_experts' quantization, laid out by
    tiled.tile_experts (gated: N = 2I gate-then-up rows, interleaved). What backend="nvfp4" folds
    at compile time for an unconverted model's experts (passes/experts.py)."""
    _check_expert_weights(w, gated)
    data, scale, g = quantize_experts(w.contiguous(), method)
    codes, scales = tiled.tile_experts(data, scale.view(torch.uint8), gated)
    return codes, scales, g


def _check_expert_weights(w: Tensor, gated: bool) -> None:
    """quantize_experts_tiled's shape check, in the op and its fake alike (a 2-D w would otherwise
    be quantized as E = N experts of one row each)."""
    if w.dim() != 3 or w.shape[0] == 0 or w.shape[-1] % BLOCK_SIZE or (gated and w.shape[1] % 2):
        raise ValueError(f"expert weights must be (E, N, K) with E > 0, K a multiple of {BLOCK_SIZE}"
                         f"{' and N even (gate rows, then up rows)' if gated else ''}; got {tuple(w.shape)}")


@quantize_experts_tiled.register_fake
def _(w, method, gated):
    _check_expert_weights(w, gated)
    e, n, k = w.shape
    (codes,), (scales,) = tiled.tiled_shapes(tiled.expert_rows(n, gated), k)
    return (w.new_empty((e, codes), dtype=torch.uint8), w.new_empty((e, scales), dtype=torch.uint8),
            w.new_empty((e,), dtype=torch.float32))
