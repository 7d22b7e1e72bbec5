"""Dynamic per-tensor quantize of decode-sized x: the amax reduced by every quantize program (one
launch, G_FUSED) against the partial-amax pass (two launches), same run, CUDA-graph timed; both
must give the same bits.

    python benchmarks/probe_fused_amax.py
"""

import torch
import triton
from bench_quantize import graph_us

from nvfp4_inductor.kernels import quantize as qk

SHAPES = [(1, 4096), (1, 14336), (4, 4096), (4, 14336), (8, 4096), (16, 4096), (16, 14336)]


def main() -> None:
    qk.LAUNCH_PDL = False  # time each kernel on its own, not overlapped with the previous one
    torch.manual_seed(0)
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    fused_tile = qk.FUSED_AMAX_MAX_TILE
    print(f"{'M':>3} {'K':>6}  {'fused us':>8}  {'two-pass us':>11}  (values: quantize_values; codes: quantize)")
    for m, k in SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 3
        times, outputs = {}, {}
        for name, tile in (("fused", fused_tile), ("two-pass", 0)):
            qk.FUSED_AMAX_MAX_TILE = tile
            for values in (True, False):
                fn = lambda: qk.quantize(x, None, False, False, values=values)  # noqa: E731
                outputs[name, values] = [t for t in fn() if t is not None]
                times[name, values] = graph_us(fn)
        qk.FUSED_AMAX_MAX_TILE = fused_tile
        for values in (True, False):
            same = all(torch.equal(a, b) for a, b in zip(outputs["fused", values], outputs["two-pass", values]))
            assert same, (m, k, values)
            eligible = triton.next_power_of_2(m) * triton.next_power_of_2(k) <= fused_tile
            print(f"{m:>3} {k:>6}  {times['fused', values]:8.2f}  {times['two-pass', values]:11.2f}  "
                  f"{'values' if values else 'codes'}{'' if eligible else ' (above the fused size: both two-pass)'}",
                  flush=True)


if __name__ == "__main__":
    main()
