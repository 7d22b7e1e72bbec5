"""Can a decode GEMM's weights reach L2 while the kernels before it (norms, attention) leave HBM
idle? Sequences of the decoder block at M = 1, in CUDA graphs, each on its own weight copies
(together beyond L2):

    A (a GEMM) -> [prefetch: the first X bytes of B's codes and scales to L2] -> spin T us -> B

`spin` is one program busy-waiting on the global timer (no memory traffic), standing in for the
latency-bound kernels between two GEMMs. Prefetch variants: a kernel whose lanes issue
`prefetch.global.L2` per 128-byte line, or `cp.async.bulk.prefetch.L2` per 4 KB. The prefetch
kernel alone is timed too: fire-and-forget (short) or waiting for its bytes (X / bandwidth).

    python benchmarks/probe_l2_handoff.py
"""

import math

import torch
import triton
import triton.language as tl
from bench_quantize import copy_bandwidth_gbs, graph_us

import nvfp4_inductor as nv
from nvfp4_inductor.kernels.gemm_splitk import gemm_splitk

ops = torch.ops.nvfp4
LINE = 128
CHUNK = 16384  # bytes a prefetch program covers (4 warps)


@triton.jit
def _now(dummy):
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [dummy], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _spin_kernel(out_ptr, ns):
    d = tl.zeros([1], tl.int32)
    start = tl.max(_now(d), 0)
    now = start
    while now - start < ns:
        now = tl.max(_now(d), 0)
    tl.store(out_ptr, (now - start).to(tl.int32))


@triton.jit
def _prefetch_kernel(a_ptr, a_bytes, a_programs, b_ptr, b_bytes, BULK: tl.constexpr,
                     CHUNK: tl.constexpr, LINE: tl.constexpr):
    """Programs [0, a_programs) prefetch a's first a_bytes, the others b's first b_bytes."""
    pid = tl.program_id(0)
    in_a = pid < a_programs
    base = tl.where(in_a, pid, pid - a_programs).to(tl.int64) * CHUNK
    limit = tl.where(in_a, a_bytes, b_bytes)
    ptr = tl.where(in_a, a_ptr, b_ptr)  # uint8 pointers
    if BULK:  # one 4 KB bulk prefetch per lane 0 of each warp
        offs = base + tl.arange(0, CHUNK // 4096) * 4096
        ok = (offs + 4096 <= limit).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], 4096; "
            "mov.u32 $0, 0; }", "=r,l,r", [ptr + offs, ok], dtype=tl.int32, is_pure=False, pack=1)
    else:
        offs = base + tl.arange(0, CHUNK // LINE) * LINE
        ok = (offs < limit).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
            "=r,l,r", [ptr + offs, ok], dtype=tl.int32, is_pure=False, pack=1)


def prefetch(w, nbytes, bulk):
    data, scale = w[0], w[1]
    a_bytes = min(nbytes, data.numel())
    b_bytes = min(nbytes // 8, scale.numel())
    a_programs = triton.cdiv(a_bytes, CHUNK)
    grid = (a_programs + triton.cdiv(b_bytes, CHUNK),)
    _prefetch_kernel[grid](data, a_bytes, a_programs, scale, b_bytes, BULK=bulk, CHUNK=CHUNK, LINE=LINE,
                           num_warps=4 if not bulk else 1)


def weights(k, n, copies):
    out = []
    for _ in range(copies):
        q = nv.quantize(torch.randn(n, k, dtype=torch.bfloat16, device="cuda"))
        out.append((*ops.tile_weight(q.data, q.scale.view(torch.uint8)), q.global_scale, n))
    return out


def gemm(x, w):
    return gemm_splitk(x, w[0], w[1], w[2], None, torch.bfloat16, False, tiled_n=w[3])


SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate/up": (4096, 28672), "down": (14336, 4096)}
# (A, B, spin us, prefetched bytes of B in MB; None: all)
SCENARIOS = [
    ("qkv", "o", 2, None), ("qkv", "o", 5, None), ("qkv", "o", 10, None),
    ("o", "gate/up", 3, 8), ("o", "gate/up", 3, 16),
    ("gate/up", "down", 1.5, 4), ("gate/up", "down", 1.5, 8),
    ("down", "qkv", 3, 8), ("down", "qkv", 3, None),
]


def main():
    torch.manual_seed(0)
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    copy = copy_bandwidth_gbs()
    l2 = torch.cuda.get_device_properties().L2_cache_size
    print(f"device copy: {copy:.0f} GB/s, L2 {l2 / 2**20:.0f} MiB")
    copies = {}
    for name, (k, n) in SHAPES.items():
        copies[name] = weights(k, n, max(2, math.ceil(3 * l2 / (n * k * 0.5625))))
    spin_out = torch.zeros(1, dtype=torch.int32, device="cuda")
    x = {k: torch.randn(1, k, dtype=torch.bfloat16, device="cuda") for k in (4096, 14336)}

    def spin(us):
        _spin_kernel[(1,)](spin_out, int(us * 1000), num_warps=1)

    print(f"spin 0 / 2 / 10 us alone: " + " / ".join(
        f"{graph_us(lambda: spin(t), calls=20):.2f}" for t in (0, 2, 10)) + " us")
    for name, ws in copies.items():
        k = SHAPES[name][0]
        alone = graph_us(lambda: [gemm(x[k], w) for w in ws], calls=3) / len(ws)
        pf = [graph_us(lambda: [prefetch(w, 1 << 40, bulk) for w in ws], calls=3) / len(ws)
              for bulk in (False, True)]
        nbytes = ws[0][0].numel() + ws[0][1].numel()
        print(f"{name:8s} GEMM alone {alone:6.1f} us ({nbytes / alone / 1e3:.0f} GB/s); prefetch kernel alone, "
              f"all {nbytes / 2**20:.1f} MiB: lines {pf[0]:.1f} us, bulk {pf[1]:.1f} us "
              f"(at copy bandwidth / 2: {nbytes / (copy / 2) / 1e3:.1f} us)")

    print(f"\n{'A':>8} {'B':>8} {'spin':>5} {'MiB':>5} | {'plain':>7} {'lines':>7} {'bulk':>7} | saved lines, bulk")
    for a, b, t, mb in SCENARIOS:
        wa, wb = copies[a], copies[b]
        xa, xb = x[SHAPES[a][0]], x[SHAPES[b][0]]
        count = max(len(wa), len(wb))
        nbytes = (1 << 40) if mb is None else mb << 20

        def sequence(mode):
            for i in range(count):
                gemm(xa, wa[i % len(wa)])
                if mode:
                    prefetch(wb[i % len(wb)], nbytes, mode == "bulk")
                spin(t)
                gemm(xb, wb[i % len(wb)])

        times = [graph_us(lambda: sequence(mode), calls=2) / count for mode in (None, "lines", "bulk")]
        shown = "all" if mb is None else str(mb)
        print(f"{a:>8} {b:>8} {t:5.1f} {shown:>5} | " + " ".join(f"{v:7.1f}" for v in times)
              + f" | {times[0] - times[1]:5.1f} {times[0] - times[2]:5.1f}", flush=True)


if __name__ == "__main__":
    main()
