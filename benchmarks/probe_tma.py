"""Run once (session 8, H100, results/probe_tma_h100.txt): bit-exact, and 4-13x SLOWER than
linear_tiled at every stage count, cp.async and TMA alike (4096 x 14336, M = 1: 197-241 us vs
17.9); not pursued. The register-fed decode GEMM (kernels/gemm_mma.py) with its weight stream pipelined by
Triton, through TMA or cp.async, instead of a hand prefetch one tile ahead.

Why: at M <= 8 the register-fed kernel streams the mid-size weights at ~2 TB/s of ~3 (H100). Its
loop prefetches one tile ahead by hand (values carried to the next iteration), and in that form
Triton pipelines none of its loads at any num_stages. Written as a plain loop over
`tl.range(..., num_stages=S)`, compiled for sm_90 (Triton 3.6):
- cp.async variant (gemm_mma's own per-lane loads): 4 of the 6 loads a tile go through cp.async
  into S shared-memory stages (the two 1-byte scale loads stay plain), 40 registers at S = 3;
- TMA variant (tensor descriptors): codes and scales by TMA into S stages (12.8 KB a program at
  S = 3), each lane's words read back with ld.shared in the mainloop's own per-lane layout (no
  convert_layout in the loop), x's words by cp.async, 40 registers.

Codes: the tiled layout viewed as (tiles * 64, 8) int32 words, a (64, 8) block a tile; scales: the
tile's 256 bytes as a (16, 16) uint8 block (TMA's inner box must be at least 16 bytes). The lane
mapping is gemm_mma's: lane (u, g, q) takes words 2q, 2q + 1 of rows 16u + g and 16u + g + 8, and
their two scale bytes; the split sum and epilogue are gemm_splitk's.

    python benchmarks/probe_tma.py
First checks every shape against nvfp4::linear_tiled (the same MMAs in the same order: it must be
bit-identical), then times each variant (CUDA-graph replays over weights larger than L2) for
S = 2, 3, 4, 6 stages, linear_tiled alongside.
"""

import math

import torch
import triton
import triton.language as tl
from bench_quantize import stream_us
from triton.tools.tensor_descriptor import TensorDescriptor

import nvfp4_inductor as nv
from nvfp4_inductor.kernels import gemm_configs
from nvfp4_inductor.kernels import gemm_mma as gm
from nvfp4_inductor.kernels import gemm_splitk as sk

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672), (4096, 28672)]  # (K, N)
STAGES = [2, 3, 4, 6]
ops = torch.ops.nvfp4


@triton.jit
def _finish(c, pid_n, pid_k, M, N, w_g_ptr, out_ptr, partial_ptr, counter_ptr, stride_om,
            SUM_ROWS: tl.constexpr, SUM_SPLITS: tl.constexpr):
    """gemm_mma.mma_mainloop's accumulator layout -> gemm_splitk's split store, sum and epilogue
    (per-tensor g, no bias): lane (u, g, q)'s c[a * 2 + b + 4 * h] is out[16u + 8a + g, 8h + 2q + b]."""
    acc = tl.join(tl.join(tl.join(c[0], c[1]), tl.join(c[2], c[3])),
                  tl.join(tl.join(c[4], c[5]), tl.join(c[6], c[7])))
    acc = tl.reshape(tl.permute(tl.reshape(acc, (4, 8, 4, 2, 2, 2)), (0, 4, 1, 5, 2, 3)), (64, 16))
    ms = tl.arange(0, 16)
    cols_n = pid_n * 64 + tl.arange(0, 64)
    tl.store(partial_ptr + (pid_k * M + ms)[None, :].to(tl.int64) * N + cols_n[:, None], acc,
             mask=(cols_n < N)[:, None] & (ms < M)[None, :])
    num_splits = tl.num_programs(1)
    if sk.last_split(counter_ptr + pid_n, num_splits):
        total = sk.sum_splits(partial_ptr, num_splits, M, N, cols_n, 64, SUM_ROWS, SUM_SPLITS)
        sk._epilogue(total, tl.arange(0, SUM_ROWS), cols_n, M, N, w_g_ptr, w_g_ptr, out_ptr, stride_om,
                     False, False, 2.0**7)


@triton.jit
def _probe_kernel(w_src, s_src, x_ptr, w_g_ptr, out_ptr, partial_ptr, counter_ptr,
                  M, N, K, tiles_per_split, stride_xm, stride_om,
                  TMA: tl.constexpr, NUM_STAGES: tl.constexpr, SUM_ROWS: tl.constexpr,
                  SUM_SPLITS: tl.constexpr):
    """gemm_splitk._splitk_kernel with REG_MMA = 1 (x rows <= 8), K % 64 == 0, no bias, tiled W,
    the loop a tl.range(num_stages), no hand prefetch. TMA: w_src, s_src are tensor descriptors of
    the codes and scales; else their pointers, read by gemm_mma's own per-lane loads (Triton then
    pipelines the code and x words through cp.async: 4 of the 6 loads a tile, the two 1-byte scale
    loads stay plain; 40 registers at S = 3, sm_90)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    tiles_k = tl.cdiv(K, 64)
    tile_begin = pid_k * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, tiles_k)
    i = tl.arange(0, 128)
    g = (i % 32) // 4
    q = i % 4
    xw_ptr = x_ptr.to(tl.pointer_type(tl.uint32))
    x_a = (tl.minimum(g, M - 1).to(tl.int64) * stride_xm + 16 * q) // 2
    if not TMA:
        row = (i // 32) * 16 + g
        ww_ptr = w_src.to(tl.pointer_type(tl.uint32)) + row * 8 + 2 * q
        ws_ptr = s_src + row * 4 + q
    zero = tl.zeros([128], tl.float32)
    c = (zero, zero, zero, zero, zero, zero, zero, zero)
    for t in tl.range(tile_begin, tile_end, num_stages=NUM_STAGES):
        tile = pid_n * tiles_k + t
        if TMA:
            # (64, 8) words, row 16u + 8h + g, word 2q + p -> lane (u, g, q) holds (h, p)
            w = tl.reshape(w_src.load([tile * 64, 0]).to(tl.uint32, bitcast=True), (4, 2, 8, 4, 2))
            w = tl.permute(tl.reshape(tl.permute(w, (0, 2, 3, 1, 4)), (128, 2, 2)), (0, 2, 1))
            wg, wh = tl.split(w)
            wg0, wg1 = tl.split(wg)
            wh0, wh1 = tl.split(wh)
            # 256 scale bytes, byte (16u + 8h + g) * 4 + q -> lane (u, g, q) holds h
            s = tl.reshape(s_src.load([tile * 16, 0]), (4, 2, 8, 4))
            s0, s1 = tl.split(tl.reshape(tl.permute(s, (0, 2, 3, 1)), (128, 2)))
            w = (wg0, wg1, wh0, wh1, s0.to(tl.uint32) | (s1.to(tl.uint32) << 8))
            xa = gm._load_x(xw_ptr, x_a + t * 32, i < 128, True)
        else:
            w, xa, _ = gm._load_tile(ww_ptr, ws_ptr, xw_ptr, tile, t, x_a, x_a, q, K, False, True)
        c = gm._mma_tile(w, xa, xa, c, False)
    _finish(c, pid_n, pid_k, M, N, w_g_ptr, out_ptr, partial_ptr, counter_ptr, stride_om, SUM_ROWS,
            SUM_SPLITS)


def probe_linear(x, data_t, scale_t, g, n, stages, tma):
    """x (M <= 8, K) bf16 @ W^T, W tiled (K % 64 == 0): what linear_tiled computes, with the weight
    stream pipelined through TMA (tma) or cp.async."""
    m, k = x.shape
    assert m <= 8 and k % 64 == 0 and x.stride(0) % 2 == 0
    _, block_n, block_k, splits, _, _ = gemm_configs.splitk_config(  # the eager launcher's splits
        m, n, k, gemm_configs.sm_count(x.device), reg_mma=True, min_steps=gemm_configs.MIN_STEPS_PER_SPLIT)
    splits, per_split = gemm_configs.split_ranges(k, block_k, splits)
    out = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    partial = torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    tiles_n = triton.cdiv(n, block_n)
    rows, at_once = gemm_configs.split_sum_tile(m, splits, block_n, 4)
    if tma:
        w_src = TensorDescriptor.from_tensor(data_t.view(torch.int32).view(-1, 8), [64, 8])
        s_src = TensorDescriptor.from_tensor(scale_t.view(-1, 16), [16, 16])
    else:
        w_src, s_src = data_t, scale_t
    _probe_kernel[(tiles_n, splits)](
        w_src, s_src, x, g, out, partial, sk.split_counters(x.device, tiles_n), m, n, k, per_split,
        x.stride(0), out.stride(0), TMA=tma, NUM_STAGES=stages, SUM_ROWS=rows, SUM_SPLITS=at_once,
        num_warps=4, num_stages=stages)
    return out


def main() -> None:
    torch.manual_seed(0)
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    l2 = torch.cuda.get_device_properties().L2_cache_size
    variants = [(tma, s) for tma in (False, True) for s in STAGES]
    print(f"{'K':>6} {'N':>6} {'M':>2}  {'linear_tiled':>12}  "
          + "  ".join(f"{'TMA' if tma else 'cp.async'} S={s}" for tma, s in variants) + "   (us a call)")
    for k, n in SHAPES:
        copies = max(2, math.ceil(3 * l2 / (n * k // 2)))
        weights = []
        for _ in range(copies):
            q = nv.quantize(torch.randn(n, k, dtype=torch.bfloat16, device="cuda"))
            weights.append((*ops.tile_weight(q.data, q.scale.view(torch.uint8)), q.global_scale))
        for m in (1, 8):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            want = ops.linear_tiled(x, *weights[0], None, n, "bf16")
            for tma, s in variants:
                got = probe_linear(x, *weights[0], n, s, tma)
                assert torch.equal(got, want), (k, n, m, tma, s, (got.float() - want.float()).abs().max().item())
            base = stream_us(lambda w: ops.linear_tiled(x, *w, None, n, "bf16"), weights)
            times = [stream_us(lambda w, s=s, tma=tma: probe_linear(x, *w, n, s, tma), weights)
                     for tma, s in variants]
            print(f"{k:>6} {n:>6} {m:>2}  {base:12.1f}  " + "  ".join(f"{t:11.1f}" for t in times), flush=True)
        del weights


if __name__ == "__main__":
    main()
