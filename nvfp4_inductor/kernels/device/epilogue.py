"""The GEMM epilogues: global scales and bias (`epilogue`), the split-K handshake and sum
(`last_split`, `sum_splits`), the gated MLP's silu(gate) * up, a deferred RMSNorm's row factor."""

import triton
import triton.language as tl

from nvfp4_inductor.kernels.device.common import round_to


@triton.jit
def epilogue(acc, ms, cols_n, M, N, w_global_scale_ptr, bias_ptr, out_ptr, stride_om,
              W_GLOBAL_SCALE_PER_ROW: tl.constexpr, HAS_BIAS: tl.constexpr, UNSCALE: tl.constexpr):
    """acc (BLOCK_N, BLOCK_M) fp32 sums of e2m1 * s * 2^-7 * x (x decoded from NVFP4: one more
    2^-7) -> out[m, n] = acc * UNSCALE * g + bias, UNSCALE = 2^7 (2^14)."""
    n_ok = cols_n < N
    if W_GLOBAL_SCALE_PER_ROW:
        g = tl.load(w_global_scale_ptr + cols_n, mask=n_ok, other=0.0)[:, None]
    else:
        g = tl.load(w_global_scale_ptr)
    y = acc * UNSCALE * g
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + cols_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    mask = n_ok[:, None] & (ms < M)[None, :]
    tl.store(out_ptr + ms.to(tl.int64)[None, :] * stride_om + cols_n[:, None],
             y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def last_split(counter_ptr, num_splits):
    """Called by each of an output tile's num_splits programs once its partials are stored: True in
    the last to arrive, which resets the tile's counter (zero again for the next launch) and may
    then read every split's partials. The barrier puts all the program's stores before its
    release; the acquire puts the other programs' stores before the last one's reads."""
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    last = arrived == num_splits - 1
    tl.store(counter_ptr, 0, mask=last)
    return last


@triton.jit
def silu_mul_halves(acc, g, OUT_DTYPE: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    """(BLOCK_N, ROWS) fp32 products of weight rows interleaved by 32 (gate rows, the same up rows,
    ...: tiled.interleave_halves) and their global scales (BLOCK_N,) -> (BLOCK_N / 2, ROWS) fp32
    silu(gate) * up as eager torch computes a gated MLP: each linear rounded to OUT_DTYPE, silu in
    fp32 rounded to it, the product (rounded by the caller's store)."""
    y = round_to(acc * g[:, None], OUT_DTYPE)
    y = tl.permute(tl.reshape(y, (BLOCK_N // 64, 2, 32, ROWS)), (0, 2, 3, 1))
    gate, up = tl.split(y)
    gate = tl.reshape(gate, (BLOCK_N // 2, ROWS))
    up = tl.reshape(up, (BLOCK_N // 2, ROWS))
    return round_to(gate / (1.0 + tl.exp(-gate)), OUT_DTYPE) * up


@triton.jit
def sum_splits(partial_ptr, num_splits, M, N, cols_n, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
               SPLITS: tl.constexpr):
    """(BLOCK_N, ROWS) fp32 = the sum over the splits of partials (num_splits, M, N) at columns
    cols_n, rows >= M zero, in split order. SPLITS partials a round, one memory round trip for up to
    SPLITS splits (gemm_configs.split_sum_tile); read through L2 (.cg: another SM wrote them). Each
    partial is loaded in acc's layout: a (SPLITS, BLOCK_N, ROWS) load summed over its first axis
    took shuffles across lanes."""
    ms = tl.arange(0, ROWS)
    mask = (cols_n < N)[:, None] & (ms < M)[None, :]
    tile = partial_ptr + ms[None, :].to(tl.int64) * N + cols_n[:, None]
    split_stride = tl.cast(M, tl.int64) * N
    acc = tl.zeros((BLOCK_N, ROWS), tl.float32)
    for s0 in range(0, num_splits, SPLITS):
        # SPLITS loads in acc's own layout, issued together: no sum across threads
        for j in tl.static_range(SPLITS):
            acc += tl.load(tile + (s0 + j) * split_stride, mask=mask & (s0 + j < num_splits), other=0.0,
                           cache_modifier=".cg")
    return acc


@triton.jit
def load_rows(h_ptr, rows, stride_hm, K, ROWS: tl.constexpr, SPAN: tl.constexpr):
    """fp32 (ROWS, SPAN): h's first `rows` rows whole (SPAN >= K; row stride stride_hm, unit
    column stride), zeros past them: one load, whose use the caller puts after its other loads
    (a deferred RMSNorm's input, nvfp4.linear_tiled's norm_h, in the template's last split)."""
    ms = tl.arange(0, ROWS)
    ks = tl.arange(0, SPAN)
    return tl.load(h_ptr + ms[:, None].to(tl.int64) * stride_hm + ks[None, :],
                   mask=(ms < rows)[:, None] & (ks < K)[None, :], other=0.0).to(tl.float32)


@triton.jit
def rms_factor(h_rows, K, eps):
    """(ROWS,) fp32 rsqrt(mean(h^2) + eps) of load_rows' rows of K columns (reference.rms_scale)."""
    return tl.math.rsqrt(tl.sum(h_rows * h_rows, axis=1) / K + eps)


@triton.jit
def split_tiles(pid_k, tiles_per_split, tiles):
    """The K-tiles [begin, end) of split pid_k: tiles_per_split each, the last split the rest."""
    tile_begin = pid_k * tiles_per_split
    return tile_begin, tl.minimum(tile_begin + tiles_per_split, tiles)

