"""nvfp4_inductor/ops/grouped.py, modules/experts.py and kernels/grouped.py: the grouped expert ops against a loop of dense
NVFP4 linears (bit for bit on the CPU), the Triton kernel against the reference (under the Triton
interpreter without a GPU), and tiny random Hugging Face MoE models converted with
convert_experts for each experts_implementation."""

import json

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import nvfp4_inductor as nv
from nvfp4_inductor import reference
from nvfp4_inductor.kernels import gemm_configs, plan
from nvfp4_inductor.ops import grouped as moe
from nvfp4_inductor.reference import tiled
from nvfp4_inductor.modules.experts import NVFP4Experts, convert_experts
from helpers.hf import LOGIT_TOL, MOE_ARCHITECTURES, MOE_SHAPES, moe_model

transformers = pytest.importorskip("transformers")

OPS = torch.ops.nvfp4


def _grouped(x, offsets, w_data, w_scale, g, bias, n, gated, x_global_scale=None, out_dtype=None, x_scale=None,
             **forced):
    """kernels/grouped.grouped_linear with the planner's launch, K split (splits=) or the dequantize
    form (dequant=) as asked (plan.plan_grouped checks that it runs)."""
    from nvfp4_inductor.kernels import grouped

    launch = grouped.grouped_launch_for(x if x_scale is not None else x.to(torch.bfloat16), w_data, w_scale, n,
                                        gated, x_scale, **forced)
    return grouped.grouped_linear(x, offsets, w_data, w_scale, g, bias, n, gated, x_global_scale, out_dtype,
                                  x_scale=x_scale, launch=launch)


def _experts(e: int, n: int, k: int, gen: torch.Generator, device="cpu"):
    """Fresh random NVFP4 experts (per-expert magnitudes 10^-2..10^2) -> (codes, scale bits, g)."""
    w = torch.randn(e, n, k, generator=gen) * torch.logspace(-2, 2, e)[:, None, None]
    data, scale, g = moe.quantize_experts(w, "rtn")
    return data.to(device), scale.view(torch.uint8).to(device), g.to(device)


def _offsets(counts, device="cpu") -> torch.Tensor:
    return torch.tensor(counts).cumsum(0).to(torch.int32).to(device)


def _op(x, offsets, data, scale, g, bias, activation, gated=False):
    """The grouped op (gated: its SiLU * up form) on row-major experts, tiled here."""
    op = OPS.grouped_linear_tiled_silu_mul if gated else OPS.grouped_linear_tiled
    return op(x, offsets, *tiled.tile_experts(data, scale, gated), g, bias, data.shape[1], activation)


def _kernel_args(device, x, offsets, data, scale, g, b, gated):
    """The kernels' arguments on device: (x, offsets, tiled codes, tiled scale bits, g, b, N)."""
    codes, bits = tiled.tile_experts(data, scale, gated)
    return [a.to(device) if a is not None else None for a in (x, offsets, codes, bits, g, b)] + [data.shape[1]]


def _dense_loop(x, offsets, data, scale, g, bias, activation):
    """The grouped op's definition through the public dense API: nv.linear on each expert's rows."""
    out = torch.zeros(x.shape[0], data.shape[1], dtype=x.dtype)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        w = nv.NVFP4(data[e], scale[e].view(torch.float8_e4m3fn), g[e], torch.Size((data.shape[1], x.shape[1])))
        if end > start:
            out[start:end] = nv.linear(x[start:end], w, None if bias is None else bias[e], activations=activation)
        start = end
    return out


ROUTINGS = {
    "spread": [7, 0, 12, 1, 9],          # odd counts, an expert with none, rows left over past the end
    "one-expert": [0, 0, 31, 0, 0],      # all tokens to one expert
    "first-and-last": [13, 0, 0, 0, 18],
}


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("activation", ["bf16", "nvfp4"])
@pytest.mark.parametrize("bias", [False, True])
def test_grouped_linear_is_a_loop_of_dense_linears(routing, activation, bias):
    """Bit for bit the dense nv.linear on each expert's rows (W4A4: each group quantized with
    its own global scale); rows past offsets[E - 1] (spread: 2 of them) are zero."""
    gen = torch.Generator().manual_seed(len(routing) * 7 + bias)
    counts = ROUTINGS[routing]
    t = sum(counts) + (2 if routing == "spread" else 0)
    data, scale, g = _experts(5, 48, 80, gen)
    x = (torch.randn(t, 80, generator=gen) * 3).to(torch.bfloat16)
    b = torch.randn(5, 48, generator=gen).to(torch.bfloat16) if bias else None
    offsets = _offsets(counts)
    got = _op(x, offsets, data, scale, g, b, activation)
    assert got.dtype == torch.bfloat16 and got.shape == (t, 48)
    assert torch.equal(got, _dense_loop(x, offsets, data, scale, g, b, activation))
    assert not got[sum(counts):].any()


@pytest.mark.parametrize("activation", ["bf16", "nvfp4"])
def test_gated_variant_is_silu_of_gate_times_up(activation):
    """grouped_linear_tiled_silu_mul: per expert, gate rows [0, I) and up rows [I, 2I) as two dense
    linears sharing the expert's global scale, each rounded to x.dtype, then reference.silu_mul."""
    gen = torch.Generator().manual_seed(3)
    e, i, k = 4, 32, 64
    data, scale, g = _experts(e, 2 * i, k, gen)
    x = torch.randn(23, k, generator=gen).to(torch.bfloat16)
    offsets = _offsets([5, 0, 11, 7])
    got = _op(x, offsets, data, scale, g, None, activation, gated=True)
    gate = _dense_loop(x, offsets, data[:, :i].contiguous(), scale[:, :i].contiguous(), g, None, activation)
    up = _dense_loop(x, offsets, data[:, i:].contiguous(), scale[:, i:].contiguous(), g, None, activation)
    assert torch.equal(got, reference.silu_mul(gate, up))


def test_no_tokens_at_all():
    """T = 0 (a batch routed nowhere) and experts all empty: (0, N) and zeros."""
    gen = torch.Generator().manual_seed(4)
    data, scale, g = _experts(3, 32, 32, gen)
    x = torch.randn(0, 32, generator=gen).to(torch.bfloat16)
    assert _op(x, _offsets([0, 0, 0]), data, scale, g, None, "bf16").shape == (0, 32)
    x = torch.randn(5, 32, generator=gen).to(torch.bfloat16)
    assert not _op(x, _offsets([0, 0, 0]), data, scale, g, None, "bf16", gated=True).any()


def test_bad_inputs_are_refused():
    gen = torch.Generator().manual_seed(5)
    data, scale, g = _experts(3, 32, 64, gen)
    codes, bits = tiled.tile_experts(data, scale, False)
    x = torch.randn(9, 64, generator=gen).to(torch.bfloat16)
    offsets = _offsets([3, 3, 3])
    cases = [
        (dict(offsets=offsets.long()), TypeError, "offsets must have dtype int32"),
        (dict(offsets=offsets[:2]), ValueError, r"offsets must have shape \(3,\)"),
        (dict(x=torch.cat([x, x], 1)), ValueError, r"K = 128 must have codes \(3, 4096\)"),
        (dict(x=x[:, :40]), ValueError, "multiple of 16"),
        (dict(x=x[None]), ValueError, "x must be 2-D"),
        (dict(data=codes[0]), ValueError, "w_data must be 2-D"),
        (dict(data=data.view(3, -1).contiguous()), ValueError, "tiled experts of 32 rows"),  # row-major codes
        (dict(scale=bits[:, :16]), ValueError, "scale bits"),
        (dict(n=100), ValueError, "tiled experts of 100 rows"),
        (dict(n=0), ValueError, "must be positive"),
        (dict(g=g[:2]), ValueError, "one per expert"),
        (dict(g=g.double()), TypeError, "w_global_scale must have dtype float32"),
        (dict(bias=torch.zeros(32)), ValueError, r"bias must have shape \(3, 32\)"),
        (dict(activation="fp8"), ValueError, "activation must be one of"),
        # values, which only the reference reads back
        (dict(offsets=torch.tensor([3, 2, 9], dtype=torch.int32)), ValueError, "non-decreasing"),
        (dict(offsets=torch.tensor([3, 3, 10], dtype=torch.int32)), ValueError, r"within \[0, T = 9\]"),
    ]
    for change, error, match in cases:
        args = dict(x=x, offsets=offsets, data=codes, scale=bits, g=g, bias=None, n=32, activation="bf16")
        args.update(change)
        with pytest.raises(error, match=match):
            OPS.grouped_linear_tiled(*args.values())
    odd, odd_bits = tiled.tile_experts(data[:, :31].contiguous(), scale[:, :31].contiguous(), False)
    with pytest.raises(ValueError, match="positive and even"):
        OPS.grouped_linear_tiled_silu_mul(x, offsets, odd, odd_bits, g, None, 31, "bf16")
    with pytest.raises(ValueError, match="N even"):
        OPS.quantize_experts_tiled(torch.randn(2, 31, 32), "rtn", True)


def test_fake_kernels_give_the_shapes():
    gen = torch.Generator().manual_seed(6)
    data, scale, g = _experts(4, 64, 32, gen)
    x = torch.randn(11, 32, generator=gen).to(torch.bfloat16)
    offsets = _offsets([2, 3, 0, 6])
    plain, gated = tiled.tile_experts(data, scale, False), tiled.tile_experts(data, scale, True)
    with FakeTensorMode() as mode:
        fake_x, fake_offsets, fake_g = (mode.from_tensor(t) for t in (x, offsets, g))
        fake_plain, fake_gated = ([mode.from_tensor(t) for t in pair] for pair in (plain, gated))
        y = OPS.grouped_linear_tiled(fake_x, fake_offsets, *fake_plain, fake_g, None, 64, "nvfp4")
        z = OPS.grouped_linear_tiled_silu_mul(fake_x, fake_offsets, *fake_gated, fake_g, None, 64, "bf16")
        assert (y.shape, y.dtype, z.shape, z.dtype) == ((11, 64), torch.bfloat16, (11, 32), torch.bfloat16)
        with pytest.raises(ValueError, match="scale bits"):
            OPS.grouped_linear_tiled(fake_x, fake_offsets, fake_plain[0], fake_plain[1][:, :8], fake_g, None, 64,
                                     "bf16")
        q = OPS.quantize_experts_tiled(mode.from_tensor(torch.randn(4, 40, 32)), "rtn", True)
        assert [tuple(t.shape) for t in q] == [(4, 64 * 64 // 2), (4, 64 * 64 // 16), (4,)]
    torch.library.opcheck(OPS.grouped_linear_tiled, (x, offsets, *plain, g, None, 64, "bf16"),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(OPS.quantize_experts_tiled, (torch.randn(4, 40, 32), "rtn", True),
                          test_utils=("test_schema", "test_faketensor"))


# --- the Triton kernel -------------------------------------------------------------------------

KERNEL_ROUTINGS = {
    "spread": [7, 0, 17, 1, 9],       # 17: a full tile and one row (BLOCK_M 16)
    "one-expert": [0, 0, 0, 0, 37],
    "empty": [0, 0, 0, 0, 0],
}


@pytest.mark.parametrize("routing", KERNEL_ROUTINGS)
@pytest.mark.parametrize("gated, activation, bias", [(False, "bf16", True), (True, "bf16", False),
                                                     (False, "nvfp4", False), (True, "nvfp4", True)])
def test_triton_kernel_matches_the_reference(kernel_device, routing, gated, activation, bias):
    """kernels/grouped.py (the CUDA kernel of both ops; under the interpreter without a GPU) at
    fresh random inputs: the reference's numbers up to fp32 summation order, i.e. bf16 outputs
    equal or one rounding step apart; rows past the groups zero."""
    gen = torch.Generator().manual_seed(11 + gated * 2 + bias)
    counts = KERNEL_ROUTINGS[routing]
    t, n, k = sum(counts) + 3, 96 if gated else 48, 144  # N: gated halves not a tile multiple
    data, scale, g = _experts(5, n, k, gen)
    x = (torch.randn(t, k, generator=gen) * 5).to(torch.bfloat16)
    b = torch.randn(5, n, generator=gen) if bias else None
    offsets = _offsets(counts)
    want = _op(x, offsets, data, scale, g, b, activation, gated)
    got = moe.grouped_cuda(*_kernel_args(kernel_device, x, offsets, data, scale, g, b, gated), activation,
                            gated).cpu()
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-3 * want.float().abs().max().item())
    assert not got[sum(counts):].any()


@pytest.mark.parametrize("routing", KERNEL_ROUTINGS)
@pytest.mark.parametrize("gated, activation, bias", [(False, "bf16", True), (True, "bf16", False),
                                                     (False, "nvfp4", False), (True, "nvfp4", True)])
def test_dequantize_and_grouped_mm_form_matches_the_reference(kernel_device, routing, gated, activation, bias):
    """The prefill form (every expert dequantized, torch._grouped_mm, the scales and bias after it)
    at fresh random inputs: the reference's numbers within one extra rounding (the product is
    rounded to bf16 before the global scale); rows past the groups zero, offsets past T clamped."""
    gen = torch.Generator().manual_seed(31 + gated * 2 + bias)
    counts = KERNEL_ROUTINGS[routing]
    t, n, k = sum(counts) + 3, 96 if gated else 48, 144
    data, scale, g = _experts(5, n, k, gen)
    x = (torch.randn(t, k, generator=gen) * 5).to(torch.bfloat16)
    b = torch.randn(5, n, generator=gen) if bias else None
    offsets = _offsets(counts)
    want = _op(x, offsets, data, scale, g, b, activation, gated)
    args = _kernel_args(kernel_device, x, offsets, data, scale, g, b, gated)
    x_global_scale = None
    if activation == "nvfp4":
        args[0], x_global_scale = moe.group_quantized_values(args[0], args[1])
    got = _grouped(*args, gated, x_global_scale, torch.bfloat16, dequant=True).cpu()
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=1e-3 * want.float().abs().max().item())
    assert not got[sum(counts):].any()
    if routing == "spread":  # an offset past T reads as T
        past = args[1].clone()
        past[-1] = t + 100
        again = _grouped(args[0], past, *args[2:], gated, x_global_scale, torch.bfloat16, dequant=True).cpu()
        assert again[: sum(counts)].equal(got[: sum(counts)])
    if bias:  # a strided bias (every other element of a wider one) is read by its values
        strided = torch.stack([args[5], args[5] * 1000], dim=2).reshape(5, -1)[:, ::2]
        assert not strided.is_contiguous()
        again = _grouped(*args[:5], strided, args[6], gated, x_global_scale, torch.bfloat16, dequant=True).cpu()
        assert again.equal(got)


@pytest.mark.parametrize("routing", KERNEL_ROUTINGS)
@pytest.mark.parametrize("gated, bias", [(False, True), (True, False), (True, True)])
def test_triton_kernel_splits_k(kernel_device, routing, gated, bias):
    """K cut into 2 and 3 ranges (the decode form: partials, the last split sums them and runs
    the epilogue) gives the unsplit kernel's result up to fp32 summation order and the reference's
    within its tolerance, for every routing; the tile counters are left zero for the next launch."""
    from nvfp4_inductor.kernels import launch as launches

    gen = torch.Generator().manual_seed(21 + gated * 2 + bias)
    counts = KERNEL_ROUTINGS[routing]
    t, n, k = sum(counts) + 3, 96 if gated else 48, 3 * gemm_configs.GROUPED_DECODE_CONFIG[2]
    data, scale, g = _experts(5, n, k, gen)
    x = (torch.randn(t, k, generator=gen) * 5).to(torch.bfloat16)
    b = torch.randn(5, n, generator=gen) if bias else None
    offsets = _offsets(counts)
    want = _op(x, offsets, data, scale, g, b, "bf16", gated)
    args = _kernel_args(kernel_device, x, offsets, data, scale, g, b, gated)
    unsplit = _grouped(*args, gated, splits=1).cpu()
    for splits in (2, 3):
        got = _grouped(*args, gated, splits=splits).cpu()
        torch.testing.assert_close(got.float(), unsplit.float(), rtol=2**-7, atol=1e-3 * want.float().abs().max().item())
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7 if not gated else 2**-6,
                                   atol=1e-3 * want.float().abs().max().item())
        assert not got[sum(counts):].any()
    assert not any(c.any() for c in launches._counters.values())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's tl.dot_scaled stand-in (no GPU)")
@pytest.mark.parametrize("routing", KERNEL_ROUTINGS)
@pytest.mark.parametrize("gated, bias", [(False, True), (True, False)])
def test_sm100_block_scaled_kernel_matches_the_reference(sm100, routing, gated, bias):
    """W4A4 on "sm_100": the op's CUDA path hands x's per-group NVFP4 codes and scales and the
    experts' to tl.dot_scaled (DOT_SCALED; the interpreter's stand-in of helpers/dot_scaled.py) at
    fresh random inputs, K split and not: the reference's numbers up to summation order (the
    products are exact), rows past the groups zero."""
    gen = torch.Generator().manual_seed(41 + gated * 2 + bias)
    counts = KERNEL_ROUTINGS[routing]
    t, n, k = sum(counts) + 3, 96 if gated else 48, 3 * gemm_configs.GROUPED_INTERPRET_CONFIG[2] + 16
    data, scale, g = _experts(5, n, k, gen)
    x = (torch.randn(t, k, generator=gen) * 5).to(torch.bfloat16)
    b = torch.randn(5, n, generator=gen) if bias else None
    offsets = _offsets(counts)
    want = _op(x, offsets, data, scale, g, b, "nvfp4", gated)
    from helpers import dot_scaled

    calls = dot_scaled.CALLS[0]
    args = _kernel_args("cpu", x, offsets, data, scale, g, b, gated)
    got = moe.grouped_cuda(*args, "nvfp4", gated)
    assert dot_scaled.CALLS[0] > calls or not sum(counts)
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = dict(rtol=2**-7 if not gated else 2**-6, atol=1e-3 * want.float().abs().max().item())
    torch.testing.assert_close(got.float(), want.float(), **tol)
    assert not got[sum(counts):].any()
    x_codes, x_bits, g_rows = moe.group_quantize(x, offsets)
    for splits in (1, 3):
        again = _grouped(x_codes, offsets, *args[2:], gated, g_rows, torch.bfloat16, x_scale=x_bits, splits=splits)
        torch.testing.assert_close(again.float(), want.float(), **tol)


def test_triton_kernel_fp32_output(kernel_device):
    """fp32 x: x still enters the products rounded to bf16 (W4A16), the result is not rounded,
    so it is the reference's up to fp32 summation order."""
    gen = torch.Generator().manual_seed(12)
    data, scale, g = _experts(3, 40, 96, gen)
    x = torch.randn(21, 96, generator=gen) * 100
    offsets = _offsets([4, 16, 1])
    want = _op(x, offsets, data, scale, g, None, "bf16")
    got = moe.grouped_cuda(*_kernel_args(kernel_device, x, offsets, data, scale, g, None, False), "bf16",
                            False).cpu()
    assert ((got - want).norm() / want.norm()).item() <= 1e-6


def test_triton_kernel_reads_strided_offsets_and_global_scales(kernel_device):
    """offsets and global scales given as strided views (every other element of a larger tensor):
    the kernel reads their values, not the memory next to them."""
    gen = torch.Generator().manual_seed(13)
    data, scale, g = _experts(3, 32, 64, gen)
    x = torch.randn(12, 64, generator=gen).to(torch.bfloat16)
    want = _op(x, _offsets([3, 2, 7]), data, scale, g, None, "bf16")
    codes, bits = tiled.tile_experts(data, scale, False)
    # made on the device, then sliced: a copy to the device would be contiguous
    offsets = torch.tensor([3, 99, 5, 99, 12, 99], dtype=torch.int32, device=kernel_device)[::2]
    g_strided = torch.stack([g, g * 1000], dim=1).reshape(-1).to(kernel_device)[::2]
    assert not offsets.is_contiguous() and not g_strided.is_contiguous()
    got = moe.grouped_cuda(x.to(kernel_device), offsets, codes.to(kernel_device), bits.to(kernel_device),
                            g_strided, None, 32, "bf16", False).cpu()
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-3 * want.float().abs().max().item())


_COMPILE_SCRIPT = """
import json, re, sys
import triton.language as tl
from triton.backends.compiler import GPUTarget
from helpers.compile_kernels import block_scaled_mma_check, compile_for
from nvfp4_inductor.kernels import gemm_configs, grouped
from nvfp4_inductor.kernels.device.mainloops import MAINLOOPS

sig = {name: kind for name, kind in zip(
    ["x_ptr", "offsets_ptr", "w_ptr", "w_scale_ptr", "w_global_scale_ptr", "x_global_scale_ptr", "bias_ptr",
     "out_ptr", "partial_ptr", "counter_ptr", "x_scale_ptr", "T", "NP", "K", "E", "N_OUT", "M_TILES",
     "steps_per_split", "stride_xt", "stride_ot"],
    ["*bf16", "*i32", "*u8", "*u8", "*fp32", "*fp32", "*bf16", "*bf16", "*fp32", "*i32", "*u8"] + ["i32"] * 9)}
meta = ["MAINLOOP", "HAS_BIAS", "X_SCALED", "GATED", "USE_ASM", "OPERAND", "SPLIT", "EVEN", "E_POW2", "BLOCK_M",
        "BLOCK_N", "BLOCK_K", "REG_MMA", "ACC_M"]
sig.update(dict.fromkeys(meta, "constexpr"))
MMA = dict(BLOCK_N=64, BLOCK_K=64, num_warps=2)
block_m, block_k, warps, stages = gemm_configs.WGMMA_CONFIG
WGMMA = dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=block_k, num_warps=warps, num_stages=stages)
def table(config):
    block_m, block_n, block_k, warps = config
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
for name, cfg, split, nb, mainloop, sm in (
        ("decode", table(gemm_configs.GROUPED_DECODE_CONFIG), True, 0, "dot", 90),
        ("prefill", table(gemm_configs.GROUPED_PREFILL_CONFIG), False, 0, "dot", 90),
        ("mma8", {**MMA, "BLOCK_M": 8}, True, 1, "mma", 90), ("mma16", {**MMA, "BLOCK_M": 16}, True, 2, "mma", 90),
        ("wgmma", WGMMA, False, 0, "wgmma", 90),
        ("sm100-decode", table(gemm_configs.GROUPED_DOT_SCALED_DECODE_CONFIG), True, 0, "dot_scaled", 100),
        ("sm100-prefill", table(gemm_configs.GROUPED_DOT_SCALED_PREFILL_CONFIG), False, 0, "dot_scaled", 100),
        ("sm120-decode", table(gemm_configs.GROUPED_DOT_SCALED_DECODE_CONFIG), True, 0, "dot_scaled", 120)):
    values = dict(MAINLOOP=MAINLOOPS[mainloop], HAS_BIAS=True, X_SCALED=True, GATED=True, USE_ASM=sm == 90,
                  OPERAND=tl.bfloat16, SPLIT=split, EVEN=True, E_POW2=128, BLOCK_M=cfg["BLOCK_M"],
                  BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], REG_MMA=nb, ACC_M=max(16, cfg["BLOCK_M"]))
    kernel = compile_for(grouped.grouped_linear_kernel, {**sig, "x_ptr": "*u8" if sm >= 100 else "*bf16"},
                         {(i,): values[n] for i, n in enumerate(sig) if n in values},
                         GPUTarget("cuda", sm, 32), num_warps=cfg["num_warps"], num_stages=cfg.get("num_stages", 3))
    ptx = kernel.asm["ptx"]
    print(json.dumps({"config": name, "ptx": ptx, "block_scaled": bool(re.search(block_scaled_mma_check(sm), ptx))}))
"""


def test_cuda_kernel_compiles_for_sm90_sm100_sm120():
    """The CUDA kernel's GPU-only code (the word decode's inline PTX, bf16 dots) compiles for sm_90
    without a GPU: mma.sync at decode tiles (2 warps, K split: the last split's acquire), wgmma at
    prefill tiles (4 warps) and in the wgmma mainloop (x's tile first), and the dense decode
    kernel's register-fed mainloop (its inline mma.sync on the tiled layout). For sm_100, W4A4's
    DOT_SCALED form: tcgen05's NVFP4 block-scaled MMA (one e4m3 scale per 16 elements) at decode
    and prefill tiles; for sm_120 (no tcgen05), the block-scaled mma.sync."""
    import json
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(tests), str(tests.parent), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    results = [json.loads(line) for line in run.stdout.splitlines()]
    ptx = {r["config"]: r["ptx"] for r in results}
    block_scaled = {r["config"] for r in results if r["block_scaled"]}
    assert "mma.sync" in ptx["decode"] and "wgmma" in ptx["prefill"]
    split_counter = r"atom\.global\.gpu\.acq_rel\.add"
    assert re.search(split_counter, ptx["decode"]) and not re.search(split_counter, ptx["prefill"])
    assert all("prmt.b32" in p and "mul.rn.bf16x2" in p for c, p in ptx.items() if not c.startswith("sm1"))
    assert block_scaled == {"sm100-decode", "sm100-prefill", "sm120-decode"}
    assert not any("mul.rn.bf16x2" in ptx[name] for name in block_scaled)
    assert re.search(split_counter, ptx["sm100-decode"]) and not re.search(split_counter, ptx["sm100-prefill"])
    for name in ("mma8", "mma16"):
        assert "mma.sync.aligned.m16n8k16" in ptx[name] and "cvt.rn.f16x2.e4m3x2" in ptx[name]
        assert "wgmma" not in ptx[name] and re.search(split_counter, ptx[name])
    # x's tile as wgmma's first operand; the weight tiles copied to shared memory in 16-byte pieces
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n64k16\.f32\.bf16\.bf16", ptx["wgmma"])
    assert re.search(r"cp\.async\.cg\.shared\.global \[[^\]]+\], \[[^\]]+\], 0x10", ptx["wgmma"])
    assert not re.search(split_counter, ptx["wgmma"])


# --- transformers experts ----------------------------------------------------------------------

ARCHITECTURES = MOE_ARCHITECTURES
IMPLEMENTATIONS = ["eager", "batched_mm", "grouped_mm"]
LAYERS = 2


def _model(arch: str, impl: str, seed: int = 0, **kw):
    return moe_model(arch, impl, LAYERS, seed, **kw)


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_converted_moe_models_are_close_to_bf16_and_reload(arch, impl):
    """convert_experts on a tiny random model of each experts_implementation: every layer's experts
    become NVFP4Experts, the logits stay close to the bf16 model's, and a fresh model converted
    and loaded from the state dict (ModelOpt's per-expert names) gives the same logits."""
    model = _model(arch, impl)
    ids = torch.randint(0, MOE_SHAPES["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
        names = convert_experts(model, nv.Config(activations="bf16"))
        got = model(ids).logits
    assert names == [f"model.layers.{i}.mlp.experts" for i in range(2)]
    assert all(isinstance(model.get_submodule(name), NVFP4Experts) for name in names)
    err = (got.float() - want.float()).abs().max().item()
    assert err <= LOGIT_TOL * want.float().abs().max().item(), err
    state = model.state_dict()
    gate, up, down = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    prefix = "model.layers.1.mlp.experts.3."
    assert state[prefix + f"{gate}.weight"].dtype == torch.uint8
    assert state[prefix + f"{up}.weight_scale"].dtype == torch.float8_e4m3fn
    intermediate = model.get_submodule(names[0]).intermediate_dim
    assert state[prefix + f"{down}.weight"].shape == (MOE_SHAPES["hidden_size"], intermediate // 2)
    assert state[prefix + f"{gate}.weight"].shape == (intermediate, MOE_SHAPES["hidden_size"] // 2)
    assert torch.equal(state[prefix + f"{gate}.weight_scale_2"], state[prefix + f"{up}.weight_scale_2"])
    fresh = _model(arch, impl, seed=2)
    convert_experts(fresh, nv.Config(activations="bf16"))
    missing, unexpected = fresh.load_state_dict(state, strict=True)
    assert not missing and not unexpected
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, got)



def test_nv_convert_converts_experts_and_linears():
    """nv.convert on an MoE model: the attention linears become NVFP4Linear and the experts
    NVFP4Experts in one call; experts it cannot convert (weight_method="hessian") are reported
    as skipped, with the reason."""
    model = _model("qwen3_moe", "grouped_mm")
    report = nv.convert(model, nv.Config(activations="bf16"))
    experts = [f"model.layers.{i}.mlp.experts" for i in range(2)]
    assert set(experts) <= set(report.converted)
    assert isinstance(model.model.layers[0].self_attn.q_proj, nv.NVFP4Linear)
    assert isinstance(model.get_submodule(experts[1]), NVFP4Experts)
    fresh = _model("qwen3_moe", "grouped_mm")
    hessians = nv.collect_hessians(fresh, [torch.randint(0, MOE_SHAPES["vocab_size"], (1, 8))])
    report = nv.convert(fresh, nv.Config(activations="bf16", weight_method="hessian", hessians=hessians))
    assert all("hessian" in report.skipped[name] for name in experts)
    assert not isinstance(fresh.get_submodule(experts[0]), NVFP4Experts)

def test_experts_module_w4a4_and_include():
    """activations="nvfp4" experts (each expert's rows quantized with their own global scale) stay
    close to bf16; Config.include leaves the experts it rejects in bf16."""
    model = _model("qwen3_moe", "grouped_mm")
    ids = torch.randint(0, MOE_SHAPES["vocab_size"], (1, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(ids).logits
        names = convert_experts(model, nv.Config(activations="nvfp4", include=lambda name, m: ".0." in name))
        got = model(ids).logits
    assert names == ["model.layers.0.mlp.experts"]
    assert not isinstance(model.model.layers[1].mlp.experts, NVFP4Experts)
    assert (got.float() - want.float()).abs().max().item() <= LOGIT_TOL * want.float().abs().max().item()


def test_experts_it_cannot_convert_are_refused():
    """Dims that are not multiples of 16, another activation, a custom gate: a clear error, and
    nothing replaced."""
    model = _model("qwen3_moe", "eager", moe_intermediate_size=24)
    with pytest.raises(ValueError, match="intermediate size 24 must be positive multiples of 16"):
        convert_experts(model)
    assert not any(isinstance(m, NVFP4Experts) for m in model.modules())
    with pytest.raises(ValueError, match="activation .* is not SiLU"):
        convert_experts(_model("mixtral", "eager", hidden_act="gelu"))
    with pytest.raises(ValueError, match='weight_method="hessian"'):
        convert_experts(_model("mixtral", "eager"), nv.Config(weight_method="hessian", hessians={}))


def test_from_experts_and_quantize_experts_refuse_what_they_cannot_hold():
    """NVFP4Experts.from_experts on experts whose activation is not SiLU (it would be replaced by
    SiLU silently), and nvfp4::quantize_experts_tiled on weights that are not (E, N, K): a ValueError."""
    experts = _model("mixtral", "eager", hidden_act="gelu").model.layers[0].mlp.experts
    with pytest.raises(ValueError, match="from_experts: cannot convert MixtralExperts: its activation .* not SiLU"):
        NVFP4Experts.from_experts(experts)
    with pytest.raises(ValueError, match="holds no 3-D gate_up_proj"):
        NVFP4Experts.from_experts(torch.nn.Linear(16, 16))
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(14))
    for bad in (w, w[None][:0]):  # 2-D; E = 0
        with pytest.raises(ValueError, match=r"expert weights must be \(E, N, K\)"):
            OPS.quantize_experts_tiled(bad, "rtn", False)


def test_experts_module_refuses_inputs_of_other_shapes():
    """hidden_states not (T, hidden_dim) (also a width within the tiled weight's padding) or
    routing tensors not (T, top-k) alike: a ValueError naming the shapes."""
    model = _model("mixtral", "eager")
    convert_experts(model)
    experts = model.model.layers[0].mlp.experts
    gen = torch.Generator().manual_seed(15)
    h = torch.randn(5, experts.hidden_dim, generator=gen, dtype=torch.bfloat16)
    ids = torch.randint(0, experts.num_experts, (5, 2), generator=gen)
    weights = torch.rand(5, 2, generator=gen, dtype=torch.bfloat16)
    assert experts(h, ids, weights).shape == h.shape
    with pytest.raises(ValueError, match=r"hidden_states must be \(tokens, hidden_dim = 64\); got shape \(5, 48\)"):
        experts(h[:, :48], ids, weights)
    with pytest.raises(ValueError, match=r"hidden_states must be .* got shape \(1, 5, 64\)"):
        experts(h[None], ids, weights)
    for bad_ids, bad_weights in ((ids[:4], weights[:4]), (ids, weights[:, :1]), (ids.reshape(-1), weights.reshape(-1))):
        with pytest.raises(ValueError, match="top_k_index and top_k_weights must be"):
            experts(h, bad_ids, bad_weights)


def test_experts_module_drops_expert_ids_outside_the_experts():
    """Negative ids and ids >= E (transformers' expert-parallel sentinels) contribute nothing: the
    output is the one with those routes sent to expert 0 with weight 0 (a negative id was counted
    in expert 0's group before)."""
    model = _model("mixtral", "eager")
    convert_experts(model, nv.Config(activations="bf16"))
    experts = model.model.layers[0].mlp.experts
    gen = torch.Generator().manual_seed(16)
    h = torch.randn(6, experts.hidden_dim, generator=gen, dtype=torch.bfloat16)
    ids = torch.randint(0, experts.num_experts, (6, 2), generator=gen)
    weights = torch.rand(6, 2, generator=gen, dtype=torch.bfloat16)
    outside = torch.tensor([[False, True], [False, False], [True, False], [False, False], [False, True], [False, False]])
    bad_ids = ids.masked_fill(outside, -1)
    bad_ids[4, 1] = experts.num_experts
    want = experts(h, ids.masked_fill(outside, 0), weights.masked_fill(outside, 0))
    assert torch.equal(experts(h, bad_ids, weights), want)
    assert not torch.equal(experts(h, ids, weights), want)


def test_experts_whose_activation_is_the_silu_function_convert():
    """LFM2-MoE's experts call torch.nn.functional.silu itself (not an nn.SiLU module): converted,
    close to bf16, as backend="nvfp4" rewrites them."""
    config = transformers.Lfm2MoeConfig(**{**MOE_SHAPES, "intermediate_size": 128, "moe_intermediate_size": 32,
                                           "num_hidden_layers": 2, "num_experts": 4, "num_experts_per_tok": 2,
                                           "layer_types": ["full_attention"] * 2, "num_dense_layers": 1,
                                           "experts_implementation": "grouped_mm"})
    torch.manual_seed(0)
    model = transformers.Lfm2MoeForCausalLM(config).to(torch.bfloat16).eval()
    assert model.model.layers[1].feed_forward.experts.act_fn is torch.nn.functional.silu
    ids = torch.randint(0, MOE_SHAPES["vocab_size"], (1, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = model(ids).logits
        report = nv.convert(model, nv.Config(activations="bf16"))
        got = model(ids).logits
    assert "model.layers.1.feed_forward.experts" in report.converted
    assert isinstance(model.model.layers[1].feed_forward.experts, NVFP4Experts)
    assert (got.float() - want.float()).abs().max().item() <= LOGIT_TOL * want.float().abs().max().item()


def test_module_casts_keep_the_nvfp4_buffers():
    model = _model("mixtral", "eager")
    convert_experts(model)
    experts = model.model.layers[0].mlp.experts
    model.half()
    assert experts.gate_up_weight_scale.dtype == torch.float8_e4m3fn
    assert experts.down_weight_scale_2.dtype == torch.float32


# --- GPU ---------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 16, 64, 515, 1100, 2100])
@pytest.mark.parametrize("gated", [False, True])
def test_cuda_kernel_matches_the_reference(t, gated):
    """The CUDA op (word decode, bf16 tensor-core dots) against the CPU reference at Qwen3-MoE-like
    expert shapes, random routings of t tokens with top-8 over 128 experts: every form by the rows
    an expert gets (register-fed, wgmma on sm_90, dequantize + torch._grouped_mm)."""
    gen = torch.Generator().manual_seed(t + gated)
    e, n, k = 128, 2 * 192 if gated else 256, 512
    data, scale, g = _experts(e, n, k, gen)
    ids = torch.randint(0, e, (t * 8,), generator=gen).sort().values
    offsets = torch.searchsorted(ids, torch.arange(e), right=True).to(torch.int32)
    x = torch.randn(t * 8, k, generator=gen).to(torch.bfloat16)
    for activation in ("bf16", "nvfp4"):
        want = _op(x, offsets, data, scale, g, None, activation, gated)
        got = _op(*(a.cuda() for a in (x, offsets, data, scale, g)), None, activation, gated).cpu()
        # gated: gate and up may each round one step apart, and silu(gate) * up adds both; in the
        # dequantize + torch._grouped_mm form each linear is rounded once more
        rtol = (2**-5 if plan.grouped_dequant_runs(t * 8, e, k, x.cuda().device) else 2**-6) if gated else 2**-7
        torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=1e-3 * want.float().abs().max().item())


MMA_ROUTINGS = {  # (experts' rows, blocks of 8 rows a program takes): 2 rows past the groups each
    "one row each": ([1, 0, 2, 0, 3, 1, 0, 1], 1),
    "one expert, two programs": ([0, 0, 16, 0, 0, 0, 0, 0], 1),
    "16-row programs": ([0, 17, 5, 0, 9, 1, 8, 0], 2),
    "32-row programs": ([40, 0, 3, 33, 0, 10, 14, 0], 4),
}


@pytest.mark.gpu
@pytest.mark.parametrize("routing", MMA_ROUTINGS)
@pytest.mark.parametrize("k", [512, 336])
@pytest.mark.parametrize("gated, bias", [(False, True), (True, False)])
def test_cuda_register_fed_kernel_matches_the_reference(routing, k, gated, bias):
    """The decode form on the dense kernel's register-fed mainloop (K a multiple of the 64-k tile
    or not): W4A16 and W4A4 against the reference, split K against one range, fresh random inputs."""
    from nvfp4_inductor.kernels import grouped

    counts, blocks = MMA_ROUTINGS[routing]
    n = 2 * 96 if gated else 160  # N: not a multiple of the 64-row tile
    inputs, args = _cuda_case(counts, n, k, gated, bias, seed=k + gated * 2 + bias + blocks)
    t, e = args[0].shape[0], len(counts)
    launch = grouped.grouped_launch_for(args[0], args[2], args[3], n, gated)
    assert plan.grouped_mma_blocks(t, e) == blocks and launch.mainloop == "mma" and launch.reg_mma == blocks
    tol = _matches_the_reference(inputs, args, counts, gated)
    one = _grouped(*args, gated, splits=1).cpu()
    three = _grouped(*args, gated, splits=3).cpu()
    torch.testing.assert_close(one.float(), _op(*inputs, "bf16", gated).float(), **tol)
    torch.testing.assert_close(three.float(), one.float(), **tol)


def _cuda_case(counts, n, k, gated, bias, seed):
    """Fresh random experts and x routed by counts (2 rows past the groups) -> ((x, offsets, codes,
    scale bits, g, bias) on the CPU, row-major; _kernel_args on CUDA)."""
    gen = torch.Generator().manual_seed(seed)
    e, t = len(counts), sum(counts) + 2
    data, scale, g = _experts(e, n, k, gen)
    x = (torch.randn(t, k, generator=gen) * 5).to(torch.bfloat16)
    b = torch.randn(e, n, generator=gen) if bias else None
    inputs = (x, _offsets(counts), data, scale, g, b)
    return inputs, _kernel_args("cuda", *inputs, gated)


def _matches_the_reference(inputs, args, counts, gated) -> dict:
    """The CUDA path against the reference, W4A16 and W4A4; rows past the groups zero -> the
    tolerance used."""
    for activation in ("bf16", "nvfp4"):
        want = _op(*inputs, activation, gated)
        got = moe.grouped_cuda(*args, activation, gated).cpu()
        tol = dict(rtol=2**-6 if gated else 2**-7, atol=1e-3 * want.float().abs().max().item())
        torch.testing.assert_close(got.float(), want.float(), **tol)
        assert not got[sum(counts):].any()
    return tol


WGMMA_ROUTINGS = {  # 17..128 rows an expert on average: 2 rows past the groups each
    "uneven": [70, 0, 130, 33],       # two and three 64-row blocks, an expert with none
    "one expert": [0, 0, 0, 300],
    "few rows": [9, 30, 20, 12],
}


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
                    reason="the wgmma mainloop runs on sm_90")
@pytest.mark.parametrize("routing", WGMMA_ROUTINGS)
@pytest.mark.parametrize("k", [512, 336])
@pytest.mark.parametrize("gated, bias", [(False, True), (True, False), (True, True)])
def test_cuda_wgmma_kernel_matches_the_reference(routing, k, gated, bias):
    """The serving-batch form on the dense GEMM's wgmma mainloop (blocks of 64 rows of x, two
    tiles a K-step; K a multiple of the step or not), W4A16 and W4A4, against the reference at
    fresh random inputs; rows past the groups zero."""
    from nvfp4_inductor.kernels import grouped

    counts = WGMMA_ROUTINGS[routing]
    n = 2 * 80 if gated else 200  # I = 80: halves padded to the 32-row group
    inputs, args = _cuda_case(counts, n, k, gated, bias, seed=k + gated * 2 + bias + len(routing))
    t, e = args[0].shape[0], len(counts)
    assert not plan.grouped_mma_blocks(t, e)
    assert grouped.grouped_launch_for(args[0], args[2], args[3], n, gated).mainloop == "wgmma"
    _matches_the_reference(inputs, args, counts, gated)


@pytest.mark.gpu
def test_split_kernel_under_a_cuda_graph():
    """A K-split launch captured in a CUDA graph keeps tile counters of its own and replays with
    other routings (counts on the device) and fresh x: each replay against the reference."""
    gen = torch.Generator().manual_seed(5)
    e, n, k = 16, 2 * 128, 1024
    data, scale, g = _experts(e, n, k, gen)
    codes, bits, g_cuda = (a.cuda() for a in (*tiled.tile_experts(data, scale, True), g))
    x = torch.zeros(8, k, dtype=torch.bfloat16, device="cuda")
    offsets = torch.zeros(e, dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _grouped(x, offsets, codes, bits, g_cuda, None, n, True, splits=4)  # (compiled outside the capture)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _grouped(x, offsets, codes, bits, g_cuda, None, n, True, splits=4)
    for seed in range(3):
        ids = torch.randint(0, e, (8,), generator=gen).sort().values
        x.copy_(torch.randn(8, k, generator=gen).to(torch.bfloat16))
        offsets.copy_(torch.searchsorted(ids, torch.arange(e), right=True).to(torch.int32))
        graph.replay()
        want = _op(x.cpu(), offsets.cpu(), data, scale, g, None, "bf16", gated=True)
        torch.testing.assert_close(out.cpu().float(), want.float(), rtol=2**-6,
                                   atol=1e-3 * want.float().abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["bf16", "nvfp4"])
def test_experts_module_under_cuda_graphs(activation):
    """An NVFP4Experts forward captured once in a CUDA graph, replayed with new tokens and a new
    routing copied into its inputs: the eager output each time; eager forward makes no host sync."""
    model = _model("qwen3_moe", "grouped_mm").cuda()
    convert_experts(model, nv.Config(activations=activation))
    experts = model.model.layers[0].mlp.experts
    gen = torch.Generator(device="cuda").manual_seed(7)

    def inputs(t=24):
        h = torch.randn(t, 64, device="cuda", generator=gen).to(torch.bfloat16)
        idx = torch.randint(0, 8, (t, 2), device="cuda", generator=gen)
        w = torch.rand(t, 2, device="cuda", generator=gen).to(torch.bfloat16)
        return h, idx, w

    static = inputs()
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            experts(*static)  # warm-up (Triton compiles) off the capture
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            experts(*static)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = experts(*static)
        for _ in range(3):
            fresh = inputs()
            if _ == 2:  # every token to one expert
                fresh[1][:, 0] = 5
            for dst, src in zip(static, fresh):
                dst.copy_(src)
            graph.replay()
            assert torch.equal(out, experts(*fresh))


# --- checkpoints -------------------------------------------------------------------------------

def _empty_model(arch: str):
    """The architecture's tiny model built on the meta device (nv.init_empty_weights), to load into."""
    with nv.init_empty_weights():
        model = _model(arch, "grouped_mm")
    return model


# the extra tensors of an NVFP4 layer in each format, and its codes' suffix
NVFP4_SUFFIXES = {"modelopt": ((".weight_scale", ".weight_scale_2", ".input_scale"), ".weight"),
                  "compressed-tensors": ((".weight_scale", ".weight_global_scale", ".input_global_scale"),
                                         ".weight_packed")}


@pytest.mark.parametrize("arch", [*ARCHITECTURES, "phimoe"])
@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
def test_moe_checkpoint_round_trips(tmp_path, arch, fmt):
    """nv.convert (linears and experts), save_checkpoint, then load_checkpoint into a model built
    without weights and into one whose experts are NVFP4Experts already: the file names every
    tensor as transformers' save_pretrained names the bf16 model's (the original module and
    per-expert names: Mixtral's and PhiMoE's block_sparse_moe.experts.<e>.w1), the experts come
    back as NVFP4Experts with the same codes and scales (compressed-tensors' reciprocal global
    scales within one fp32 rounding), and the same logits."""
    from safetensors import safe_open

    model = _model(arch, "grouped_mm")
    model.save_pretrained(tmp_path / "bf16")
    with safe_open(tmp_path / "bf16" / "model.safetensors", "pt") as f:
        bf16_keys = set(f.keys())
    nv.convert(model, nv.Config(activations="bf16", share_global_scales=True))
    nv.save_checkpoint(model, tmp_path, format=fmt)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    extra, codes = NVFP4_SUFFIXES[fmt]
    assert {key.removesuffix(codes) + ".weight" if key.endswith(codes) else key
            for key in keys if not key.endswith(extra)} == bf16_keys
    per_expert = "block_sparse_moe.experts.3.w1" if arch != "qwen3_moe" else "mlp.experts.3.gate_proj"
    assert f"model.layers.1.{per_expert}{codes}" in keys
    ids = torch.randint(0, MOE_SHAPES["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(ids).logits
    experts_converted = _model(arch, "grouped_mm", seed=5)
    convert_experts(experts_converted)
    for fresh in (_empty_model(arch), experts_converted):
        report = nv.load_checkpoint(fresh, tmp_path)
        assert {f"model.layers.{i}.mlp.experts" for i in range(2)} <= set(report.converted)
        loaded, saved = fresh.model.layers[1].mlp.experts, model.model.layers[1].mlp.experts
        assert isinstance(loaded, NVFP4Experts) and loaded.checkpoint_names == saved.checkpoint_names
        for name, t in saved.named_buffers():
            if name.endswith("scale_2") and fmt == "compressed-tensors":  # stored as 1 / g: one fp32 rounding
                torch.testing.assert_close(getattr(loaded, name), t, rtol=2**-23, atol=0)
            else:
                assert torch.equal(getattr(loaded, name).view(torch.uint8), t.view(torch.uint8)), name
        with torch.no_grad():
            got = fresh(ids).logits
        if fmt == "modelopt":
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=0, atol=0.02 * want.abs().max().item())


def test_from_pretrained_refuses_nvfp4_experts_and_reads_their_excluded_form(tmp_path):
    """from_pretrained (the registered "modelopt" quantizer) on an MoE checkpoint: NVFP4 experts are
    refused with the way that reads them (load_checkpoint); with the experts left bf16 (excluded
    under the files' names, Mixtral's block_sparse_moe) the model loads with its attention NVFP4,
    every tensor the saved model's."""
    model = _model("mixtral", "grouped_mm")
    nv.convert(model, nv.Config(activations="bf16", share_global_scales=True))
    nv.save_checkpoint(model, tmp_path / "experts")
    nv.register_transformers_quantizer()
    with pytest.raises(ValueError, match="mlp.experts: from_pretrained does not read NVFP4 mixture-of-experts .*"
                                         "load_checkpoint"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "experts", dtype=torch.bfloat16)
    model = _model("mixtral", "grouped_mm")
    nv.convert(model, nv.Config(activations="bf16", share_global_scales=True,
                                include=lambda name, m: "self_attn" in name))
    nv.save_checkpoint(model, tmp_path / "attention")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "attention", dtype=torch.bfloat16,
                                                               experts_implementation="grouped_mm").eval()
    assert isinstance(loaded.model.layers[1].self_attn.q_proj, nv.NVFP4Linear)
    assert type(loaded.model.layers[1].mlp.experts).__name__ == "MixtralExperts"
    state = loaded.state_dict()
    for key, t in model.state_dict().items():
        assert torch.equal(state[key].view(torch.uint8) if t.dtype == torch.float8_e4m3fn else state[key],
                           t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t), key


def _write_experts(path, arch: str, edit=None):
    """A ModelOpt W4A16 checkpoint written by hand for the tiny model under the original names (as
    the Hub's Mixtral checkpoints: model.layers.<l>.block_sparse_moe.experts.<e>.w1): its experts
    per expert (gate and up quantized as one tensor, so they share the global scale), everything
    else bf16."""
    from safetensors.torch import save_file

    model = _model(arch, "grouped_mm")
    moe = "block_sparse_moe" if arch == "mixtral" else "mlp"
    state = {k.replace(".mlp.", f".{moe}."): v.clone() for k, v in model.state_dict().items()}
    gate, up, down = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    expected = {}
    for layer in range(LAYERS):
        prefix = f"model.layers.{layer}.{moe}.experts"
        gate_up, w_down = state.pop(f"{prefix}.gate_up_proj"), state.pop(f"{prefix}.down_proj")
        i = gate_up.shape[1] // 2
        for e in range(gate_up.shape[0]):
            q_gate_up, q_down = nv.quantize(gate_up[e]), nv.quantize(w_down[e])
            expected[(f"model.layers.{layer}.mlp.experts", e)] = (q_gate_up, q_down)
            for proj, q, rows in ((gate, q_gate_up, slice(0, i)), (up, q_gate_up, slice(i, 2 * i)),
                                  (down, q_down, slice(None))):
                state.update({f"{prefix}.{e}.{proj}.weight": q.data[rows].contiguous(),
                              f"{prefix}.{e}.{proj}.weight_scale": q.scale[rows].contiguous(),
                              f"{prefix}.{e}.{proj}.weight_scale_2": q.global_scale.clone()})
    if edit is not None:
        edit(state)
    path.mkdir(exist_ok=True)
    save_file(state, str(path / "model.safetensors"))
    (path / "hf_quant_config.json").write_text(json.dumps({"quantization": {
        "quant_algo": "W4A16_NVFP4", "group_size": 16, "exclude_modules": ["lm_head", "*.self_attn.*", "*.gate"]}}))
    return expected


def test_moe_checkpoint_written_by_hand_loads_bit_for_bit(tmp_path):
    """ModelOpt's per-expert layout written from the format's conventions, loaded into an
    unconverted model: each expert's codes, scales and global scale are the stored ones."""
    expected = _write_experts(tmp_path, "mixtral")
    model = _model("mixtral", "grouped_mm", seed=4)
    report = nv.load_checkpoint(model, tmp_path)
    assert report.converted == [f"model.layers.{i}.mlp.experts" for i in range(2)]
    for (prefix, e), (q_gate_up, q_down) in expected.items():
        experts = model.get_submodule(prefix)
        (gate_up, gate_up_scale), (down, _) = experts._row_major("gate_up"), experts._row_major("down")
        assert torch.equal(gate_up[e], q_gate_up.data)
        assert torch.equal(gate_up_scale[e].view(torch.uint8), q_gate_up.scale.view(torch.uint8))
        assert torch.equal(experts.gate_up_weight_scale_2[e], q_gate_up.global_scale)
        assert torch.equal(down[e], q_down.data)
        assert torch.equal(experts.down_weight_scale_2[e], q_down.global_scale)


def _set(key, value):
    def edit(state):
        state[key] = value(state[key]) if callable(value) else value
    return edit


P = "model.layers.1.block_sparse_moe.experts.2."


@pytest.mark.parametrize("edit, match", [
    (_set(P + "w3.weight_scale_2", lambda g: g * 2), "w1.weight_scale_2 .* and .*w3.weight_scale_2 .* differ"),
    (_set(P + "w2.weight_scale_2", lambda g: 2688 / g), "almost certainly a compressed-tensors global scale"),
    (_set(P + "w1.weight", lambda t: t[:, :-1].contiguous()), r"2.w1.weight must have shape \(48, 32\); got \(48, 31\)"),
    (_set(P + "w2.weight_scale", lambda t: t.float()), "w2.weight_scale"),
    (lambda state: state.pop(P + "w3.weight_scale"), "Missing key.*2.w3.weight_scale"),
    (_set(P + "w4.weight", torch.zeros(4, dtype=torch.uint8)), "Unexpected key.*2.w4.weight"),
    (lambda state: state.update({k.replace(".block_sparse_moe.", ".mlp."): v.clone() for k, v in state.items()
                                 if k.startswith("model.layers.0.block_sparse_moe.gate.")}),
     r"'model.layers.0.block_sparse_moe.gate.weight' and 'model.layers.0.mlp.gate.weight' are both the model's"),
], ids=["unshared-gate-up-scale", "reciprocal-scale", "bad-shape", "bad-dtype", "missing", "unexpected",
        "one-tensor-under-two-names"])
def test_bad_moe_checkpoints_are_refused_before_anything_loads(tmp_path, edit, match):
    """A clear error naming the tensor, and the model untouched."""
    _write_experts(tmp_path, "mixtral", edit)
    model = _model("mixtral", "grouped_mm", seed=4)
    before = model.model.layers[0].mlp.experts.gate_up_proj.clone()
    with pytest.raises(ValueError, match=match):
        nv.load_checkpoint(model, tmp_path)
    assert not any(isinstance(m, NVFP4Experts) for m in model.modules())
    assert torch.equal(model.model.layers[0].mlp.experts.gate_up_proj, before)
