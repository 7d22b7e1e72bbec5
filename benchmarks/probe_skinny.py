"""Where the skinny kernel's time goes at M = 1 on tiled weights: the default configuration against
variants with parts of the work removed (wrong results, timing only) and a launch sweep, bf16
cuBLAS and the NVFP4 weight-read floor from the same run. Not a benchmark of record.

    python benchmarks/probe_skinny.py [--no-sweep | --warps] [--m16]

Variants (source replacements in a copy of gemm_splitk.py):
  nodecode    the word decode replaced by one conversion a byte (the scale multiply kept)
  noscale     block scales not decoded (a constant factor)
  bare        both: what loads, MMAs and the split-K store cost alone
"""

import importlib.util
import inspect
import math
import sys

import torch
import triton
from bench_quantize import copy_bandwidth_gbs, stream_us

import nvfp4_inductor as nv
from nvfp4_inductor import tiled as tiled_layout
from nvfp4_inductor.kernels import gemm_configs
from nvfp4_inductor.kernels import gemm_splitk as gs

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672)]  # (K, N)
DECODE = "low, high = _decode_words(packed, scale)"
SCALE = "scale = tl.broadcast_to(_operand_scale(s_bits.to(tl.int32), OPERAND)[:, :, None],"
VARIANTS = {
    "nodecode": [(DECODE, "low = packed.to(tl.bfloat16) * scale\n        high = low")],
    "noscale": [(SCALE, "scale = tl.broadcast_to((s_bits.to(tl.int32) * 0 + 1).to(OPERAND)[:, :, None],")],
    "bare": [(DECODE, "low = packed.to(tl.bfloat16)\n        high = low"),
             (SCALE, "scale = tl.broadcast_to((s_bits.to(tl.int32) * 0 + 1).to(OPERAND)[:, :, None],")],
}

DECODE_TILE = """    if USE_ASM:
        low, high = _decode_words(packed, scale)
    else:
        low, high = _decode_bytes(packed, scale)
    return tl.reshape(tl.join(low, high), (ROWS, BLOCK_K))"""
PAIRED = """    packed = tl.reshape(packed, (ROWS, BLOCK_K // 4, 2))
    scale = tl.reshape(tl.broadcast_to(tl.reshape(scale, (ROWS, BLOCK_K // BLOCK, 1, BLOCK // 2)),
                                       (ROWS, BLOCK_K // BLOCK, 1, BLOCK // 2)), (ROWS, BLOCK_K // 4, 2))
    if USE_ASM:
        low, high = _decode_words(packed, scale)
    else:
        low, high = _decode_bytes(packed, scale)
    return tl.reshape(tl.permute(tl.join(low, high), (0, 1, 3, 2)), (ROWS, BLOCK_K))"""
QSCALE = "scale = tl.broadcast_to((((s_bits.to(tl.int32) << 4) + 15168).to(tl.int16).to(tl.bfloat16, bitcast=True))[:, :, None],"
VARIANTS["paired"] = [(DECODE_TILE, PAIRED)]
VARIANTS["qscale"] = [(SCALE, QSCALE)]
VARIANTS["paired_qscale"] = [(DECODE_TILE, PAIRED), (SCALE, QSCALE)]


def variant_module(name, replacements):
    source = inspect.getsource(gs)
    for old, new in replacements:
        assert old in source, old
        source = source.replace(old, new)
    source = source.replace("from ..", "from nvfp4_inductor.").replace(
        "from . import", "from nvfp4_inductor.kernels import").replace(
        "from ._common import", "from nvfp4_inductor.kernels._common import")
    path = f"/tmp/gemm_splitk_{name}.py"
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(f"gemm_splitk_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def weights(k, n):
    """bf16 (N, K) weights and their tiled NVFP4 forms, enough copies to exceed L2 twice over."""
    l2 = torch.cuda.get_device_properties().L2_cache_size
    w_bf16 = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda")
              for _ in range(max(2, math.ceil(3 * l2 / (n * k * 2))))]
    tiled = []
    for w in w_bf16:
        q = nv.quantize(w)
        tiled.append((*tiled_layout.tile(q.data, q.scale.view(torch.uint8)), q.global_scale))
    return w_bf16, tiled


def min_steps() -> None:
    """Split count: the shipped rule (about P programs per SM) against capping the splits so each
    runs at least S K-steps (short K ranges spend their time filling the pipeline)."""
    sms = torch.cuda.get_device_properties().multi_processor_count
    print("| K | N | M | bf16 | per-SM rule (splits) | >= 4 steps | >= 8 steps | >= 16 steps |")
    print("|---|---|---|---|---|---|---|---|")
    for k, n in [(4096, 1024), (4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672)]:
        w_bf16, tiled = weights(k, n)
        for m in (1, 16):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            bf16 = stream_us(lambda w: x @ w.T, w_bf16, rounds=2)
            shipped = gemm_configs.splitk_config(m, n, k, sms, tiled=True)  # min_steps 1
            cells = []
            for steps in (None, 4, 8, 16):
                block_m, block_n, block_k, splits, warps, stages = shipped
                if steps is not None:
                    splits = max(1, min(splits, -(-k // block_k) // steps))
                cfg = (block_m, block_n, block_k, splits, warps, stages)
                us = stream_us(lambda p: gs.gemm_splitk(x, *p, None, torch.bfloat16, False, config=cfg,
                                                        tiled_n=n), tiled, rounds=2)
                cells.append(f"{us:.1f} ({splits})")
            print(f"| {k} | {n} | {m} | {bf16:.1f} | " + " | ".join(cells) + " |", flush=True)
        del w_bf16, tiled


def main() -> None:
    if "--min-steps" in sys.argv:
        return min_steps()
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    copy = copy_bandwidth_gbs()
    sms = torch.cuda.get_device_properties().multi_processor_count
    print(f"copy {copy:.0f} GB/s, {sms} SMs")
    modules = {} if "--warps" in sys.argv else {name: variant_module(name, r) for name, r in VARIANTS.items()}
    if "--no-sweep" in sys.argv:
        sweep = []
    elif "--warps" in sys.argv:  # 4 warps: Triton uses wgmma (x^T read from shared memory by the MMA)
        sweep = [(per_sm, warps, stages) for per_sm in (4, 8, 16) for warps in (2, 4) for stages in (3, 4)]
    else:
        sweep = [(per_sm, 2, stages) for per_sm in (4, 8, 12, 16) for stages in (3, 4, 6)]
    header = None
    for k, n in SHAPES:
        w_bf16, tiled = weights(k, n)
        m = 16 if "--m16" in sys.argv else 1
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        ref = gs.gemm_splitk(x, *tiled[0][:3], None, torch.float32, False, tiled_n=n)
        cols = {"bf16": stream_us(lambda w: x @ w.T, w_bf16, rounds=2),
                "floor": n * k * 0.5625 / copy / 1e3}
        cols["default"] = stream_us(lambda p: gs.gemm_splitk(x, *p, None, torch.bfloat16, False, tiled_n=n),
                                    tiled, rounds=2)
        for name, module in modules.items():
            cols[name] = stream_us(lambda p: module.gemm_splitk(x, *p, None, torch.bfloat16, False, tiled_n=n),
                                   tiled, rounds=2)
        for per_sm, warps, stages in sweep:
            cfg = gemm_configs._skinny_config(m, n, k, sms, 64, 64, per_sm, warps, stages)
            y = gs.gemm_splitk(x, *tiled[0][:3], None, torch.float32, False, config=cfg, tiled_n=n)
            assert torch.allclose(y, ref, rtol=1e-4, atol=1e-3), (cfg, (y - ref).abs().max())
            cols[f"{per_sm}/sm w{warps} s{stages}"] = stream_us(
                lambda p: gs.gemm_splitk(x, *p, None, torch.bfloat16, False, config=cfg, tiled_n=n),
                tiled, rounds=2)
        if header is None:
            header = list(cols)
            print("| K | N | " + " | ".join(header) + " |")
            print("|---|---|" + "---|" * len(header))
        print(f"| {k} | {n} | " + " | ".join(f"{cols[c]:.1f}" for c in header) + " |")
        sys.stdout.flush()
        del w_bf16, tiled


if __name__ == "__main__":
    main()
