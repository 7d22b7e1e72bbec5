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
    python benchmarks/probe_mma_bounds.py onewarp16  # programs of one warp on half a 64-row tile (32
        weight rows), about 16 an SM (as many warps as the shipped 8 programs of 2 at M = 16): twice
        the output tiles, half the splits; the warp's work per K-tile unchanged: correct, checked

Eager tiled W4A16 (gemm_splitk), CUDA-graph times over weight copies beyond L2; base, paired, red
and onewarpP are checked against float64 first."""
import sys

import torch
import triton
import triton.language as tl
import bench_gemm
from bench_gemm import time_tiled_w4a16

from nvfp4_inductor.kernels import gemm_configs, gemm_mma, gemm_splitk

VARIANT = sys.argv[1:] or ["base"]
CHECKED = VARIANT in (["base"], ["paired"], ["red"]) or VARIANT[0].startswith("onewarp")

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
    """signal: a value in place of the sum (num_splits everywhere), no partial loaded."""
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


@triton.jit
def _sums_half_tile(c, NB: tl.constexpr):
    """gemm_mma.sums_tile for one warp: (32, 8 * max(NB, 2)) fp32 of its 32 weight rows."""
    zero = tl.zeros_like(c[0])
    if NB == 1:
        c = c + (zero, zero, zero, zero, zero, zero, zero, zero)
    acc = tl.join(gemm_mma._join8(c[0:8]), gemm_mma._join8(c[8:16]))
    acc = tl.reshape(acc, (8, 4, 2, 2, 2, 2))  # (g, q, b, r, blk, h)
    return tl.reshape(tl.permute(acc, (4, 3, 0, 5, 1, 2)), (32, 16))


@triton.jit
def _mma_mainloop_half_tile(x_ptr, w_ptr, w_scale_ptr, M, K, stride_xm, pid_n, tile_begin, tile_end,
                            NB: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr = 0, N=0,
                            scale_cols=0, LAYOUT: tl.constexpr = 0):
    """gemm_mma.mma_mainloop (tiled weights) run by one warp on half a tile: pid_n counts 32-row
    halves, tile pid_n // 2, rows 32 * (pid_n % 2) ...; the lanes and their loads are those of the
    shipped kernel's warp pid_n % 2."""
    lane = tl.arange(0, 32)
    g = lane // 4
    q = lane % 4
    half = pid_n % 2
    row = half * 32 + g
    tiles_k = tl.cdiv(K, 64)
    xw_ptr = x_ptr.to(tl.pointer_type(tl.uint32))
    kq = gemm_mma.lane_k(q, 0)
    wp = w_ptr.to(tl.pointer_type(tl.uint32)) + row * 8 + 2 * q
    sp = w_scale_ptr.to(tl.pointer_type(tl.uint32)) + half * 32 + lane
    x_rows = gemm_mma.lane_x_rows(g, kq, M, stride_xm, NB)
    zero = tl.zeros([32], tl.float32)
    c = (zero, zero, zero, zero, zero, zero, zero, zero) * NB
    sw = (zero.to(tl.uint32),) * 12
    first = (pid_n // 2) * tiles_k
    if PDL == 1:
        tl.extra.cuda.gdc_wait()
    _, xw, k = gemm_mma._tile_offsets(tile_begin, 0)
    w, sw = gemm_mma._load_w(wp, sp, sw, first, tile_begin, k + kq < K, 0, EVEN_K)
    xs = gemm_mma._load_xs(xw_ptr, x_rows, xw, k + kq < K, NB, EVEN_K)
    if NB == 1:
        for t in tl.range(tile_begin, tile_end, loop_unroll_factor=2):
            w, xs, sw, c = gemm_mma._step(w, xs, sw, c, wp, sp, xw_ptr, first, t, tile_end, x_rows, kq, K,
                                          0, NB, EVEN_K)
    else:
        for t in range(tile_begin, tile_end):
            w, xs, sw, c = gemm_mma._step(w, xs, sw, c, wp, sp, xw_ptr, first, t, tile_end, x_rows, kq, K,
                                          0, NB, EVEN_K)
    return _sums_half_tile(c, NB)


def _one_warp_launch(per_sm):
    """A gemm_splitk stand-in for tiled W4A16 (bias-free) that launches _splitk_kernel on one-warp
    programs of 32 rows (_mma_mainloop_half_tile), about per_sm of them an SM, the shipped minimum
    K-steps a split."""
    def launch(x, w_data, w_scale, w_g, bias, out_dtype, swizzled, tiled_n=None):
        assert bias is None and not swizzled and tiled_n is not None
        m, k = x.shape
        n = tiled_n
        nb = gemm_configs.reg_mma_blocks(m)
        assert m <= 16 and n % 64 == 0
        out = torch.empty((m, n), dtype=out_dtype, device=x.device)
        tiles_n = n // 32
        _, _, _, splits, _, _ = gemm_configs._skinny_config(  # the shipped rule, on 32-row tiles
            m, n, k, gemm_configs.sm_count(x.device), 32, 64, per_sm, 1, 1,
            gemm_configs.REG_MMA_MIN_STEPS[m > 8])
        splits, tiles_per_split = gemm_configs.split_ranges(k, 64, splits)
        if splits > 1:
            partial = torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
            counters = gemm_splitk.split_counters(x.device, tiles_n)
        else:
            partial = counters = out
        sum_rows, sum_splits = gemm_configs.split_sum_tile(m, splits, 32, 1)
        gemm_splitk._splitk_kernel[(tiles_n, splits)](
            x, x, w_data, w_scale, w_g, w_g, out, partial, counters, m, n, k, k // 16, tiles_per_split,
            x.stride(0), out.stride(0),
            SWIZZLED=False, W_G_PER_ROW=w_g.dim() > 0, HAS_BIAS=False, SPLIT=splits > 1, USE_ASM=True,
            OPERAND=tl.bfloat16, EVEN=k % 64 == 0, TILED=True, DOT_SCALED=False, REG_MMA=nb,
            UNSCALE=2.0**7, GROUPED=False, BLOCK_M=8 * max(2, nb), BLOCK_N=32, BLOCK_K=64,
            SUM_ROWS=sum_rows, SUM_SPLITS=sum_splits, PDL=True, launch_pdl=True, num_warps=1,
            num_stages=1)
        return out
    return launch


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
if VARIANT[0].startswith("onewarp"):
    gemm_splitk.mma_mainloop = _mma_mainloop_half_tile
    bench_gemm.gemm_splitk = _one_warp_launch(int(VARIANT[0][len("onewarp"):]))
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
