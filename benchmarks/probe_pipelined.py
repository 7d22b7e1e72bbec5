"""The register-fed decode GEMM (kernels/gemm_mma.py) with its weight loads pipelined by Triton
through cp.async into shared memory, against the shipped kernel (a hand prefetch one tile ahead in
registers), same run, M = 1 and 16. Measured in session 22 and not adopted (benchmarks/NOTES.md).

Why it was tried: the shipped loop keeps about one tile a warp in flight (its registers are the only
buffer), and more in registers cost occupancy (sessions 6-21). Session 8's Triton-pipelined probe
ran 4-13x slower than the shipped kernel. Here every weight load can go through cp.async: a lane's
four scale bytes are one 32-bit word (the tile's scales reordered lane by lane, `lane_scale_words`;
1-byte loads are too small for cp.async and stayed synchronous in session 8), the codes 4 x 8 bytes.
x (X_MODE): 0, plain loads (Triton pipelines them through cp.async too); 1, inline-PTX loads in the
tile (outside the pipeliner); 2, the same a tile ahead by hand. Variants: (programs an SM, stages,
x mode); K split so that about that many programs run on each SM.

    python benchmarks/probe_pipelined.py            # check against float64, then time
    python benchmarks/probe_pipelined.py --compile  # sm_90 registers, shared memory, cp.async sizes (no GPU)
"""

import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
import triton.language as tl
from bench_quantize import copy_bandwidth_gbs, stream_us
from probe_loads import splits_for, tiled_weight_copies

from nvfp4_inductor.kernels import gemm_configs
from nvfp4_inductor.kernels import gemm_mma as gm
from nvfp4_inductor.kernels import gemm_splitk as sk

SHAPES = [(4096, 4096), (4096, 6144), (14336, 4096), (4096, 14336), (4096, 28672), (8192, 28672)]  # (K, N)
VARIANTS = [(8, 4, 0), (8, 4, 1), (8, 3, 2), (8, 4, 2), (12, 3, 2)]  # (programs an SM, stages, x mode)
MS = (1, 16)


@triton.jit
def _ld_v4(ptr):
    """A 16-byte global load outside Triton's pipeliner (inline PTX): 4 uint32."""
    return tl.inline_asm_elementwise("ld.global.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l",
                                     [ptr.to(tl.int64, bitcast=True)], dtype=(tl.uint32,) * 4,
                                     is_pure=True, pack=1)


def lane_scale_words(scale_t: torch.Tensor) -> torch.Tensor:
    """Tiled scale bytes (tiles * 64 rows, 4 blocks) -> uint8 (tiles, 256) whose word i (4 bytes)
    holds lane i's scales: rows 32u + g + 8j (j = 0..3, byte j) of block q, i = 32u + 4g + q."""
    s = scale_t.reshape(-1, 2, 4, 8, 4)  # (tile, u, j, g, q): row 32u + 8j + g, block q
    return s.permute(0, 1, 3, 4, 2).contiguous().reshape(-1, 256)


@triton.jit
def _x_words(xw_ptr, x_rows, t, NB: tl.constexpr):
    """A lane's x words of K-tile t for its NB row blocks, by inline PTX (outside the pipeliner)."""
    xs = ()
    for h in tl.static_range(NB):
        x0, x1, x2, x3 = _ld_v4(xw_ptr + x_rows[h] + t * 32)
        x4, x5, x6, x7 = _ld_v4(xw_ptr + x_rows[h] + t * 32 + 4)
        xs = xs + ((x0, x1, x2, x3, x4, x5, x6, x7),)
    return xs


@triton.jit
def _pipelined_kernel(x_ptr, w_ptr, ws_ptr, w_g_ptr, out_ptr, partial_ptr, counter_ptr,
                      M, N, K, tiles_per_split, stride_xm, stride_om,
                      STAGES: tl.constexpr, SUM_ROWS: tl.constexpr, SUM_SPLITS: tl.constexpr,
                      X_MODE: tl.constexpr, NB: tl.constexpr):
    """gemm_splitk._splitk_kernel with REG_MMA = NB (M <= 8 NB), tiled W, K % 64 == 0, g per tensor,
    no bias; the loop a tl.range(num_stages=STAGES) whose code and scale loads Triton pipelines
    (ws_ptr: lane_scale_words). x: X_MODE 0, plain loads (pipelined through cp.async too); 1, inline
    PTX loads in the tile (not pipelined); 2, the same a tile ahead by hand."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    tiles_k = tl.cdiv(K, 64)
    tile_begin = pid_k * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, tiles_k)
    i = tl.arange(0, 64)
    lane = i % 32
    g = lane // 4
    q = lane % 4
    row = (i // 32) * 32 + g
    wp = w_ptr.to(tl.pointer_type(tl.uint32)) + row * 8 + 2 * q
    sp = ws_ptr.to(tl.pointer_type(tl.uint32)) + i
    xw_ptr = x_ptr.to(tl.pointer_type(tl.uint32))
    x_rows = gm.lane_x_rows(g, 16 * q, M, stride_xm, NB)
    zero = tl.zeros([64], tl.float32)
    c = (zero, zero, zero, zero, zero, zero, zero, zero) * NB
    first = pid_n * tiles_k
    x_next = _x_words(xw_ptr, x_rows, tile_begin, NB)
    for t in tl.range(tile_begin, tile_end, num_stages=STAGES):
        words = wp + (first + t) * 512
        w0, w1 = tl.split(tl.load(words[:, None] + tl.arange(0, 2)[None, :]))
        w2, w3 = tl.split(tl.load(words[:, None] + (64 + tl.arange(0, 2))[None, :]))
        w4, w5 = tl.split(tl.load(words[:, None] + (128 + tl.arange(0, 2))[None, :]))
        w6, w7 = tl.split(tl.load(words[:, None] + (192 + tl.arange(0, 2))[None, :]))
        s = tl.load(sp + (first + t) * 64)
        if X_MODE == 2:  # the last tile's words again at the end
            xs = x_next
            x_next = _x_words(xw_ptr, x_rows, tl.minimum(t + 1, tile_end - 1), NB)
        elif X_MODE == 1:
            xs = _x_words(xw_ptr, x_rows, t, NB)
        else:
            xs = gm._load_xs(xw_ptr, x_rows, t * 32, i < 64, NB, True)
        c = gm._mma_tile((w0, w1, w2, w3, w4, w5, w6, w7, s & 0xFFFF, s >> 16), xs, c, NB)
    acc = gm.sums_tile(c, NB)
    ms = tl.arange(0, 16)
    cols_n = pid_n * 64 + tl.arange(0, 64)
    tl.store(partial_ptr + (pid_k * M + ms)[None, :].to(tl.int64) * N + cols_n[:, None], acc,
             mask=(cols_n < N)[:, None] & (ms < M)[None, :])
    num_splits = tl.num_programs(1)
    if sk.last_split(counter_ptr + pid_n, num_splits):
        total = sk.sum_splits(partial_ptr, num_splits, M, N, cols_n, 64, SUM_ROWS, SUM_SPLITS)
        sk._epilogue(total, tl.arange(0, SUM_ROWS), cols_n, M, N, w_g_ptr, w_g_ptr, out_ptr, stride_om,
                     False, False, 2.0**7)


def pipelined_linear(x, data_t, scale_words, g, n, per_sm, stages, x_mode):
    """x (M <= 16, K) bf16 @ W^T -> bf16, W tiled (K % 64 == 0, N % 64 == 0), scales lane_scale_words,
    K split so that about per_sm programs run on each SM."""
    m, k = x.shape
    tiles_n = n // 64
    splits, per_split = splits_for(n, k, per_sm, gemm_configs.sm_count(x.device))
    out = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    partial = torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    rows, at_once = gemm_configs.split_sum_tile(m, splits, 64, 2)
    _pipelined_kernel[(tiles_n, splits)](
        x, data_t, scale_words, g, out, partial, sk.split_counters(x.device, tiles_n), m, n, k, per_split,
        x.stride(0), out.stride(0), STAGES=stages, SUM_ROWS=rows, SUM_SPLITS=at_once, X_MODE=x_mode,
        NB=1 if m <= 8 else 2, num_warps=2, num_stages=stages)
    return out


def compile_facts() -> None:
    """sm_90: registers, shared memory, cp.async sizes and mma.sync count of each variant."""
    from triton.backends.compiler import GPUTarget

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from compile_kernels import compile_for

    sig = {"x_ptr": "*bf16", "w_ptr": "*u8", "ws_ptr": "*u8", "w_g_ptr": "*fp32", "out_ptr": "*bf16",
           "partial_ptr": "*fp32", "counter_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32",
           "tiles_per_split": "i32", "stride_xm": "i32", "stride_om": "i32",
           **{name: "constexpr" for name in ("STAGES", "SUM_ROWS", "SUM_SPLITS", "X_MODE", "NB")}}
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    for nb in (1, 2):
        for stages, x_mode in sorted({(s, x) for _, s, x in VARIANTS}):
            kernel = compile_for(_pipelined_kernel, sig, {"STAGES": stages, "SUM_ROWS": 8 * nb, "SUM_SPLITS": 2,
                                                          "X_MODE": x_mode, "NB": nb},
                                 GPUTarget("cuda", 90, 32), 2, stages)
            ptx = kernel.asm["ptx"]
            with tempfile.TemporaryDirectory() as tmp:
                cubin = os.path.join(tmp, "k.cubin")
                Path(cubin).write_bytes(kernel.asm["cubin"])
                usage = subprocess.run([bin_dir / "cuobjdump", "--dump-resource-usage", cubin],
                                       capture_output=True, text=True, check=True).stdout
            cp = sorted(set(re.findall(r"cp\.async\.c[ag]\.shared\.global \[[^]]*\], \[[^]]*\], (0x\w+)", ptx)))
            registers = re.search(r"REG:(\d+)", usage).group(1)
            print(f"NB {nb} stages {stages} x mode {x_mode}: registers {registers}, shared "
                  f"{kernel.metadata.shared} B, cp.async sizes {cp}, mma.sync {ptx.count('mma.sync')}")


def check() -> None:
    import nvfp4_inductor as nv

    worst = 0.0
    for n, k in [(64, 64), (128, 4096), (4096, 4096), (1024, 14336)]:
        q = nv.quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
        data_t, scale_t = torch.ops.nvfp4.tile_weight(q.data, q.scale.view(torch.uint8))
        words = lane_scale_words(scale_t)
        w_ref = q.dequantize(torch.float32).double()
        for m in (1, 3, 8, 9, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = x.double() @ w_ref.T
            want = torch.ops.nvfp4.linear_tiled(x, data_t, scale_t, q.global_scale, None, n, "bf16")
            shipped = ((want.double() - ref).abs().max() / ref.abs().max()).item()
            for per_sm, stages, x_mode in VARIANTS:
                y = pipelined_linear(x, data_t, words, q.global_scale, n, per_sm, stages, x_mode)
                err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
                worst = max(worst, err)
                assert err <= max(2 * shipped, 8e-3), (n, k, m, per_sm, stages, x_mode, err, shipped)
    print(f"correct: worst relative error {worst:.2e} (bf16 out vs float64)")


def main() -> None:
    if "--compile" in sys.argv:
        compile_facts()
        return
    torch.manual_seed(0)
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    check()
    copy = copy_bandwidth_gbs()
    l2 = torch.cuda.get_device_properties().L2_cache_size
    print(f"device copy: {copy:.0f} GB/s; columns P<programs an SM>S<stages>x<x mode>, us")
    cols = ["bf16", "shipped"] + [f"P{p}S{s}x{x}" for p, s, x in VARIANTS] + ["floor"]
    print(f"{'K':>6} {'N':>6} {'M':>3} " + " ".join(f"{c:>8}" for c in cols))
    for k, n in SHAPES:
        weights = tiled_weight_copies(n, k, l2)
        ins = [(d, lane_scale_words(s), g) for d, s, g in weights]
        w_bf16 = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda")
                  for _ in range(max(2, math.ceil(3 * l2 / (n * k * 2))))]
        for m in MS:
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            times = [stream_us(lambda w: x @ w.T, w_bf16),
                     stream_us(lambda w: torch.ops.nvfp4.linear_tiled(x, w[0], w[1], w[2], None, n, "bf16"),
                               weights)]
            for per_sm, stages, x_mode in VARIANTS:
                times.append(stream_us(lambda w: pipelined_linear(x, *w, n, per_sm, stages, x_mode), ins))
            times.append(n * k * 0.5625 / copy / 1e3)
            print(f"{k:>6} {n:>6} {m:>3} " + " ".join(f"{t:8.1f}" for t in times), flush=True)
        del weights, ins, w_bf16


if __name__ == "__main__":
    main()
