"""Experiment: the register-fed decode GEMM with its K split inside the program (warps of one
program take contiguous K-chunks of the same rows, their sums reduced through shared memory by
Triton) instead of across programs (partials, a counter, the last split's sum). No split-K
round trips at all; the cost: fewer, larger programs. M <= 8, tiled weights.

    python benchmarks/probe_incta.py

Measured and not kept (benchmarks/NOTES.md, session 27; results/probe_incta_session27_h100.txt):
slower than the shipped split-K kernel on every shape (4096^2 10.1-16.8 us against 7.8).
"""

import math
import sys

import torch
import triton
import triton.language as tl
from bench_quantize import stream_us

import nvfp4_inductor as nv
from nvfp4_inductor.kernels import gemm_mma as gm
from nvfp4_inductor.kernels.gemm_splitk import gemm_splitk

ops = torch.ops.nvfp4


@triton.jit
def _incta_kernel(x_ptr, w_ptr, s_ptr, g_ptr, out_ptr, M, N, K, stride_xm,
                  RG: tl.constexpr, KW: tl.constexpr):
    """Program pid: weight rows [pid * 32 RG, + 32 RG) (RG 1: half a 64-row tile row), all of K;
    warp w: row group w % RG, K-chunk w // RG (T / KW tiles)."""
    pid = tl.program_id(0)
    BLOCK: tl.constexpr = 32 * RG * KW
    i = tl.arange(0, BLOCK)
    lane = i % 32
    warp = i // 32
    g = lane // 4
    q = lane % 4
    if RG == 1:
        tr = pid // 2
        row = (pid % 2) * 32 + g
    else:
        tr = pid
        row = (warp % RG) * 32 + g
    kc = warp // RG
    tiles = tl.cdiv(K, 64)
    chunk = tiles // KW
    first = tr * tiles + kc * chunk  # per lane: its chunk's first tile
    wp = w_ptr.to(tl.pointer_type(tl.uint32)) + row * 8 + 2 * q
    sp = s_ptr + row * 4 + q
    xw_ptr = x_ptr.to(tl.pointer_type(tl.uint32))
    kq = 16 * q
    x_rows = gm.lane_x_rows(g, kq, M, stride_xm, 1)
    zero = tl.zeros([BLOCK], tl.float32)
    c = (zero, zero, zero, zero, zero, zero, zero, zero)
    k0 = kc * chunk  # K-tile of the lane's chunk
    w = gm._load_weights(wp, sp, first)
    xs = gm._load_xs(xw_ptr, x_rows, k0 * 32, k0 < tiles, 1, True)
    for t in range(0, chunk):
        tn = tl.minimum(t + 1, chunk - 1)
        w1 = gm._load_weights(wp, sp, first + tn)
        xs1 = gm._load_xs(xw_ptr, x_rows, (k0 + tn) * 32, k0 < tiles, 1, True)
        c = gm._mma_tile(w, xs, c, 1)
        w, xs = w1, xs1
    acc = tl.reshape(gm._join8(c), (KW, RG, 8, 4, 2, 2, 2))  # (kc, u, g, q, b, r, blk)
    acc = tl.sum(acc, axis=0)
    acc = tl.reshape(tl.permute(acc, (0, 5, 4, 1, 2, 3)), (32 * RG, 8))  # n = 32u + 16blk + 8r + g, m = 2q + b
    n = pid * 32 * RG + tl.arange(0, 32 * RG)
    m = tl.arange(0, 8)
    y = acc * 128.0 * tl.load(g_ptr)
    tl.store(out_ptr + m[None, :] * N + n[:, None], y.to(tl.bfloat16), mask=(m < M)[None, :] & (n < N)[:, None])


def incta(x, w_tiled, s_tiled, g, n, rg, kw):
    m, k = x.shape
    out = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    _incta_kernel[(n // (32 * rg),)](x, w_tiled, s_tiled, g, out, m, n, k, x.stride(0), RG=rg, KW=kw,
                                     num_warps=rg * kw, num_stages=1)
    return out


SHAPES = [(4096, 4096), (4096, 6144), (14336, 4096), (4096, 28672)]  # (K, N)
CONFIGS = [(1, 8), (1, 16), (1, 32), (2, 4), (2, 8), (2, 16)]  # (RG, KW)


def main():
    sms = torch.cuda.get_device_properties().multi_processor_count
    l2 = torch.cuda.get_device_properties().L2_cache_size
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, {sms} SMs")
    for k, n in SHAPES:
        copies = max(2, math.ceil(3 * l2 / (n * k * 0.5625)))
        qs = [nv.quantize(torch.randn(n, k, dtype=torch.bfloat16, device="cuda")) for _ in range(copies)]
        ws = [(*ops.tile_weight(q.data, q.scale.view(torch.uint8)), q.global_scale) for q in qs]
        x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
        ref = gemm_splitk(x, ws[0][0], ws[0][1], ws[0][2], None, torch.float32, False, tiled_n=n, reg_mma=True)
        cells = []
        base = stream_us(lambda w: gemm_splitk(x, w[0], w[1], w[2], None, torch.bfloat16, False, tiled_n=n,
                                               reg_mma=True), ws)
        cells.append(f"shipped {base:6.1f}")
        for rg, kw in CONFIGS:
            if (k // 64) % kw or n % (32 * rg):
                continue
            y = incta(x, *ws[0], n, rg, kw)
            err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
            assert err < 1e-2, (k, n, rg, kw, err)
            us = stream_us(lambda w: incta(x, *w, n, rg, kw), ws)
            cells.append(f"{32 * rg}r x {kw}w ({n // (32 * rg)} progs) {us:6.1f}")
        print(f"K {k:5d} N {n:5d}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
