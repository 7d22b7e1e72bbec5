"""The register-fed decode GEMM (kernels/gemm_mma.py) at M = 1 and 16 with parts of its per-weight
work changed (session 34). Each variant runs in its own process: the JIT picks up a replaced
function at its first compile.

    python benchmarks/probe_mma_bounds.py base
    python benchmarks/probe_mma_bounds.py paired     # x stored in mma pair order (each 8 values as
        0, 4, 1, 5, 2, 6, 3, 7) and _x_pairs' byte permutes dropped: correct, checked
    python benchmarks/probe_mma_bounds.py mmaorder   # the decode of session 6's MMA code order
        (tiled.to_mma_order at 24c0bc2: 11 instructions a word against 16, pairs of consecutive k,
        so x's words go to the mma as loaded) on natural-order codes: its instruction count, wrong
        outputs
    python benchmarks/probe_mma_bounds.py nodecode   # bound: _decode_pairs returns the code word
    python benchmarks/probe_mma_bounds.py noscale    # bound: _scales returns the scale bytes
    python benchmarks/probe_mma_bounds.py nodecode noscale
    python benchmarks/probe_mma_bounds.py nosum      # bound: split 0 runs the epilogue at once, on
        zeros (no barrier, counter atomic or partial loads); every split still stores its partials
    python benchmarks/probe_mma_bounds.py nodecode nosum
    python benchmarks/probe_mma_bounds.py signal     # bound: the split sum's loads dropped (the last
        split sums zeros), the partial stores and the counter kept
    python benchmarks/probe_mma_bounds.py red        # each split adds its partials into one zeroed fp32
        (M, N) tile with relaxed fp32 atomics (sum order not fixed); the last split reads the tile
        once, zeroes it and runs the epilogue: correct, checked

Eager tiled W4A16 (gemm_splitk), CUDA-graph times over weight copies beyond L2; base and paired
are checked against float64 first."""
import sys

import torch
import triton
import triton.language as tl
from bench_gemm import time_tiled_w4a16

from nvfp4_inductor.kernels import gemm_mma, gemm_splitk

VARIANT = sys.argv[1:] or ["base"]
CHECKED = VARIANT in (["base"], ["paired"], ["red"])

_MMA_ORDER_ASM: tl.constexpr = tl.constexpr("""
{
.reg .b32 m, s;
and.b32 m, $4, 0x81C081C0; mul.rn.bf16x2 $0, m, $5;
shl.b32 m, $4, 6; and.b32 m, m, 0x81C081C0; mul.rn.bf16x2 $1, m, $5;
shl.b32 m, $4, 3; and.b32 m, m, 0x01C001C0; shl.b32 s, $4, 5; and.b32 s, s, 0x80008000;
or.b32 m, m, s; mul.rn.bf16x2 $2, m, $5;
shr.b32 m, $4, 5; and.b32 m, m, 0x01C001C0; shl.b32 s, $4, 1; and.b32 s, s, 0x80008000;
or.b32 m, m, s; mul.rn.bf16x2 $3, m, $5;
}
""")


@triton.jit
def _x_words(x):
    return x


@triton.jit
def _no_decode(word, scale):
    return word, word, word, word


@triton.jit
def _no_scales(s_pair):
    return s_pair, s_pair


@triton.jit
def _first_split(counter_ptr, num_splits):
    return tl.program_id(1) == 0


@triton.jit
def _no_sum(partial_ptr, num_splits, M, N, cols_n, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
            SPLITS: tl.constexpr):
    return tl.zeros((BLOCK_N, ROWS), tl.float32)


@triton.jit
def _no_sum_loads(partial_ptr, num_splits, M, N, cols_n, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
                  SPLITS: tl.constexpr):
    return tl.zeros((BLOCK_N, ROWS), tl.float32) + num_splits


@triton.jit
def _red_kernel(
    x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, w_g_ptr, bias_ptr, out_ptr, partial_ptr, counter_ptr,
    M, N, K, w_scale_cols, tiles_per_split, stride_xm, stride_om,
    SWIZZLED: tl.constexpr, W_G_PER_ROW: tl.constexpr, HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr, USE_ASM: tl.constexpr, OPERAND: tl.constexpr, EVEN: tl.constexpr,
    TILED: tl.constexpr, DOT_SCALED: tl.constexpr, REG_MMA: tl.constexpr, UNSCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SUM_ROWS: tl.constexpr, SUM_SPLITS: tl.constexpr, GROUPED: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """gemm_splitk._splitk_kernel for tiled weights and the register-fed mainloop, its split sum
    replaced: partials added with relaxed fp32 atomics into partial_ptr's first (M, N), zero at
    launch and zeroed again by the last split after it reads them."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    tile_begin, tile_end = gemm_splitk.split_tiles(pid_k, tiles_per_split, tl.cdiv(K, BLOCK_K))
    acc = gemm_mma.mma_mainloop(x_ptr, w_ptr, w_scale_ptr, M, K, stride_xm, pid_n, tile_begin, tile_end,
                                REG_MMA, EVEN, 1 if PDL else 0, N, w_scale_cols, 0)
    ms = tl.arange(0, BLOCK_M)
    cols_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (cols_n < N)[:, None] & (ms < M)[None, :]
    tile = partial_ptr + ms[None, :].to(tl.int64) * N + cols_n[:, None]
    if SPLIT:
        tl.atomic_add(tile, acc, mask=mask, sem="relaxed", scope="gpu")
        if gemm_splitk.last_split(counter_ptr + pid_n, tl.num_programs(1)):
            total = tl.load(tile, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(tile, tl.zeros_like(total), mask=mask)
            gemm_splitk._epilogue(total, ms, cols_n, M, N, w_g_ptr, bias_ptr, out_ptr, stride_om,
                                  W_G_PER_ROW, HAS_BIAS, UNSCALE)
    else:
        gemm_splitk._epilogue(acc, ms, cols_n, M, N, w_g_ptr, bias_ptr, out_ptr, stride_om, W_G_PER_ROW,
                              HAS_BIAS, UNSCALE)


class _ZeroedPartials:
    """gemm_splitk's `torch`, its fp32 partials (splits, M, N) one zeroed buffer per shape, made at
    the first call (before any capture): the red kernel leaves it zeroed."""
    buffers: dict = {}

    def __getattr__(self, name):
        return getattr(torch, name)

    def empty(self, shape, dtype=None, device=None):
        if dtype == torch.float32 and len(shape) == 3:
            key = (tuple(shape), str(device))
            if key not in self.buffers:
                self.buffers[key] = torch.zeros(shape, dtype=dtype, device=device)
            return self.buffers[key]
        return torch.empty(shape, dtype=dtype, device=device)


if "paired" in VARIANT or "mmaorder" in VARIANT:
    gemm_mma._x_pairs = _x_words
if "mmaorder" in VARIANT:  # gemm_mma._decode_pairs with this asm (the same operands and outputs)
    gemm_mma._DECODE_PAIRS_ASM = _MMA_ORDER_ASM
if "nodecode" in VARIANT:
    gemm_mma._decode_pairs = _no_decode
if "noscale" in VARIANT:
    gemm_mma._scales = _no_scales
if "signal" in VARIANT:
    gemm_splitk.sum_splits = _no_sum_loads
if "red" in VARIANT:
    gemm_splitk._splitk_kernel = _red_kernel
    gemm_splitk.torch = _ZeroedPartials()
if "nosum" in VARIANT:
    gemm_splitk.last_split = _first_split
    gemm_splitk.sum_splits = _no_sum


def x_as_read(x):
    """paired: x (M, K) with each 8 consecutive values in the order (0, 4, 1, 5, 2, 6, 3, 7)."""
    if "paired" not in VARIANT:
        return x
    m, k = x.shape
    return x.view(m, k // 8, 2, 4).transpose(-1, -2).reshape(m, k).contiguous()


def main():
    time_tiled_w4a16("+".join(VARIANT), CHECKED, x_as_read)


if __name__ == "__main__":
    main()
