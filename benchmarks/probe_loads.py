"""What the register-fed decode GEMM's weight stream can reach without its arithmetic: kernels
with the GEMM's grid and split ranges that only load (and xor-fold what they load, so nothing is
dead), against the real kernel (gemm_splitk, reg_mma) and bf16 cuBLAS, same run, M = 1.

Load variants (per lane, per 64 x 64 tile of the tiled layout, 4-warp programs):
    lanes  : the GEMM's mapping before session 9 (a warp per 16 rows): codes of rows g and g + 8
             (2 x 8 bytes), 2 scale bytes, + x (32 bytes); the kernel now runs a warp per 32 rows
             (4 rows a lane for the same x), which this probe's result led to
    lanes-x: the same without x
    flat   : 16 contiguous code bytes (lane i: bytes 16i .. 16i + 15), 2 scale bytes, + x
    flat-x : the same without x
and unroll 1 or 2 (the second: two tiles' loads issued before either is folded).

    python benchmarks/probe_loads.py
    python benchmarks/probe_loads.py --orders   # the same loads in other tile orders (DRAM locality)
"""

import math
import sys

import torch
import triton
import triton.language as tl

from nvfp4_inductor.kernels import gemm_configs, gemm_mma

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672)]  # (K, N)
MODES = {"lanes": 0, "lanes-x": 1, "flat": 2, "flat-x": 3}


@triton.jit
def _fold_tile(ww_ptr, ws_ptr, xw_ptr, tile, t, i, q, row, MODE: tl.constexpr):
    if MODE < 2:
        words = ww_ptr + tile * 512 + row * 8 + 2 * q
        v = tl.xor_sum(tl.load(words[:, None] + tl.arange(0, 2)[None, :]), 1)
        v ^= tl.xor_sum(tl.load(words[:, None] + (64 + tl.arange(0, 2))[None, :]), 1)
        scales = ws_ptr + tile * 256 + row * 4 + q
        v ^= tl.load(scales).to(tl.uint32) | (tl.load(scales + 32).to(tl.uint32) << 8)
    else:
        v = tl.xor_sum(tl.load(ww_ptr + tile * 512 + i[:, None] * 4 + tl.arange(0, 4)[None, :]), 1)
        v ^= tl.load(ws_ptr.to(tl.pointer_type(tl.uint16)) + tile * 128 + i).to(tl.uint32)
    if MODE % 2 == 0:
        v ^= tl.xor_sum(tl.load(xw_ptr + t * 32 + 8 * q[:, None] + tl.arange(0, 8)[None, :]), 1)
    return v


@triton.jit
def _loads_kernel(x_ptr, w_ptr, ws_ptr, out_ptr, K, tiles_per_split, MODE: tl.constexpr,
                  UNROLL: tl.constexpr, ORDER: tl.constexpr = 0):
    """ORDER 0: split s reads its K-tiles as one contiguous run (the GEMM's order); 1: split s of
    S reads K-tiles s, s + S, s + 2S, ... (the programs of one N-tile read adjacent tiles at each
    step); 2: not a GEMM's order, the DRAM pattern of a copy: program p of P (in launch order)
    reads flat tiles p, p + P, ... of the whole weight."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    tiles_k = tl.cdiv(K, 64)
    if ORDER == 0:
        begin = pid_s * tiles_per_split
        end = tl.minimum(begin + tiles_per_split, tiles_k)
        step = 1
    elif ORDER == 1:
        begin = pid_s
        end = tiles_k
        step = tl.num_programs(1)
    else:
        num_programs = tl.num_programs(0) * tl.num_programs(1)
        begin = pid_s * tl.num_programs(0) + pid_n
        end = tl.num_programs(0) * tiles_k
        step = num_programs
        pid_n = 0
    i = tl.arange(0, 128)
    lane = i % 32
    q = lane % 4
    row = (i // 32) * 16 + lane // 4
    ww_ptr = w_ptr.to(tl.pointer_type(tl.uint32))
    xw_ptr = x_ptr.to(tl.pointer_type(tl.uint32))
    acc = tl.zeros([128], tl.uint32)
    first = pid_n * tiles_k
    for t in range(begin, end, UNROLL * step):
        if UNROLL == 1:
            acc ^= _fold_tile(ww_ptr, ws_ptr, xw_ptr, first + t, t % tiles_k, i, q, row, MODE)
        else:
            t2 = tl.minimum(t + step, end - 1)
            a = _fold_tile(ww_ptr, ws_ptr, xw_ptr, first + t, t % tiles_k, i, q, row, MODE)
            b = _fold_tile(ww_ptr, ws_ptr, xw_ptr, first + t2, t2 % tiles_k, i, q, row, MODE)
            acc ^= a ^ b
    # a store that (almost) never happens, so the loads stay live but nothing is written
    tl.store(out_ptr + i, acc, mask=acc == 0x9E3779B9)


def compile_check() -> None:
    """Compile every variant for sm_90 (no GPU needed) and print its vector loads."""
    import re

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {"x_ptr": "*bf16", "w_ptr": "*u8", "ws_ptr": "*u8", "out_ptr": "*u32", "K": "i32",
           "tiles_per_split": "i32", "MODE": "constexpr", "UNROLL": "constexpr"}
    attrs = {(j,): [["tt.divisibility", 16]] for j in range(5)}
    for name, mode in MODES.items():
        for unroll in (1, 2):
            src = ASTSource(fn=_loads_kernel, signature=sig, constexprs={"MODE": mode, "UNROLL": unroll},
                            attrs=attrs)
            ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
            loads = re.findall(r"ld\.global[\w.]*", ptx)
            print(f"{name:8} unroll {unroll}: " + ", ".join(f"{l} x{loads.count(l)}" for l in sorted(set(loads))))


def splits_for(n, k, per_sm, sms):
    _, _, _, splits, _, _ = gemm_configs._skinny_config(1, n, k, sms, 64, 64, per_sm, 4, 1, 1)
    return gemm_configs.split_ranges(k, 64, splits)


def tiled_weight_copies(n: int, k: int, l2: int) -> list:
    """Random (N, K) NVFP4 weights in the tiled layout, (codes, scales, global scale), in enough
    copies to overflow L2 three times over."""
    import nvfp4_inductor as nv

    weights = []
    for _ in range(max(2, math.ceil(3 * l2 / (n * k * 0.5625)))):
        q = nv.quantize(torch.randn(n, k, dtype=torch.bfloat16, device="cuda"))
        weights.append((*torch.ops.nvfp4.tile_weight(q.data, q.scale.view(torch.uint8)), q.global_scale))
    return weights


def main() -> None:
    from bench_quantize import copy_bandwidth_gbs, stream_us

    from nvfp4_inductor.kernels.gemm_splitk import gemm_splitk

    torch.manual_seed(0)
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    copy = copy_bandwidth_gbs()
    sms = torch.cuda.get_device_properties().multi_processor_count
    l2 = torch.cuda.get_device_properties().L2_cache_size
    print(f"device copy {copy:.0f} GB/s; times in us (CUDA-graph replays over weights beyond L2), M = 1")
    if "--orders" in sys.argv:
        return orders(copy, sms, l2, out=torch.zeros(128, dtype=torch.int32, device="cuda"))
    cols = ["bf16", "gemm"] + [f"{m}/u{u}" for m in MODES for u in (1, 2)]
    print(f"{'K':>6} {'N':>6} {'/SM':>3} {'spl':>3} " + " ".join(f"{c:>9}" for c in cols) + "  floor")
    out = torch.zeros(128, dtype=torch.int32, device="cuda")
    for k, n in SHAPES:
        w_bf16 = torch.randn(n, k, dtype=torch.bfloat16, device="cuda")
        bf16_copies = [w_bf16] + [torch.randn_like(w_bf16) for _ in range(max(1, math.ceil(3 * l2 / (n * k * 2))) )]
        weights = tiled_weight_copies(n, k, l2)
        x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
        bf16 = stream_us(lambda w: x @ w.T, bf16_copies)
        floor = n * k * 0.5625 / copy / 1e3
        for per_sm in (8, 16):
            splits, per_split = splits_for(n, k, per_sm, sms)
            config = (16, 64, 64, splits, gemm_mma.WARPS, 1)  # the kernel as it is now
            times = [bf16, stream_us(lambda w: gemm_splitk(x, w[0], w[1], w[2], None, torch.bfloat16, False,
                                                           config=config, tiled_n=n, reg_mma=True), weights)]
            grid = (n // 64, splits)
            for mode in MODES.values():
                for unroll in (1, 2):
                    times.append(stream_us(lambda w: _loads_kernel[grid](x, w[0], w[1], out, k, per_split,
                                                                         MODE=mode, UNROLL=unroll), weights))
            print(f"{k:>6} {n:>6} {per_sm:>3} {splits:>3} " + " ".join(f"{t:9.1f}" for t in times)
                  + f" {floor:6.1f}", flush=True)
        del weights, bf16_copies


def orders(copy, sms, l2, out) -> None:
    """--orders: the same loads (codes, scales and x, mode "lanes") in the three tile orders of
    _loads_kernel, unroll 1 and 2, at 8 and 16 programs per SM."""
    from bench_quantize import stream_us

    print(f"{'K':>6} {'N':>6} {'/SM':>3} {'spl':>3} "
          + " ".join(f"{f'o{o}/u{u}':>8}" for o in (0, 1, 2) for u in (1, 2)) + "  floor (us)")
    for k, n in SHAPES:
        weights = tiled_weight_copies(n, k, l2)
        x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
        for per_sm in (8, 16):
            splits, per_split = splits_for(n, k, per_sm, sms)
            grid = (n // 64, splits)
            times = [stream_us(lambda w: _loads_kernel[grid](x, w[0], w[1], out, k, per_split, MODE=0,
                                                             UNROLL=u, ORDER=o), weights)
                     for o in (0, 1, 2) for u in (1, 2)]
            print(f"{k:>6} {n:>6} {per_sm:>3} {splits:>3} " + " ".join(f"{t:8.1f}" for t in times)
                  + f" {n * k * 0.5625 / copy / 1e3:6.1f}", flush=True)
        del weights


if __name__ == "__main__":
    compile_check() if "--compile" in sys.argv else main()
