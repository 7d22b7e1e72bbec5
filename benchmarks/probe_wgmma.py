"""A warpgroup MMA mainloop for the decode GEMM at M = 9..16 (experiment, session 35).

The shipped register-fed mainloop (kernels/gemm_mma.py) runs 2 warps a 64-row tile, each warp
32 rows, mma.sync on operands it loads itself; at M = 9..16 every lane also loads 2 x 16 bytes of
x a tile and permutes them into 8 B operands, and issues 16 mma a tile (241 SASS instructions a
tile a warp at sm_90 against 210 at M = 1, 80 registers, 8 programs = 16 warps an SM). In its
SASS ptxas issues the next tile's weight loads at the bottom of the loop, right before the double
buffer's register moves that wait on them.

Here a program is one warpgroup (4 warps, 16 rows each) and multiplies with
wgmma.mma_async.m64n16k16 (A = the decoded weights from registers, in mma.sync's A fragment
layout; B = x^T from shared memory): x is staged once a tile by the whole program (one 16-byte
load a thread, its 4 pairs stored in the operand order the decode's k-slots need), the tensor core
reads it, and a lane decodes 4 code words a tile (2 rows). Shared memory: Triton's own
`global_smem` (the kernel's 4 KB, which Triton uses only after the loop), two 2 KB x buffers.

    python benchmarks/probe_wgmma.py [--lbo-k 1 0] [--variants A1R64P6 A3R0P8 ...] [--ms 9 16]

checks the descriptor reading(s) on a small GEMM (fp32 out, against float64), then each variant
(AaRrPp: weights a tiles ahead, maxnreg r, 0 for ptxas's choice, at most p programs an SM) on six
shapes against float64, then times them against the shipped eager kernel (tiled W4A16, CUDA-graph
replays over weight copies beyond L2). H100, session 35 (benchmarks/NOTES.md): exact, no faster.

Not wired into the package: a measurement."""
import argparse
import re

import torch
import triton
import triton.language as tl
from bench_gemm import weight_copies
from bench_quantize import stream_us

from nvfp4_inductor.kernels import gemm_configs
from nvfp4_inductor.kernels.gemm_mma import _decode_pairs, _join8, _load4, _pair_hi, _pair_lo, _scales, _stream
from nvfp4_inductor.kernels.gemm_splitk import _epilogue, gemm_splitk, last_split, split_counters, sum_splits

SHAPES = [(4096, 4096), (4096, 6144), (4096, 14336), (14336, 4096), (4096, 28672), (8192, 28672)]

# B (x^T) of one k16 sub-step, 16 k-slots x 16 x rows, in the no-swizzle K-major canonical layout:
# core matrices of 8 rows x 16 bytes (8 k-slots), (row group ng, k group kg) at ng * 256 + kg * 128;
# a tile's four sub-steps 512 bytes apart, two tile buffers 2048 apart.
_SUB: tl.constexpr = tl.constexpr(512)
_BUF: tl.constexpr = tl.constexpr(2048)


def _wgmma_asm(lbo_is_k: bool) -> str:
    """$0..$7 accumulators out, $8..$15 in, $16..$31 A (4 sub-steps x 4), $32 B's shared address.
    Descriptor: bits 0-13 address >> 4, 16-29 leading byte offset >> 4, 32-45 stride byte offset
    >> 4, no swizzle."""
    k_step, n_step = 128 >> 4, 256 >> 4
    lbo, sbo = (k_step, n_step) if lbo_is_k else (n_step, k_step)
    lines = ["{", ".reg .b32 lo, hi, base, one; .reg .b64 d; .reg .pred p;", "mov.b32 one, 1;",
             "setp.ne.b32 p, one, 0;", f"mov.b32 hi, {sbo};",
             *[f"mov.b32 ${i}, ${i + 8};" for i in range(8)],
             "shr.u32 base, $32, 4;", "wgmma.fence.sync.aligned;"]
    for j in range(4):
        lines += [f"add.u32 lo, base, {j * (512 >> 4)};", f"or.b32 lo, lo, {lbo << 16};",
                  "mov.b64 d, {lo, hi};",
                  "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
                  "{$0, $1, $2, $3, $4, $5, $6, $7}, "
                  f"{{${16 + 4 * j}, ${17 + 4 * j}, ${18 + 4 * j}, ${19 + 4 * j}}}, d, p, 1, 1, 0;"]
    lines += ["wgmma.commit_group.sync.aligned;", "wgmma.wait_group.sync.aligned 0;", "}"]
    return "\n".join(lines)


@triton.jit
def _smem_base():
    """The shared-memory address of Triton's global_smem (per thread, the same)."""
    return tl.inline_asm_elementwise("mov.u32 $0, global_smem;", "=r", [], dtype=tl.uint32, is_pure=True,
                                     pack=1)


@triton.jit
def _store_pairs(a0, a1, a2, a3, w0, w1, w2, w3):
    """st.shared.b32 w_i at address a_i (fenced for the async proxy)."""
    return tl.inline_asm_elementwise(
        "st.shared.b32 [$1], $5; st.shared.b32 [$2], $6; st.shared.b32 [$3], $7; st.shared.b32 [$4], $8;"
        " fence.proxy.async.shared::cta; mov.u32 $0, 0;",
        "=r,r,r,r,r,r,r,r,r", [a0, a1, a2, a3, w0, w1, w2, w3], dtype=tl.uint32, is_pure=False, pack=1)


@triton.jit
def _wgmma4(c, a, b_addr, ASM: tl.constexpr):
    return tl.inline_asm_elementwise(
        ASM, "=f,=f,=f,=f,=f,=f,=f,=f," + "f," * 8 + "r," * 16 + "r",
        [c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]] + list(a) + [b_addr],
        dtype=(tl.float32,) * 8, is_pure=False, pack=1)


@triton.jit
def _load_w(wp, sp, tile):
    """A lane's codes of `tile` (rows g and g + 8 of its warp's 16: two words each) and their two
    scales (one 16-bit load: byte 0 row g, byte 1 row g + 8)."""
    a0, a1 = tl.split(_stream(wp + tile * 512 + tl.arange(0, 2)[None, :]))
    b0, b1 = tl.split(_stream(wp + tile * 512 + (64 + tl.arange(0, 2))[None, :]))
    return a0, a1, b0, b1, _stream(sp + tile * 128)


@triton.jit
def _x_pairs4(x0, x1, x2, x3):
    return _pair_lo(x0, x2), _pair_hi(x0, x2), _pair_lo(x1, x3), _pair_hi(x1, x3)


@triton.jit
def wg_mainloop(x_ptr, w_ptr, w_scale_ptr, M, K, stride_xm, pid_n, tile_begin, tile_end, ASM: tl.constexpr,
                AHEAD: tl.constexpr):
    """fp32 (64, 16) = 2^-7 * (W . x^T) over K-tiles [tile_begin, tile_end) of tile row pid_n (M <= 16):
    gemm_mma.mma_mainloop's contract on 4 warps. Weights AHEAD tiles ahead in registers (the loop
    unrolled AHEAD times, so the buffers rotate without moves), x two tiles ahead: registers, then
    the shared buffer the next tile's wgmma reads."""
    i = tl.arange(0, 128)
    lane = i % 32
    u = i // 32
    g = lane // 4
    q = lane % 4
    tiles_k = tl.cdiv(K, 64)
    first = pid_n * tiles_k
    last = tile_end - 1
    wp = (w_ptr.to(tl.pointer_type(tl.uint32)) + ((16 * u + g) * 8 + 2 * q))[:, None]
    sp = w_scale_ptr.to(tl.pointer_type(tl.uint16)) + 64 * (u // 2) + 8 * g + 2 * q + u % 2
    # x staging: thread i takes x row n = i // 8 (row M - 1 again past M), 8 k from 8 c, c = i % 8
    n = i // 8
    c8 = i % 8
    xw_ptr = x_ptr.to(tl.pointer_type(tl.uint32))
    x_row = tl.minimum(n, M - 1).to(tl.int64) * stride_xm // 2 + 4 * c8  # uint32 words at K-tile 0
    off = (c8 % 2) * (2 * _SUB) + (n // 8) * 256 + (n % 8) * 16 + 4 * (c8 // 2)
    smem = _smem_base()
    zero = tl.zeros([128], tl.float32)
    c = (zero, zero, zero, zero, zero, zero, zero, zero)
    ws = ()
    for d in tl.static_range(AHEAD):
        ws = ws + _load_w(wp, sp, first + tl.minimum(tile_begin + d, last))
    x0, x1, x2, x3 = _load4(xw_ptr + x_row + tile_begin * 32, x_row >= 0, True)
    p0, p1, p2, p3 = _x_pairs4(x0, x1, x2, x3)
    base = smem + off
    done = _store_pairs(base, base + 128, base + _SUB, base + _SUB + 128, p0, p1, p2, p3)
    xs = _load4(xw_ptr + x_row + tl.minimum(tile_begin + 1, last) * 32, x_row >= 0, True)
    tl.debug_barrier()
    for t in tl.range(tile_begin, tile_end, loop_unroll_factor=AHEAD):
        wn = _load_w(wp, sp, first + tl.minimum(t + AHEAD, last))
        xn = _load4(xw_ptr + x_row + tl.minimum(t + 2, last) * 32, x_row >= 0, True)
        sg, sh = _scales(ws[4])
        g0, g1, g2, g3 = _decode_pairs(ws[0], sg)
        h0, h1, h2, h3 = _decode_pairs(ws[2], sh)
        k0, k1, k2, k3 = _decode_pairs(ws[1], sg)
        l0, l1, l2, l3 = _decode_pairs(ws[3], sh)
        a = (g0, h0, g1, h1, g2, h2, g3, h3, k0, l0, k1, l1, k2, l2, k3, l3)
        c = _wgmma4(c, a, smem + ((t - tile_begin) % 2) * _BUF, ASM)
        p0, p1, p2, p3 = _x_pairs4(xs[0], xs[1], xs[2], xs[3])
        base = smem + ((t - tile_begin + 1) % 2) * _BUF + off
        done = _store_pairs(base, base + 128, base + _SUB, base + _SUB + 128, p0, p1, p2, p3)
        tl.debug_barrier()
        ws = ws[5:] + wn
        xs = xn
    # lane (u, g, q)'s c[4 jn + 2 r + b] is out[row 16 u + 8 r + g, x row 8 jn + 2 q + b]
    acc = tl.reshape(_join8(c), (4, 8, 4, 2, 2, 2))  # (u, g, q, b, r, jn)
    return tl.reshape(tl.permute(acc, (0, 4, 1, 5, 2, 3)), (64, 16))


@triton.jit
def _wg_kernel(x_ptr, w_ptr, w_scale_ptr, w_g_ptr, out_ptr, partial_ptr, counter_ptr, M, N, K,
               tiles_per_split, stride_xm, stride_om, ASM: tl.constexpr,
               AHEAD: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    tile_begin = pid_k * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, tl.cdiv(K, 64))
    acc = wg_mainloop(x_ptr, w_ptr, w_scale_ptr, M, K, stride_xm, pid_n, tile_begin, tile_end, ASM, AHEAD)
    ms = tl.arange(0, 16)
    cols_n = pid_n * 64 + tl.arange(0, 64)
    mask = (cols_n < N)[:, None] & (ms < M)[None, :]
    tl.store(partial_ptr + (pid_k * M + ms)[None, :].to(tl.int64) * N + cols_n[:, None], acc, mask=mask)
    if last_split(counter_ptr + pid_n, tl.num_programs(1)):
        total = sum_splits(partial_ptr, tl.num_programs(1), M, N, cols_n, 64, 16, 2)
        _epilogue(total, ms, cols_n, M, N, w_g_ptr, w_g_ptr, out_ptr, stride_om, False, False, 2.0**7)


def wg_linear(x, w_data, w_scale, w_g, n, per_sm, asm, out_dtype=torch.bfloat16, maxnreg=0, ahead=1):
    m, k = x.shape
    assert 8 < m <= 16 and k % 64 == 0 and x.stride(0) % 8 == 0
    num_sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    _, _, _, splits, _, _ = gemm_configs._skinny_config(m, n, k, num_sms, 64, 64, per_sm, 4, 1, 8,
                                                        max_per_sm=per_sm)
    splits, per_split = gemm_configs.split_ranges(k, 64, splits)
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    partial = torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    counters = split_counters(x.device, n // 64)
    compiled = _wg_kernel[(n // 64, splits)](x, w_data, w_scale, w_g, out, partial, counters, m, n, k,
                                             per_split, x.stride(0), out.stride(0), ASM=asm, AHEAD=ahead,
                                             num_warps=4, num_stages=1, **({"maxnreg": maxnreg} if maxnreg else {}))
    assert compiled is None or compiled.metadata.shared >= 2 * 2048, compiled.metadata.shared
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lbo-k", type=int, nargs="+", default=[1],
                        help="descriptor: 1, leading byte offset = the k-group stride; 0, swapped")
    parser.add_argument("--variants", nargs="+", default=["A1R64P6", "A2R0P6", "A2R80P6", "A3R0P6", "A3R0P8",
                                                          "A3R80P6"],
                        help="AaRrPp: weights a tiles ahead, maxnreg r (0: ptxas's choice), at most p programs "
                             "an SM")
    parser.add_argument("--ms", type=int, nargs="+", default=[16])
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    l2 = torch.cuda.get_device_properties().L2_cache_size
    torch.manual_seed(0)
    asms = {}
    for lbo_k in args.lbo_k:  # which descriptor reading is right
        asm = _wgmma_asm(bool(lbo_k))
        x = torch.randn(16, 1024, dtype=torch.bfloat16, device="cuda")
        _, w_q, w_t = weight_copies(1024, 256, 0)
        ref = x.double() @ w_q[0].dequantize(torch.float32).double().T
        got = wg_linear(x, *w_t[0][:3], 256, 8, asm, torch.float32, 0, 3).double()
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        print(f"lbo_k={lbo_k}: rel err {err:.2e}", flush=True)
        if err < 1e-5:
            asms[lbo_k] = asm
    if not asms:
        return
    asm = next(iter(asms.values()))
    variants = [tuple(int(f) for f in re.fullmatch(r"A(\d+)R(\d+)P(\d+)", v).groups()) for v in args.variants]
    for k, n in SHAPES:
        _, w_q, w_t = weight_copies(k, n, l2)
        row = []
        for m in args.ms:
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            ref = x.double() @ w_q[0].dequantize(torch.float32).double().T
            for v in variants:
                got = wg_linear(x, *w_t[0][:3], n, v[2], asm, torch.float32, v[1], v[0]).double()
                err = ((got - ref).abs().max() / ref.abs().max()).item()
                assert err < 1e-5, (k, n, m, v, err)
            shipped = stream_us(lambda w: gemm_splitk(x, w[0], w[1], w[2], None, torch.bfloat16, False,
                                                      tiled_n=n), w_t)
            ours = [stream_us(lambda w: wg_linear(x, w[0], w[1], w[2], n, v[2], asm, maxnreg=v[1], ahead=v[0]), w_t)
                    for v in variants]
            shipped2 = stream_us(lambda w: gemm_splitk(x, w[0], w[1], w[2], None, torch.bfloat16, False,
                                                       tiled_n=n), w_t)
            row.append(f"M={m}: shipped {shipped:5.1f} / {shipped2:5.1f}  wgmma "
                       + " ".join(f"{name} {t:5.1f}" for name, t in zip(args.variants, ours)))
        print(f"{k:>6} {n:>6}  " + "  |  ".join(row), flush=True)
        del w_q, w_t


if __name__ == "__main__":
    main()
