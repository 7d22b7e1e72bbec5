"""Check this package on this device: its kernels and the compiled backend against the reference.

    python -m nvfp4_inductor check [--device cuda|cpu] [--seed S] [--quick] [--shape N K] [--only NAME]

Each check runs a kernel (or the `backend="nvfp4"` compile) on fresh random inputs, odd shapes
among them, and compares it with the pure-torch reference (the `nvfp4::` ops on CPU tensors):
codes, block scales and dequantized values bit for bit, GEMMs within a relative error (the bound
the GEMM tests hold them to). One line per check, `PASS` or `FAIL name: detail`; a check that
raises is a FAIL with its error, and the others still run. Then which GEMM kernel plan.plan_gemm
picks for each M on this device, and, on CUDA, NVFP4 against bf16 times at M = 1, 16, 128, 4096.
Exit status 0 when every check passed, 1 otherwise.

On the CPU the Triton kernels run only under Triton's interpreter (TRITON_INTERPRET=1 in the
environment before the kernels are first used); without it the ops run the reference, the kernel
checks are skipped (said so, not a failure) and only the compiled backend is checked.
"""

import argparse
import contextlib
import copy
import importlib.metadata
import math
import os
import random
import re
import statistics
import time
import warnings
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nvfp4_inductor import api, checks, ops
from nvfp4_inductor.config import Config
from nvfp4_inductor.format import BLOCK_SIZE
from nvfp4_inductor.kernels import gemm, plan
from nvfp4_inductor.modules.convert import convert
from nvfp4_inductor.ops import grouped as grouped_ops
from nvfp4_inductor.reference import scale_search, tiled

__all__ = ["add_arguments", "main"]

# Relative error (Frobenius norm of the difference over the reference's) of a GEMM against the
# reference: what tests/kernels/test_gemm_linear.py holds the CUDA kernels to; the interpreter
# rounds fp32 -> bf16 by truncation (up to an ulp), which its tests allow for with 1e-2.
GEMM_TOLERANCE = {"cuda": 1e-3, "interpreter": 1e-2}
# Two linears with a bf16 hidden state between them: a last-bit difference in the hidden state
# (a different fp32 summation order) moves the second product by up to an ulp of bf16.
MLP_TOLERANCE = 1e-2
PLAN_MS = (1, 16, 32, 64, 128, 512, 4096)
TIMING_MS = (1, 16, 128, 4096)


class Mismatch(Exception):
    """A kernel's result differs from the reference (the message says where and by how much)."""


class Check(NamedTuple):
    """One line of the report: its name, and what it runs."""

    name: str
    run: Callable  # (device, generator, quick) -> detail str; raises Mismatch
    needs_kernels: bool  # False: meaningful where the ops run the reference too


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `check` command's options."""
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where to run (default: cuda if available, else cpu)")
    parser.add_argument("--seed", type=int, default=None, help="seed of the random inputs (default: random, printed)")
    parser.add_argument("--quick", action="store_true",
                        help="fewer and smaller shapes (always so on the CPU)")
    parser.add_argument("--shape", type=int, nargs=2, metavar=("N", "K"), default=(4096, 4096),
                        help="the linear's out and in features for the plan and the times (default: 4096 4096)")
    parser.add_argument("--only", nargs="+", metavar="NAME", default=None,
                        help="run only the checks whose names contain one of these words")
    parser.set_defaults(run=main)


def kernels_run(device: torch.device) -> bool:
    """Whether the Triton kernels run on this device: CUDA, or the CPU under the interpreter."""
    return device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


# --- inputs and comparisons --------------------------------------------------------------------

def sample(gen: torch.Generator, shape: tuple, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """Normal values, rows of magnitudes 1..2^4 apart, outliers every 97th element and one
    all-zero block -> (shape) of dtype, on the CPU."""
    x = torch.randn(shape, generator=gen) * torch.rand((*shape[:-1], 1), generator=gen).mul(4).exp2()
    flat = x.reshape(-1)
    flat[::97] *= 20.0
    if shape[-1] >= 2 * BLOCK_SIZE:
        flat[BLOCK_SIZE:2 * BLOCK_SIZE] = 0.0
    return x.to(dtype)


def assert_equal(what: str, got: Tensor, want: Tensor) -> None:
    """Bit-exact: same shape, dtype and values (NaN where the reference has NaN)."""
    got = got.cpu()
    if got.shape != want.shape or got.dtype != want.dtype:
        raise Mismatch(f"{what}: got {got.dtype} {tuple(got.shape)}, want {want.dtype} {tuple(want.shape)}")
    if got.dtype in (torch.uint8, torch.int32, torch.int64):
        differ = got != want
    else:
        differ = ~((got == want) | (got.isnan() & want.isnan()))
    if differ.any():
        raise Mismatch(f"{what}: {int(differ.sum())} of {differ.numel()} elements differ")


def relative_error(got: Tensor, want: Tensor) -> float:
    """||got - want|| / ||want|| in fp64."""
    got, want = got.double().cpu(), want.double().cpu()
    return ((got - want).norm() / want.norm()).item()


def assert_close(what: str, got: Tensor, want: Tensor, tolerance: float) -> float:
    """GEMM outputs: same shape and dtype, relative error at most tolerance -> the error."""
    if got.shape != want.shape or got.dtype != want.dtype:
        raise Mismatch(f"{what}: got {got.dtype} {tuple(got.shape)}, want {want.dtype} {tuple(want.shape)}")
    error = relative_error(got, want)
    if not error <= tolerance:  # (NaN fails too)
        raise Mismatch(f"{what}: relative error {error:.2e} > {tolerance:.0e}")
    return error


def on(device: torch.device, q: api.NVFP4) -> api.NVFP4:
    """An NVFP4 moved to device."""
    return q._replace(data=q.data.to(device), scale=q.scale.to(device), global_scale=q.global_scale.to(device))


def dequantize_dtypes(device: torch.device) -> tuple:
    """Output dtypes to compare bit for bit: the Triton 3.6 interpreter truncates fp32 -> bf16
    where the GPU rounds to nearest even, so bf16 is compared on CUDA only."""
    return (torch.bfloat16, torch.float16, torch.float32) if device.type == "cuda" else (torch.float16, torch.float32)


def gemm_tolerance(device: torch.device) -> float:
    """GEMM_TOLERANCE for where the kernels run."""
    return GEMM_TOLERANCE["cuda" if device.type == "cuda" else "interpreter"]


def shapes(quick: bool) -> list[tuple]:
    """Odd shapes: a single block, odd rows, K not a multiple of 64, 3-D; larger ones unless quick."""
    few = [(1, 16), (37, 80), (3, 5, 64)]
    return few if quick else few + [(157, 4096), (300, 272)]


# --- the checks --------------------------------------------------------------------------------
# Each kernel is called through its launcher (nvfp4_inductor.kernels.*, imported on first use as
# ops/dense.py imports them, so that the interpreter setting is read when they are first defined): on
# the CPU the ops would run the reference itself. The reference is the op on CPU tensors.

def check_quantize(per_row: bool, swizzle: bool) -> Callable:
    """The quantize kernel (dynamic global scale: per tensor or per row; plain or swizzled scales)."""
    def run(device, gen, quick):
        from nvfp4_inductor.kernels import quantize as quantize_kernels

        done = []
        for i, shape in enumerate(shapes(quick)):
            dtype = (torch.bfloat16, torch.float16, torch.float32)[i % 3]
            x = sample(gen, shape, dtype)
            if i:
                x.view(-1)[-5] = math.nan  # its block: NaN scale, zero codes; the others unaffected
            got = quantize_kernels.quantize(x.to(device), None, per_row, swizzle)
            want = ops.quantize(x, None, per_row, swizzle)
            for part, a, b in zip(("codes", "scales", "global scale"), got, want):
                assert_equal(f"{part} of {tuple(shape)} {dtype}", a, b)
            done.append("x".join(map(str, shape)))
        return f"codes, scales and global scales bit-exact at {', '.join(done)} (a NaN block in all but the first)"
    return run


def check_dequantize(device, gen, quick) -> str:
    """The dequantize kernel on whole tensors."""
    from nvfp4_inductor.kernels import dequantize as dequantize_kernels

    done = []
    for i, shape in enumerate(shapes(quick)):
        per_row, swizzled = i % 2 == 1, i % 3 != 0
        q = api.quantize(sample(gen, shape).float(), per_row=per_row, swizzle=swizzled)
        bits = q.scale.view(torch.uint8)
        for dtype in dequantize_dtypes(device):
            got = dequantize_kernels.dequantize(q.data.to(device), bits.to(device), q.global_scale.to(device),
                                                swizzled, dtype)
            want = ops.dequantize(q.data, bits, q.global_scale, swizzled, dtype)
            assert_equal(f"{tuple(shape)} -> {dtype}", got, want)
        done.append("x".join(map(str, shape)))
    dtypes = ", ".join(str(dtype).removeprefix("torch.") for dtype in dequantize_dtypes(device))
    return (f"{dtypes} bit-exact (plain and swizzled scales, per-tensor and per-row global scales) "
            f"at {', '.join(done)}")


def check_dequantize_rows(device, gen, quick) -> str:
    """The dequantize kernel on rows gathered by index (nvfp4::dequantize_rows)."""
    from nvfp4_inductor.kernels import dequantize as dequantize_kernels

    done = []
    for i, (rows, k) in enumerate([(1, 16), (37, 80), (300, 272)][:2 if quick else 3]):
        per_row, swizzled = i % 2 == 0, i % 2 == 1
        q = api.quantize(sample(gen, (rows, k)), per_row=per_row, swizzle=swizzled)
        bits = q.scale.view(torch.uint8)
        indices = torch.randint(0, rows, (2, 3), generator=gen)  # repeats and any order
        dtype = dequantize_dtypes(device)[0]
        got = dequantize_kernels.dequantize(q.data.to(device), bits.to(device), q.global_scale.to(device),
                                            swizzled, dtype, indices.to(device))
        want = ops.dequantize_rows(q.data, bits, q.global_scale, swizzled, indices, dtype)
        assert_equal(f"rows of {rows}x{k}", got, want)
        done.append(f"{rows}x{k}")
    return f"{str(dtype).removeprefix('torch.')} bit-exact at {', '.join(done)} (2x3 indices)"


def check_scale_search(device, gen, quick) -> str:
    """The pruned scale-search kernel against the reference's search over every candidate."""
    from nvfp4_inductor.kernels import scale_search as search_kernels

    done = []
    for rows, k in [(5, 48), (33, 64)] if quick else [(5, 48), (33, 64), (130, 1024)]:
        w = sample(gen, (rows, k))
        data, bits, g, _ = search_kernels.search(w.to(device), None, "mse")
        want_data, want_scale, want_g = scale_search.quantize(w, None, "mse")
        assert_equal(f"global scale of {rows}x{k}", g, want_g)
        assert_equal(f"chosen scales of {rows}x{k}", bits, want_scale.view(torch.uint8))
        assert_equal(f"codes of {rows}x{k}", data, want_data)
        done.append(f"{rows}x{k}")
    return f'method="mse": chosen scales and codes bit-exact at {", ".join(done)}'


def linear_ms(quick: bool) -> tuple:
    """Rows of x for the GEMM checks: decode sizes (each mainloop), and above them unless quick."""
    return (1, 7, 20) if quick else (1, 7, 16, 33, 128, 300)


def runnable(m: int, n: int, k: int, tiled: bool, activation: str, device: torch.device) -> bool:
    """Whether plan's kernel for M rows runs here: dequantize + cuBLASLt needs CUDA."""
    return device.type == "cuda" or plan.plan_gemm(m, n, k, tiled=tiled, activation=activation,
                                                   device=device).kernel != "dequant_cublas"


def check_linear(activation: str) -> Callable:
    """nvfp4::linear's CUDA implementation (row-major weights, plain or swizzled scales) at linear_ms."""
    def run(device, gen, quick):
        n, k = (48, 96) if quick else (80, 1056)
        done, skipped, worst = [], [], 0.0
        for i, m in enumerate(linear_ms(quick)):
            if not runnable(m, n, k, False, activation, device):
                skipped.append(m)
                continue
            swizzled, per_row = i % 2 == 1, i % 3 == 2
            w = api.quantize(sample(gen, (n, k)), per_row=per_row, swizzle=swizzled)
            x, bias = sample(gen, (m, k)), sample(gen, (n,))
            want = api.linear(x, w, bias, activations=activation)
            wd = on(device, w)
            got = gemm.linear(x.to(device), wd.data, wd.scale.view(torch.uint8), wd.global_scale, bias.to(device),
                              swizzled, activation)
            worst = max(worst, assert_close(f"M={m}", got, want, gemm_tolerance(device)))
            done.append(m)
        note = f"; M={', '.join(map(str, skipped))} skipped (dequantize + cuBLASLt needs CUDA)" if skipped else ""
        return (f"nv.linear N={n} K={k} at M={', '.join(map(str, done))}: relative error <= {worst:.1e} "
                f"(tolerance {gemm_tolerance(device):.0e}){note}")
    return run


def check_nvfp4_linear(activation: str) -> Callable:
    """An nn.Linear converted by nv.convert (tiled weights): its eager path on CUDA, else
    nvfp4::linear_tiled's CUDA implementation, at linear_ms."""
    def run(device, gen, quick):
        n, k = (48, 96) if quick else (1056, 1040)  # K padded to whole 64-wide tiles
        linear = nn.Linear(k, n).to(torch.bfloat16)
        with torch.no_grad():
            linear.weight.copy_(sample(gen, (n, k)))
            linear.bias.copy_(sample(gen, (n,)))
        model = nn.Sequential(linear)
        report = convert(model, Config(activations=activation))
        if report.skipped:
            raise Mismatch(f"nv.convert skipped the layer: {report.skipped}")
        layer = model[0]
        done, skipped, worst = [], [], 0.0
        layer_on_device = copy.deepcopy(layer).to(device) if device.type == "cuda" else None
        for m in linear_ms(quick):
            if not runnable(m, n, k, True, activation, device):
                skipped.append(m)
                continue
            x = sample(gen, (m, k))
            with torch.no_grad():
                want = layer(x)  # CPU tensors: the reference
                if layer_on_device is not None:  # the module's eager path, twice: its bound launch too
                    got = [layer_on_device(x.to(device)) for _ in range(2)]
                else:
                    parts = (layer.weight, layer.weight_scale, layer.weight_scale_2, layer.bias)
                    got = [gemm.linear_tiled(x.to(device), *(t.to(device) for t in parts), n, activation)]
            for y in got:
                worst = max(worst, assert_close(f"M={m}", y, want, gemm_tolerance(device)))
            done.append(m)
        note = f"; M={', '.join(map(str, skipped))} skipped (dequantize + cuBLASLt needs CUDA)" if skipped else ""
        return (f"nv.convert(nn.Linear({k}, {n})) at M={', '.join(map(str, done))}: relative error <= "
                f"{worst:.1e} (tolerance {gemm_tolerance(device):.0e}){note}")
    return run


# Tokens an expert: odd counts, an expert with none, and rows past the last group (which stay zero).
EXPERT_TOKENS = (7, 0, 12, 1, 9)


def check_grouped(activation: str) -> Callable:
    """The grouped MoE kernels (ops.grouped.grouped_cuda) on tiled experts, plain (with bias) and gated
    (SiLU(gate) * up, without), against the ops' reference loop of dense linears."""
    def run(device, gen, quick):
        k, leftover = (144, 3) if quick else (1040, 5)
        offsets = torch.tensor(EXPERT_TOKENS).cumsum(0).to(torch.int32)
        t = int(offsets[-1]) + leftover
        worst = 0.0
        for gated in (False, True):
            n = 96 if gated else 48  # gated: halves not a whole tile
            w = sample(gen, (len(EXPERT_TOKENS), n, k)).float()
            w = w * torch.logspace(-2, 2, len(EXPERT_TOKENS))[:, None, None]  # experts of other magnitudes
            experts = [api.quantize(w_e) for w_e in w]
            codes, bits = tiled.tile_experts(torch.stack([q.data for q in experts]),
                                             torch.stack([q.scale.view(torch.uint8) for q in experts]), gated)
            g = torch.stack([q.global_scale for q in experts])
            bias = None if gated else sample(gen, (len(EXPERT_TOKENS), n))
            x = sample(gen, (t, k))
            op = grouped_ops.grouped_linear_tiled_silu_mul if gated else grouped_ops.grouped_linear_tiled
            want = op(x, offsets, codes, bits, g, bias, n, activation)
            args = [None if a is None else a.to(device) for a in (x, offsets, codes, bits, g, bias)]
            with warnings.catch_warnings():
                # SiLU's exp(-gate) overflows to inf for gates below about -88 (SiLU is then -0, as
                # it should be); the interpreter's numpy warns about it
                warnings.filterwarnings("ignore", "overflow encountered in exp", RuntimeWarning)
                got = grouped_ops.grouped_cuda(*args, n, activation, gated)
            what = "gated" if gated else "plain"
            start = 0
            for e, end in enumerate(offsets.tolist()):  # per expert: their magnitudes are 10^4 apart
                if end > start:
                    worst = max(worst, assert_close(f"{what}, expert {e}", got[start:end], want[start:end],
                                                    gemm_tolerance(device)))
                start = end
            if got[start:].any():
                raise Mismatch(f"{what}: rows past the last expert's are not zero")
        return (f"{len(EXPERT_TOKENS)} experts, tokens {'/'.join(map(str, EXPERT_TOKENS))} + {leftover} "
                f"unrouted, K={k}, plain and gated: relative error <= {worst:.1e} "
                f"(tolerance {gemm_tolerance(device):.0e})")
    return run


def nvfp4_calls(code: str) -> list[str]:
    """What NVFP4 work generated code runs outside its comments: `nvfp4::` ops, the NVFP4 GEMM
    template (its kernels import nvfp4_inductor.kernels) and the extern GEMM choices."""
    lines = [line for line in code.splitlines() if not line.strip().startswith(("#", "assert"))]
    source = "\n".join(lines)
    found = sorted(set(re.findall(r"torch\.ops\.nvfp4\.(\w+)", source)))
    if "from nvfp4_inductor.kernels" in source:
        found.append("template")
    found += sorted(set(re.findall(r"extern_kernels\.(nvfp4_\w+)", source)))
    return found


class MLP(nn.Module):
    """(..., K) -> (..., K): up (with bias), ReLU, down (without)."""

    def __init__(self, k: int, hidden: int):
        super().__init__()
        self.up = nn.Linear(k, hidden)
        self.down = nn.Linear(hidden, k, bias=False)

    def forward(self, x):
        return self.down(F.relu(self.up(x)))


def check_compiled(activation: str) -> Callable:
    """torch.compile(backend="nvfp4") of a bf16 MLP against its linears quantized and multiplied by
    the reference, and its code checked for NVFP4 ops or kernels."""
    def run(device, gen, quick):
        from torch._inductor.utils import run_and_get_code

        k, hidden = (64, 128) if quick else (256, 1024)
        model = MLP(k, hidden).to(torch.bfloat16).eval()
        with torch.no_grad():
            for linear in (model.up, model.down):
                linear.weight.copy_(sample(gen, tuple(linear.weight.shape)) * 0.05)
            model.up.bias.copy_(sample(gen, (hidden,)))
        ms = (3,) if quick or device.type != "cuda" else (1, 16, 300)
        xs = [sample(gen, (m, k)) for m in ms]
        with torch.no_grad():  # the reference: each linear quantized and multiplied on CPU tensors
            wants = [api.linear(F.relu(api.linear(x, api.quantize(model.up.weight), model.up.bias,
                                                  activations=activation)),
                                api.quantize(model.down.weight), activations=activation) for x in xs]
        model.to(device)
        torch._dynamo.reset()  # a fresh compile: its code is what is checked
        compiled = torch.compile(model, backend="nvfp4", dynamic=False,  # one graph an M, each checked
                                 options={"nvfp4": Config(activations=activation)})
        worst, calls = 0.0, set()
        with torch.no_grad():
            for m, x, want in zip(ms, xs, wants):
                y, code = run_and_get_code(compiled, x.to(device))
                found = nvfp4_calls("\n".join(code))
                if not found:
                    raise Mismatch(f"M={m}: the compiled code runs no NVFP4 op or kernel")
                calls.update(found)
                worst = max(worst, assert_close(f"M={m}", y, want, MLP_TOLERANCE))
        torch._dynamo.reset()
        return (f"torch.compile(MLP({k}, {hidden}), backend='nvfp4') at M={', '.join(map(str, ms))}: "
                f"relative error <= {worst:.1e} (tolerance {MLP_TOLERANCE:.0e}); runs {', '.join(sorted(calls))}")
    return run


CHECKS = [
    Check("quantize per-tensor", check_quantize(per_row=False, swizzle=False), True),
    Check("quantize per-row", check_quantize(per_row=True, swizzle=False), True),
    Check("quantize swizzled", check_quantize(per_row=False, swizzle=True), True),
    Check("dequantize", check_dequantize, True),
    Check("dequantize_rows", check_dequantize_rows, True),
    Check("scale search mse", check_scale_search, True),
    Check("linear W4A16", check_linear("bf16"), True),
    Check("linear W4A4", check_linear("nvfp4"), True),
    Check("NVFP4Linear W4A16", check_nvfp4_linear("bf16"), True),
    Check("NVFP4Linear W4A4", check_nvfp4_linear("nvfp4"), True),
    Check("grouped MoE W4A16", check_grouped("bf16"), True),
    Check("grouped MoE W4A4", check_grouped("nvfp4"), True),
    Check("compiled W4A16", check_compiled("bf16"), False),
    Check("compiled W4A4", check_compiled("nvfp4"), False),
]


# --- the plan and the times --------------------------------------------------------------------

def plan_cell(m: int, n: int, k: int, *, tiled: bool, activation: str, device: torch.device,
              compiled: bool = False) -> str:
    """plan.plan_gemm's choice as "kernel/mainloop" (+ "x nvfp4" where x enters as codes)."""
    chosen = plan.plan_gemm(m, n, k, tiled=tiled, activation=activation, device=device, compiled=compiled,
                            code_bytes=n * k // 2 if tiled else 0)
    cell = chosen.kernel + (f"/{chosen.mainloop}" if chosen.mainloop else "")
    return cell + (" x nvfp4" if chosen.x_format == "nvfp4" else "")


def print_plan(n: int, k: int, device: torch.device) -> None:
    """The table of plan.plan_gemm's choices at PLAN_MS rows: eager and compiled, W4A16 and W4A4."""
    columns = [("nv.linear W4A16", dict(tiled=False, activation="bf16")),
               ("NVFP4Linear W4A16", dict(tiled=True, activation="bf16")),
               ("NVFP4Linear W4A4", dict(tiled=True, activation="nvfp4")),
               ("compiled W4A16", dict(tiled=True, activation="bf16", compiled=True)),
               ("compiled W4A4", dict(tiled=True, activation="nvfp4", compiled=True))]
    print(f"\nGEMM path by M (plan.plan_gemm, N={n} K={k}, {device.type}):")
    print((f"{'M':>5}  " + "  ".join(f"{name:<22}" for name, _ in columns)).rstrip())
    for m in PLAN_MS:
        cells = [plan_cell(m, n, k, device=device, **kw) for _, kw in columns]
        print((f"{m:>5}  " + "  ".join(f"{cell:<22}" for cell in cells)).rstrip())
    if device.type != "cuda":
        print("(on the CPU: dequant_cublas needs CUDA, and the compiled graph calls the nvfp4:: ops unless "
              "Inductor's CPU backend is \"triton\")")


def graph_us(fn: Callable, inputs: list, min_calls: int = 32, reps: int = 10) -> float:
    """Median GPU time of one fn(w) in microseconds, from CUDA-graph replays of calls cycling
    through inputs (together larger than L2, so that each call reads its weights from memory);
    a graph leaves out the host's launch time, which a model compiled with CUDA graphs has not."""
    rounds = max(1, math.ceil(min_calls / len(inputs)))
    for w in inputs:  # warm-up: compiles the kernels, binds the launches
        fn(w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(rounds):
            for w in inputs:
                fn(w)
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (rounds * len(inputs)))
    return statistics.median(times)


def print_times(n: int, k: int, device: torch.device) -> None:
    """bf16 F.linear against nvfp4::linear_tiled (what NVFP4Linear and backend="nvfp4" run) at
    TIMING_MS rows, weights (N, K) in copies 3x the L2 per format."""
    l2 = torch.cuda.get_device_properties(device).L2_cache_size

    def copies(nbytes: float) -> int:
        return max(2, math.ceil(3 * l2 / nbytes))

    w_bf16 = [torch.randn(n, k, dtype=torch.bfloat16, device=device) for _ in range(copies(2 * n * k))]
    w_fp4 = []
    for _ in range(copies(n * k * (0.5 + 1 / BLOCK_SIZE))):
        q = api.quantize(torch.randn(n, k, dtype=torch.bfloat16, device=device))
        w_fp4.append((*ops.tile_weight(q.data, q.scale.view(torch.uint8)), q.global_scale))
    print(f"\nTimes (us, median of CUDA-graph replays, weights {len(w_bf16)} bf16 / {len(w_fp4)} NVFP4 copies "
          f"beyond L2), N={n} K={k}; x: bf16 time / NVFP4 time (> 1: NVFP4 faster)")
    print(f"{'M':>5} {'bf16':>9} {'W4A16':>9} {'W4A4':>9} {'W4A16 x':>8} {'W4A4 x':>7}")
    for m in TIMING_MS:
        x = torch.randn(m, k, dtype=torch.bfloat16, device=device)
        bf16 = graph_us(lambda w: F.linear(x, w), w_bf16)
        nvfp4 = [graph_us(lambda w: ops.linear_tiled(x, *w, None, n, activation), w_fp4)
                 for activation in checks.ACTIVATIONS]
        print(f"{m:>5} {bf16:9.1f} " + " ".join(f"{t:9.1f}" for t in nvfp4) + " "
              + " ".join(f"{bf16 / t:{w}.2f}" for t, w in zip(nvfp4, (8, 7))), flush=True)
    del w_bf16, w_fp4


# --- the command -------------------------------------------------------------------------------

def describe(device: torch.device) -> str:
    """-> the device, its capability and the torch / Triton versions, one line."""
    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton = "not installed"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        where = (f"{props.name}, sm_{props.major}{props.minor}, {props.multi_processor_count} SMs, "
                 f"{props.total_memory / 2**30:.0f} GiB")
    else:
        where = f"{device.type}" + (" (Triton interpreter)" if kernels_run(device) else "")
    return f"device: {where}; torch {torch.__version__}, triton {triton}"


def run_check(check: Check, device: torch.device, seed: int, quick: bool) -> bool:
    """Run one check, print its line -> passed."""
    gen = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    try:
        detail = check.run(device, gen, quick)
    except Exception as error:  # a crash is a failure of this check; the others still run
        message = str(error).strip().splitlines()
        print(f"FAIL {check.name}: {type(error).__name__}: {message[0] if message else ''}", flush=True)
        return False
    print(f"PASS {check.name}: {detail} [{time.perf_counter() - start:.1f} s]", flush=True)
    return True


def main(args: argparse.Namespace) -> int:
    """Run the checks, print the plan and the times -> 0 if every check passed, else 1."""
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"--device {args.device}: torch sees no CUDA device (torch {torch.__version__})")
        return 1
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    # The interpreter runs a kernel's every program in Python: the large shapes take minutes there.
    quick = args.quick or device.type != "cuda"
    print(describe(device))
    print(f"seed {seed} (rerun with --seed {seed}){', small shapes' if quick else ''}")
    if not kernels_run(device):
        print("NOTE the Triton kernels were not exercised: they run on CUDA, or on the CPU under "
              "TRITON_INTERPRET=1; the ops ran the reference")
    # Triton launches on the current device, whatever the tensors' device.
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        failed = run_all(device, seed, quick, args.only, *args.shape)
    return 1 if failed else 0


def run_all(device: torch.device, seed: int, quick: bool, only: list[str] | None, n: int, k: int) -> int:
    """The checks (those named by `only`), the plan for (N, K) and the times -> how many failed."""
    passed = failed = 0
    chosen = [only is None or any(word in check.name for word in only) for check in CHECKS]
    if not any(chosen):
        print(f"FAIL --only {' '.join(only)}: no check has such a name ({', '.join(c.name for c in CHECKS)})")
        failed += 1
    for i, check in enumerate(CHECKS):  # check i's inputs come from seed + i, also under --only
        if not chosen[i]:
            continue
        if check.needs_kernels and not kernels_run(device):
            print(f"SKIP {check.name}: kernels not run on this device")
        elif run_check(check, device, seed + i, quick):
            passed += 1
        else:
            failed += 1
    try:
        print_plan(n, k, device)
    except Exception as error:
        print(f"FAIL plan: {type(error).__name__}: {error}")
        failed += 1
    if device.type == "cuda":
        try:
            print_times(n, k, device)
        except Exception as error:
            print(f"FAIL timing: {type(error).__name__}: {error}")
            failed += 1
    else:
        print("\nTimes: CUDA only, skipped")
    print(f"\n{passed} checks passed, {failed} failed")
    return failed
