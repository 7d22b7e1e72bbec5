"""The W4A4 decode norm: nvfp4.rms_norm_quantize_values (one kernel) against Inductor's RMSNorm
kernel + quantize_values, and the fused kernel's BLOCK_K. CUDA-graph latency of
back-to-back calls, us (bench_quantize.graph_us), with an empty kernel and quantize_values alone.

    python benchmarks/probe_norm_quantize.py
"""

import torch
import triton

import nvfp4_inductor as nv
from nvfp4_inductor.kernels import quantize as qk
from bench_quantize import _empty_kernel, graph_us

BLOCK_KS = [256, 512, 1024, 2048]  # the fused kernel's BLOCK_K (quantize.NORM_BLOCK_K), 4 warps


def main() -> None:
    qk.LAUNCH_PDL = False  # time each kernel on its own, not overlapped with the previous one
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    empty = torch.empty(1, device="cuda")
    print(f"empty kernel {graph_us(lambda: _empty_kernel[(1,)](empty)):.2f} us")
    shipped = qk.NORM_BLOCK_K
    for m, k in ((1, 4096), (2, 4096), (4, 4096)):
        gen = torch.Generator(device="cuda").manual_seed(m)
        h = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
        weight = (torch.rand(k, device="cuda", generator=gen) + 0.5).to(torch.bfloat16)

        def norm(h):
            return nv.reference.rms_norm(h, weight, 1e-5, False)

        compiled = torch.compile(norm)
        y = compiled(h)
        want, want_g = torch.ops.nvfp4.quantize_values(y)
        values, g = torch.ops.nvfp4.rms_norm_quantize_values(h, weight, 1e-5, False)
        differ = int((values != want).sum())
        rows = [("quantize_values alone", lambda: torch.ops.nvfp4.quantize_values(y)),
                ("Inductor norm + quantize_values", lambda: torch.ops.nvfp4.quantize_values(compiled(h)))]
        print(f"\n{m} x {k}: fused vs Inductor norm + quantize_values: {differ} values differ, "
              f"g {g.item():.6g} vs {want_g.item():.6g}; shipped BLOCK_K {shipped}")
        for name, fn in rows:
            print(f"  {name:36s} {graph_us(fn):6.2f} us")
        for block_k in BLOCK_KS:
            qk.NORM_BLOCK_K = block_k
            try:
                us = graph_us(lambda: torch.ops.nvfp4.rms_norm_quantize_values(h, weight, 1e-5, False))
            finally:
                qk.NORM_BLOCK_K = shipped
            print(f"  fused, BLOCK_K {block_k:4d}                   {us:6.2f} us")


if __name__ == "__main__":
    main()
