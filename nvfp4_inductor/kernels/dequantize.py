"""NVFP4 dequantize, full and row-gathered (selective).

    out[i, k] = e2m1(code[src(i), k]) * float(scale[src(i), k // 16]) * g[src(i) or 0]

src(i) = i for the full dequantize; src(i) = indices[i] for `dequantize_rows`, which reads only
the selected rows of data and scales (the use: attention over an NVFP4 KV cache that touches a
few rows). An index outside [0, rows) yields a NaN row: the eager op checks the indices first,
so that happens only where no check can run (inside a CUDA-graph capture).
Scales are read plain, (rows, K/16), or from the swizzled 128x4-tile layout.

A tiled weight (nvfp4_inductor.reference.tiled) wanted as bf16 e2m1 * block scale, without g (what the
dequantize + cuBLAS paths multiply), takes `_tiles_bf16_kernel` instead: one 64 x 64 tile a
program, decoded by the skinny GEMM's word decode (device/mainloops.decode_tile, ~3 instructions a
weight instead of ~10 for the fp32 decode above).
"""

import torch
import triton
import triton.language as tl

from nvfp4_inductor.format import BLOCK_SIZE
from nvfp4_inductor.kernels.device.common import (
    BLOCK, e2m1_decode, e4m3_bits_to_f32, scale_offsets, store_pairs, tiled_scale_offset,
)
from nvfp4_inductor.kernels.device.mainloops import decode_tile
from nvfp4_inductor.reference.tiled import TILE_K, TILE_N

TILE_N_: tl.constexpr = tl.constexpr(TILE_N)
TILE_K_: tl.constexpr = tl.constexpr(TILE_K)

BLOCK_M = 16
BLOCK_K = 256
NUM_WARPS = 4


@triton.jit
def _tiled_offset(row, col, K, PER: tl.constexpr):
    """Row and column of the (N, K / PER) codes (PER 2) or scales (PER 16) -> tiled offset."""
    tiles_k = tl.cdiv(K, TILE_K_)
    tile = (row // TILE_N_) * tiles_k + col // (TILE_K_ // PER)
    if PER == 2:
        return (tile * TILE_N_ + row % TILE_N_) * (TILE_K_ // PER) + col % (TILE_K_ // PER)
    return tile * (TILE_N_ * TILE_K_ // PER) + tiled_scale_offset(row % TILE_N_, col % (TILE_K_ // PER))


@triton.jit
def _dequantize_kernel(
    # pointers
    data_ptr, scale_ptr, g_ptr, index_ptr, out_ptr,
    # sizes
    M, K, src_rows, scale_cols_pad,
    # meta-parameters
    PER_ROW: tl.constexpr, HAS_G: tl.constexpr, SWIZZLE: tl.constexpr, GATHER: tl.constexpr,
    TILED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    if GATHER:
        src = tl.load(index_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        valid = (src >= 0) & (src < src_rows)
        src = tl.where(valid, src, 0)
    else:
        src = rows.to(tl.int64)
        valid = row_ok
    load_ok = row_ok & valid

    # Work on byte columns: the low nibble is the even element, the high one the odd element;
    # both stay (BLOCK_M, BLOCK_K / 2) tensors and are stored back as one word per pair.
    pair_cols = tl.program_id(1) * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    pair_mask = row_ok[:, None] & (pair_cols < K // 2)[None, :]
    block_cols = tl.program_id(1) * (BLOCK_K // BLOCK) + tl.arange(0, BLOCK_K // BLOCK)
    block_mask = load_ok[:, None] & (block_cols < K // BLOCK)[None, :]
    if TILED:  # nvfp4_inductor.reference.tiled's layout (its docstring has the index formulas)
        data_offsets = _tiled_offset(src[:, None], pair_cols[None, :], K, 2)
        offsets = _tiled_offset(src[:, None], block_cols[None, :], K, BLOCK)
    else:
        data_offsets = src[:, None] * (K // 2) + pair_cols[None, :]
        offsets = scale_offsets(src[:, None], block_cols[None, :], K, scale_cols_pad, SWIZZLE)
    packed = tl.load(data_ptr + data_offsets, mask=load_ok[:, None] & (pair_cols < K // 2)[None, :],
                     other=0).to(tl.int32)
    scale_bits = tl.load(scale_ptr + offsets, mask=block_mask, other=0).to(tl.int32)
    scale = e4m3_bits_to_f32(scale_bits)[:, :, None]
    if not HAS_G:  # e2m1 * block scale only (exact in bf16 / fp16), for callers that apply g later
        g = 1.0
    elif PER_ROW:
        g = tl.load(g_ptr + src, mask=load_ok, other=1.0)[:, None, None]
    else:
        g = tl.load(g_ptr)

    even = tl.reshape(e2m1_decode(packed & 0xF), (BLOCK_M, BLOCK_K // BLOCK, BLOCK // 2))
    odd = tl.reshape(e2m1_decode(packed >> 4), (BLOCK_M, BLOCK_K // BLOCK, BLOCK // 2))
    even = (even * scale) * g
    odd = (odd * scale) * g
    even = tl.reshape(even, (BLOCK_M, BLOCK_K // 2))
    odd = tl.reshape(odd, (BLOCK_M, BLOCK_K // 2))
    if GATHER:
        even = tl.where(valid[:, None], even, float("nan"))
        odd = tl.where(valid[:, None], odd, float("nan"))
    store_pairs(out_ptr, rows.to(tl.int64)[:, None] * (K // 2) + pair_cols[None, :], even, odd, pair_mask)


@triton.jit
def _tiles_bf16_kernel(data_ptr, scale_ptr, out_ptr, N, K, USE_ASM: tl.constexpr, OPERAND: tl.constexpr):
    """Program (tn, tk): tile (tn, tk) of the tiled layout -> out[tn * 64 + r, tk * 64 + c] bf16,
    e2m1 * block scale (the decode's e2m1 * s * 2^-7 times 2^7: exact)."""
    tn = tl.program_id(0)
    tk = tl.program_id(1)
    tile = tn.to(tl.int64) * tl.cdiv(K, TILE_K_) + tk
    packed = tl.load(data_ptr + tile * (TILE_N_ * TILE_K_ // 2) + tl.arange(0, TILE_N_ * TILE_K_ // 2))
    s_bits = tl.load(scale_ptr + tile * (TILE_N_ * TILE_K_ // BLOCK)
                     + tiled_scale_offset(tl.arange(0, TILE_N_)[:, None],
                                          tl.arange(0, TILE_K_ // BLOCK)[None, :]))
    w = decode_tile(tl.reshape(packed, (TILE_N_, TILE_K_ // BLOCK, BLOCK // 2)), s_bits, USE_ASM, OPERAND,
                    TILE_N_, TILE_K_)
    rows = tn * TILE_N_ + tl.arange(0, TILE_N_)
    cols = tk * TILE_K_ + tl.arange(0, TILE_K_)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], (w * 128.0).to(tl.bfloat16),
             mask=(rows < N)[:, None] & (cols < K)[None, :])


def dequantize(data, scale, global_scale, swizzled: bool, dtype, indices=None, tiled_nk=None):
    """NVFP4 parts (checked by the op) -> (..., K) of dtype; with indices (any shape), only the
    rows of the 2-D data named by them, as indices.shape + (K,). global_scale None: leave it out
    (e2m1 * block scale only). tiled_nk = (N, K): data and scale are nvfp4_inductor.reference.tiled's 1-D
    layout of an (N, K) weight."""
    if global_scale is not None:  # per row: read as a contiguous list of the rows' scales
        global_scale = global_scale.contiguous()
    if tiled_nk is not None and global_scale is None and dtype == torch.bfloat16 and indices is None:
        n, k = tiled_nk
        out = torch.empty((n, k), dtype=dtype, device=data.device)
        if n and k:
            use_asm = data.is_cuda  # inline PTX; the interpreter decodes in fp16 (exact here too)
            _tiles_bf16_kernel[(triton.cdiv(n, TILE_N), triton.cdiv(k, TILE_K))](
                data, scale, out, n, k, USE_ASM=use_asm, OPERAND=tl.bfloat16 if use_asm else tl.float16,
                num_warps=4)
        return out
    if tiled_nk is not None:
        n, k = tiled_nk
        data2 = data.view(1, -1)
        src_rows = n
    else:
        k = data.shape[-1] * 2
        data2 = data.reshape(-1, k // 2)
        src_rows = data2.shape[0]
    if indices is None:
        out_lead, index = (data.shape[:-1] if tiled_nk is None else (n,)), data2  # index: unused
        m = src_rows
    else:
        # (contiguous: the kernel reads the indices as a packed list; a strided view such as a
        # block table's column would gather other rows)
        out_lead, index = indices.shape, indices.reshape(-1).contiguous()
        m = index.numel()
    out = torch.empty((*out_lead, k), dtype=dtype, device=data.device)
    if m == 0:
        return out
    scale_cols_pad = scale.shape[1] if swizzled else k // BLOCK_SIZE
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(k, BLOCK_K))
    _dequantize_kernel[grid](
        data2, scale, data2 if global_scale is None else global_scale, index, out,
        m, k, src_rows, scale_cols_pad,
        PER_ROW=global_scale is not None and global_scale.dim() > 0,
        HAS_G=global_scale is not None, SWIZZLE=swizzled, GATHER=indices is not None,
        TILED=tiled_nk is not None, BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS,
    )
    return out
