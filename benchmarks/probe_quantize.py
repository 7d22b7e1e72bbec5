"""Where does the quantize kernel's time go? Variants with one stage left out, same tile and grid,
timed on 16384x8192 bf16 (METHOD: time variants that leave one stage out, take differences).

    python benchmarks/probe_quantize.py
    python benchmarks/probe_quantize.py --decode   # decode-sized x: tile and warps, CUDA-graph latency
    python benchmarks/probe_quantize.py --l2       # x resident in L2: the kernel's issue rate
"""

import torch
import triton
import triton.language as tl

import nvfp4_inductor as nv
from nvfp4_inductor.kernels import quantize as qk
from bench_quantize import _empty_kernel, copies_beyond_l2, copy_bandwidth_gbs, graph_us, stream_us


@triton.jit
def _memory_only_kernel(x_ptr, data_ptr, scale_ptr, K, stride_pairs, tiles_k,
                        STORE_SCALES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Same loads and stores as the quantize tile, trivial arithmetic."""
    t = tl.program_id(0)
    rows = (t // tiles_k) * BLOCK_M + tl.arange(0, BLOCK_M)
    pair_cols = (t % tiles_k) * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    w = tl.load(x_ptr.to(tl.pointer_type(tl.int32)) + rows.to(tl.int64)[:, None] * stride_pairs
                + pair_cols[None, :])
    packed = (w ^ (w >> 13)).to(tl.uint8)
    tl.store(data_ptr + rows.to(tl.int64)[:, None] * (K // 2) + pair_cols[None, :], packed)
    if STORE_SCALES:
        blocks = tl.reshape(w, (BLOCK_M, BLOCK_K // 16, 8))
        bits = tl.max(blocks, axis=2).to(tl.uint8)
        block_cols = (t % tiles_k) * (BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)
        tl.store(scale_ptr + rows.to(tl.int64)[:, None] * (K // 16) + block_cols[None, :], bits)


@triton.jit
def _read_only_kernel(x_ptr, out_ptr, stride_pairs, tiles_k, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    rows = (t // tiles_k) * BLOCK_M + tl.arange(0, BLOCK_M)
    pair_cols = (t % tiles_k) * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    w = tl.load(x_ptr.to(tl.pointer_type(tl.int32)) + rows.to(tl.int64)[:, None] * stride_pairs
                + pair_cols[None, :])
    tl.store(out_ptr + t, tl.sum(tl.sum(w, axis=1), axis=0))


def main() -> None:
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    copy = copy_bandwidth_gbs()
    m, k = 16384, 8192
    n = m * k
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    inputs = copies_beyond_l2(x)
    data = torch.empty(m, k // 2, dtype=torch.uint8, device="cuda")
    scale = torch.empty(m, k // 16, dtype=torch.uint8, device="cuda")
    g = torch.tensor(0.01, device="cuda")
    bm, bk, warps = qk.LARGE_TILE
    tiles_k = k // bk
    grid = (m // bm * tiles_k,)
    out = torch.empty(grid[0], dtype=torch.int32, device="cuda")
    full = 2 * n + n // 2 + n // 16
    rows = [
        ("copy (torch)", None, copy),
    ]
    for name, fn, nbytes in [
        ("read only", lambda x: _read_only_kernel[grid](x, out, k // 2, tiles_k, BLOCK_M=bm, BLOCK_K=bk, num_warps=warps), 2 * n),
        ("read + write codes", lambda x: _memory_only_kernel[grid](x, data, scale, k, k // 2, tiles_k, STORE_SCALES=False, BLOCK_M=bm, BLOCK_K=bk, num_warps=warps), 2 * n + n // 2),
        ("read + write codes + scales", lambda x: _memory_only_kernel[grid](x, data, scale, k, k // 2, tiles_k, STORE_SCALES=True, BLOCK_M=bm, BLOCK_K=bk, num_warps=warps), full),
        ("quantize static (ours)", lambda x: nv.quantize(x, g), full),
    ]:
        us = stream_us(fn, inputs)
        rows.append((name, us, nbytes / us / 1e3))
    print(f"\n{'variant':>30} {'us':>8} {'GB/s':>7} {'% copy':>7}")
    print(f"{'copy (torch)':>30} {'':>8} {copy:7.0f} {100:6.1f}%")
    for name, us, gbs in rows[1:]:
        print(f"{name:>30} {us:8.1f} {gbs:7.0f} {100 * gbs / copy:6.1f}%")


def l2_resident() -> None:
    """x small enough to stay in L2 (2048 x 4096 bf16, 16 MiB, the same tensor every call), so that
    HBM bandwidth does not bound the kernel: its time follows the instructions it issues (the
    H200's large shapes are issue-bound, the H100's are not; this shows the difference on
    either). The loads and stores alone (trivial arithmetic) are the floor."""
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    m, k = 2048, 4096
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    data = torch.empty(m, k // 2, dtype=torch.uint8, device="cuda")
    scale = torch.empty(m, k // 16, dtype=torch.uint8, device="cuda")
    g = torch.tensor(0.01, device="cuda")
    bm, bk, warps = qk.LARGE_TILE
    grid = (m // bm * (k // bk),)
    print(f"x {m} x {k} bf16, in L2; tile {qk.LARGE_TILE}")
    for name, fn in [
        ("loads + stores only", lambda: _memory_only_kernel[grid](x, data, scale, k, k // 2, k // bk, STORE_SCALES=True,
                                                                   BLOCK_M=bm, BLOCK_K=bk, num_warps=warps)),
        ("quantize static", lambda: nv.quantize(x, g)),
        ("quantize static, swizzled", lambda: nv.quantize(x, g, swizzle=True)),
        ("quantize dynamic (2 kernels)", lambda: nv.quantize(x)),
    ]:
        us = graph_us(fn)
        print(f"{name:>30} {us:8.2f} us  {m * k / us / 1e3:7.1f} G elements/s", flush=True)


def decode_tiles() -> None:
    """Latency (CUDA-graph replays) of quantizing decode-sized x with other tiles than _tile's
    (BLOCK_M, BLOCK_K, warps): static, dynamic and values (W4A4's activations) on bf16 x."""
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"empty kernel (graph): {graph_us(lambda: _empty_kernel[(1,)](None)):.2f} us")
    shipped = qk._tile
    g = torch.tensor(0.01, device="cuda")
    variants = {"static": lambda x: nv.quantize(x, g), "dynamic": lambda x: nv.quantize(x),
                "values": lambda x: torch.ops.nvfp4.quantize_values(x)}
    print(f"{'x':>9} {'tile':>16} " + " ".join(f"{v:>8}" for v in variants) + "  (us)")
    for m, k in [(1, 4096), (1, 14336), (4, 4096), (16, 4096)]:
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        want = [fn(x) for fn in variants.values()]
        base = shipped(m, k)
        tiles = [base] + [(base[0], bk, w) for bk in (512, 1024, 2048) for w in (1, 2, 4)
                          if (base[0], bk, w) != base]
        for tile in tiles:
            qk._tile = lambda m_, k_, tile=tile: tile
            try:
                got = [fn(x) for fn in variants.values()]
                for a, b in zip(want, got):  # the same codes, scales, values and g
                    assert all(torch.equal(u.reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8))
                               for u, v in zip(a, b) if isinstance(u, torch.Tensor)), tile
                times = [graph_us(lambda fn=fn: fn(x)) for fn in variants.values()]
            finally:
                qk._tile = shipped
            mark = "*" if tile == base else " "
            print(f"{m:>4}x{k:<5} {str(tile):>15}{mark} " + " ".join(f"{t:8.2f}" for t in times), flush=True)


if __name__ == "__main__":
    import sys

    qk.LAUNCH_PDL = False  # time each kernel on its own, not overlapped with the previous one
    if "--decode" in sys.argv:
        decode_tiles()
    elif "--l2" in sys.argv:
        l2_resident()
    else:
        main()
