"""Probe: the Inductor NVFP4 GEMM template (one linear compiled through backend="nvfp4") against
the eager nvfp4.linear_tiled op on the same weights, per CUDA kernel (torch.profiler), M x N x K.

    python benchmarks/probe_template.py [--m 1 16 64] [--code DIR] [--template-max-m M]

Prints, per shape, each kernel's average time over 50 calls for both (launch gaps excluded), so the
template's mainloop and the fused reduction can be compared with the eager kernels they replace.
"""

import argparse
import collections
import logging
from pathlib import Path

import torch
from torch import nn
from torch._inductor.utils import run_and_get_code
from torch.profiler import ProfilerActivity, profile

import nvfp4_inductor as nv
from nvfp4_inductor.kernels import gemm_configs

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (28672, 8192)]  # (N, K)


def kernel_times(fn, calls=50):
    """-> {kernel name: average us per call} over `calls` calls of fn (after 5 warm-up calls)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.name[:60]] += event.device_time / calls  # us
    return dict(times)


def cache_bypass_reasons() -> list[str]:
    """Compile a small CPU model through the backend, -> the FX graph cache's bypass messages."""
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("torch._inductor.codecache")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.INFO)
    try:
        torch._dynamo.reset()
        model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64)).to(torch.bfloat16)
        nv.compile(model, nv.Config(activations="bf16"))(torch.randn(4, 64, dtype=torch.bfloat16))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)
    return [r for r in records if "ypass" in r]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--m", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--code", type=Path, default=None, help="write the generated code here")
    parser.add_argument("--template-max-m", type=int, default=None,
                        help="override gemm_configs.TEMPLATE_MAX_M (the template's default range)")
    parser.add_argument("--no-cache-check", action="store_true")
    args = parser.parse_args()
    if args.template_max_m is not None:
        gemm_configs.TEMPLATE_MAX_M = args.template_max_m
    if not args.no_cache_check:
        print("FX graph cache bypass messages (CPU model):", cache_bypass_reasons())
    for m in args.m:
        for n, k in SHAPES:
            torch._dynamo.reset()
            torch.manual_seed(0)
            linear = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            compiled = nv.compile(linear, nv.Config(activations="bf16"))
            _, code = run_and_get_code(compiled, x)
            if args.code is not None and (m, n, k) == (args.m[0], *SHAPES[1]):
                args.code.mkdir(parents=True, exist_ok=True)
                (args.code / f"linear_m{m}_n{n}_k{k}.py").write_text("\n".join(code))
            data, scale, g = torch.ops.nvfp4.quantize(linear.weight.detach(), None, False, False)
            data, scale = torch.ops.nvfp4.tile_weight(data, scale)
            eager = kernel_times(lambda: torch.ops.nvfp4.linear_tiled(x, data, scale, g, None, n, "bf16"))
            comp = kernel_times(lambda: compiled(x))
            print(f"M={m} N={n} K={k}: eager {sum(eager.values()):.1f} us {eager}")
            print(f"{'':{len(f'M={m} N={n} K={k}: ')}}compiled {sum(comp.values()):.1f} us {comp}", flush=True)


if __name__ == "__main__":
    main()
