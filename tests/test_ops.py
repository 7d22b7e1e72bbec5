"""The nvfp4:: ops: opcheck, fake kernels, torch.compile on the CPU, the reference linear."""

import pytest
import torch
from torch import nn

import nvfp4_inductor as nv
from nvfp4_inductor import reference

OPS = torch.ops.nvfp4


def _q_args(x, per_row=False, swizzle=False):
    data, scale, g = OPS.quantize(x, None, per_row, swizzle)
    return data, scale, g


@pytest.mark.parametrize("shape", [(1, 16), (157, 48), (3, 5, 64), (0, 32), (32,)])
@pytest.mark.parametrize("swizzle", [False, True])
def test_opcheck_quantize_dequantize(shape, swizzle):
    x = torch.randn(shape, dtype=torch.bfloat16)
    torch.library.opcheck(OPS.quantize.default, (x, None, False, swizzle))
    if len(shape) > 1:
        torch.library.opcheck(OPS.quantize.default, (x, None, True, swizzle))
    g = torch.tensor(0.01)
    torch.library.opcheck(OPS.quantize.default, (x.float(), g, False, swizzle))
    if not swizzle:
        torch.library.opcheck(OPS.quantize_values.default, (x,))
        torch.library.opcheck(OPS.rms_norm_quantize_values.default, (x, None, 1e-5, False))
        weight = torch.rand(shape[-1])
        torch.library.opcheck(OPS.rms_norm_quantize_values.default, (x, weight, 1e-5, False))
        torch.library.opcheck(OPS.rms_norm_quantize_values.default, (x, weight.bfloat16(), 0.0, True))
    data, scale, g = _q_args(x, swizzle=swizzle)
    for dtype in (torch.bfloat16, torch.float32):
        torch.library.opcheck(OPS.dequantize.default, (data, scale, g, swizzle, dtype))


@pytest.mark.parametrize("rows, cols", [(1, 1), (129, 5), (300, 8)])
def test_opcheck_swizzle(rows, cols):
    scale = torch.randint(0, 0x7F, (rows, cols), dtype=torch.uint8)
    torch.library.opcheck(OPS.swizzle_scales.default, (scale,))
    sw = OPS.swizzle_scales(scale)
    torch.library.opcheck(OPS.unswizzle_scales.default, (sw, rows, cols))


@pytest.mark.parametrize("m", [1, 7, 33])
@pytest.mark.parametrize("activation", ["bf16", "nvfp4"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_opcheck_linear(m, activation, with_bias):
    x = torch.randn(m, 64, dtype=torch.bfloat16)
    w_data, w_scale, w_g = _q_args(torch.randn(48, 64), swizzle=True)
    bias = torch.randn(48, dtype=torch.bfloat16) if with_bias else None
    torch.library.opcheck(OPS.linear.default, (x, w_data, w_scale, w_g, bias, True, activation))
    if activation == "bf16":  # the autograd formula, forward and backward traced (aot_autograd)
        x.requires_grad_()
        torch.library.opcheck(OPS.linear.default, (x, w_data, w_scale, w_g, bias, True, activation))


def test_fake_kernels_give_the_real_shapes_dtypes_strides():
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.randn(3, 70, 96, dtype=torch.float16)
    w = nv.quantize(torch.randn(40, 96), swizzle=True)
    calls = [
        (OPS.quantize, (x, None, True, True)),
        (OPS.quantize, (x, None, False, False)),
        (OPS.dequantize, (*_q_args(x), False, torch.float32)),
        (OPS.linear, (x, w.data, w.scale.view(torch.uint8), w.global_scale, None, True, "nvfp4")),
    ]
    for op, args in calls:
        real = op(*args)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
            fake = op(*fake_args)
        for r, f in zip(*(o if isinstance(o, tuple) else (o,) for o in (real, fake))):
            assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride())


def test_compiled_fullgraph_matches_eager_on_cpu():
    torch._dynamo.reset()

    def f(x, w_q, bias):
        q = nv.quantize(x, swizzle=True)
        back = nv.dequantize(q, torch.float32)
        y16 = nv.linear(x, w_q, bias)
        y4 = nv.linear(x, w_q, bias, activations="nvfp4")
        return q.data, q.scale.view(torch.uint8), back, y16, y4

    x = torch.randn(19, 128, dtype=torch.bfloat16)
    w_q = nv.quantize(torch.randn(64, 128, dtype=torch.bfloat16))
    bias = torch.randn(64, dtype=torch.bfloat16)
    eager = f(x, w_q, bias)
    compiled = torch.compile(f, fullgraph=True)(x, w_q, bias)
    for e, c in zip(eager, compiled):
        assert torch.equal(e, c)


def test_linear_is_dequantize_then_fp32_matmul():
    torch.manual_seed(3)
    x = torch.randn(2, 9, 64, dtype=torch.bfloat16)
    w = torch.randn(32, 64)
    bias = torch.randn(32, dtype=torch.bfloat16)
    w_q = nv.quantize(w)
    w_f32 = w_q.dequantize(torch.float32)
    y = nv.linear(x, w_q, bias)
    assert y.dtype == torch.bfloat16 and y.shape == (2, 9, 32)
    assert torch.equal(y, (x.float() @ w_f32.T + bias.float()).to(torch.bfloat16))
    y4 = nv.linear(x, w_q, activations="nvfp4")
    x_f32 = nv.quantize(x).dequantize(torch.float32)
    assert torch.equal(y4, (x_f32 @ w_f32.T).to(torch.bfloat16))
    # fp32 input: activation "bf16" means x enters the product rounded to bf16; out stays fp32.
    x32 = torch.randn(5, 64)
    y32 = nv.linear(x32, w_q)
    assert y32.dtype == torch.float32
    assert torch.equal(y32, x32.to(torch.bfloat16).float() @ w_f32.T)
    # Swizzled weight scales give the same result.
    assert torch.equal(nv.linear(x, nv.quantize(w, swizzle=True), bias), y)


@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16])
def test_linear_multiplies_in_fp32_inside_autocast(autocast_dtype):
    """A user's torch.autocast region does not reach the ops' fp32 products: without the guard
    the reference's matmul ran in bf16 (W's values e2m1 * s * g rounded before the sum), as did the
    calibration Hessian's einsum."""
    torch.manual_seed(4)
    x, bias = torch.randn(6, 64), torch.randn(48)
    w = nv.quantize(torch.randn(48, 64) * 3)
    data_t, scale_t = torch.ops.nvfp4.tile_weight(w.data, w.scale.view(torch.uint8))
    module = nv.NVFP4Linear(w, bias, "bf16")
    calls = [lambda: nv.linear(x, w, bias), lambda: nv.linear(x, w, activations="nvfp4"),
             lambda: torch.ops.nvfp4.linear_tiled(x, data_t, scale_t, w.global_scale, bias, 48, "bf16"),
             lambda: module(x), lambda: nv.calibrate.hessian_blocks(x)]
    with torch.no_grad():
        want = [call() for call in calls]
        with torch.autocast("cpu", dtype=autocast_dtype):
            got = [call() for call in calls]
    for g, w_ in zip(got, want):
        assert g.dtype == w_.dtype and torch.equal(g, w_)
    assert torch.equal(want[0], (x.to(torch.bfloat16).float() @ w.dequantize(torch.float32).T + bias))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_cuda_ops_run_on_their_inputs_device():
    """Inputs on cuda:1 while cuda:0 is current (a layer placed by device_map="auto") give what
    they give with cuda:1 current: Triton launches on the current device, so each CUDA
    implementation makes its input's device current."""
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(192, 256, generator=gen)
    xs = [torch.randn(m, 256, generator=gen).to(torch.bfloat16) for m in (3, 64)]

    def run(device):
        q = nv.quantize(w.to(device))
        data_t, scale_t = torch.ops.nvfp4.tile_weight(q.data, q.scale.view(torch.uint8))
        out = [q.data, q.scale.view(torch.uint8), nv.dequantize(q, torch.float32),
               nv.dequantize_rows(q, torch.tensor([5, 0], device=device))]
        for x in xs:
            x = x.to(device)
            out += [nv.linear(x, q), nv.linear(x, q, activations="nvfp4"), *torch.ops.nvfp4.quantize_values(x),
                    torch.ops.nvfp4.linear_tiled(x, data_t, scale_t, q.global_scale, None, 192, "bf16")]
        return out

    with torch.cuda.device(1):
        want = run("cuda:1")
    with torch.cuda.device(0):
        got = run("cuda:1")
    for g, w_ in zip(got, want):
        assert g.device == torch.device("cuda:1") and torch.equal(g, w_)


def _sqnr_db(ref, approx):
    ref, approx = ref.double(), approx.double()
    return (10 * torch.log10(ref.pow(2).sum() / (ref - approx).pow(2).sum())).item()


def test_linear_sqnr_against_bf16():
    # On this data: W4A16 20.4 dB, W4A4 17.3 dB (one NVFP4 side ~20 dB); floors leave 3 dB.
    torch.manual_seed(4)
    x = torch.randn(64, 512, dtype=torch.bfloat16)
    w = torch.randn(256, 512, dtype=torch.bfloat16)
    ref = x.float() @ w.float().T
    w_q = nv.quantize(w)
    assert _sqnr_db(ref, nv.linear(x, w_q).float()) > 17.0
    assert _sqnr_db(ref, nv.linear(x, w_q, activations="nvfp4").float()) > 14.0


def test_per_row_weight_global_scale_in_linear():
    torch.manual_seed(5)
    w = torch.randn(32, 64) * torch.logspace(-3, 3, 32).unsqueeze(1)
    w_q = nv.quantize(w, per_row=True)
    assert w_q.global_scale.shape == (32,)
    x = torch.randn(4, 64)
    assert torch.equal(nv.linear(x, w_q),
                       x.to(torch.bfloat16).float() @ w_q.dequantize(torch.float32).T)


def test_empty_tensors():
    x = torch.randn(0, 32)
    q = nv.quantize(x)
    assert q.data.shape == (0, 16) and q.scale.shape == (0, 2) and q.global_scale.item() == 1.0
    assert q.dequantize().shape == (0, 32)
    qs = nv.quantize(x, swizzle=True)
    assert qs.scale.shape == (0, 4) and qs.dequantize().shape == (0, 32)
    qr = nv.quantize(x, per_row=True)
    assert qr.global_scale.shape == (0,)
    w_q = nv.quantize(torch.randn(8, 32))
    assert nv.linear(x, w_q).shape == (0, 8)


def test_static_global_scale_forms():
    x = torch.randn(4, 32)
    g = torch.tensor(0.002)
    by_tensor = nv.quantize(x, g)
    assert torch.equal(by_tensor.global_scale, g) and by_tensor.global_scale is not g
    assert torch.equal(nv.quantize(x, 0.002).data, by_tensor.data)
    assert torch.equal(nv.quantize(x, torch.tensor([0.002])).data, by_tensor.data)  # (1,) ok
    rows = torch.full((4,), 0.002)
    assert torch.equal(nv.quantize(x, rows, per_row=True).data, by_tensor.data)


def test_reference_pack_unpack_round_trip():
    codes = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    assert torch.equal(reference.unpack_nibbles(reference.pack_nibbles(codes)), codes)


# --- the tiled weight layout (nvfp4_inductor/reference/tiled.py)-----------------------------------------

@pytest.mark.parametrize("n, k", [(64, 64), (80, 48), (16, 208), (200, 1040)])
def test_tile_untile_round_trip_and_padding(n, k):
    from nvfp4_inductor.reference import tiled

    data, scale, _ = _q_args(torch.randn(n, k))
    torch.library.opcheck(OPS.tile_weight.default, (data, scale))
    data_t, scale_t = OPS.tile_weight(data, scale)
    assert (data_t.shape, scale_t.shape) == tiled.tiled_shapes(n, k)
    back = tiled.untile(data_t, scale_t, n, k)
    assert torch.equal(back[0], data) and torch.equal(back[1], scale)
    # index formula of the module docstring, at a row and column inside the last tile
    r, b = n - 1, k // 2 - 1
    tiles_k = -(-k // tiled.TILE_K)
    tn, tk = r // tiled.TILE_N, b // (tiled.TILE_K // 2)
    flat = ((tn * tiles_k + tk) * tiled.TILE_N + r % tiled.TILE_N) * (tiled.TILE_K // 2) + b % (tiled.TILE_K // 2)
    assert data_t[flat] == data[r, b]
    # the scales' order inside a tile: byte 128 (r // 32) + 16 (r % 8) + 4 c + (r % 32) // 8
    for r in range(n):
        for c in range(k // 16):
            tn, tk, rr, cc = r // tiled.TILE_N, c // 4, r % tiled.TILE_N, c % 4
            flat = (tn * tiles_k + tk) * 256 + 128 * (rr // 32) + 16 * (rr % 8) + 4 * cc + (rr % 32) // 8
            assert scale_t[flat] == scale[r, c]
    # the padding (codes and scales) is zeros: tile bytes that are all nonzero, count both kinds
    scale_marks = torch.full_like(scale.view(torch.uint8), 0x3A).view(scale.dtype)
    marks = OPS.tile_weight(torch.full_like(data, 0xAB), scale_marks)
    for tiled_part, part, mark in zip(marks, (data, scale), (0xAB, 0x3A)):
        assert int((tiled_part == mark).sum()) == part.numel()
        assert int((tiled_part == 0).sum()) == tiled_part.numel() - part.numel()


@pytest.mark.parametrize("m", [1, 17])
@pytest.mark.parametrize("activation", ["bf16", "nvfp4"])
def test_linear_tiled_equals_linear(m, activation):
    x = torch.randn(m, 80, dtype=torch.bfloat16)
    w = nv.quantize(torch.randn(48, 80), per_row=m == 17)
    bias = torch.randn(48, dtype=torch.bfloat16)
    data_t, scale_t = OPS.tile_weight(w.data, w.scale.view(torch.uint8))
    args = (x, data_t, scale_t, w.global_scale, bias, 48, activation)
    torch.library.opcheck(OPS.linear_tiled.default, args)
    assert torch.equal(OPS.linear_tiled(*args), nv.linear(x, w, bias, activations=activation))
    with pytest.raises(ValueError, match="tiled w.data for N=48, K=80 must have shape"):
        OPS.linear_tiled(x, data_t[:-1], scale_t, w.global_scale, bias, 48, activation)
    with pytest.raises(ValueError, match="n must be a positive multiple of 16"):
        OPS.linear_tiled(x, data_t, scale_t, w.global_scale, bias, 40, activation)


@pytest.mark.parametrize("weight_after_cast", [False, True])
def test_linear_tiled_applies_a_deferred_rms_norm(weight_after_cast):
    """norm_h: linear(h * w, norm_h=h) is linear(rms_norm(h, w)) up to where the norm's factor
    meets the rounding (bf16's 2^-9 on x against float64); the op's own definition exactly: the
    products times rms_scale(h) per row, then the bias. 3-D h, x a 2-D view of h's rows."""
    torch.manual_seed(3)
    h = torch.randn(2, 3, 80, dtype=torch.bfloat16) * 4
    norm_w = torch.rand(80, dtype=torch.bfloat16) + 0.5
    w = nv.quantize(torch.randn(48, 80))
    bias = torch.randn(48, dtype=torch.bfloat16)
    data_t, scale_t = OPS.tile_weight(w.data, w.scale.view(torch.uint8))
    x = (norm_w * h) if weight_after_cast else (h.float() * norm_w.float()).to(h.dtype)
    args = (x.view(6, 80), data_t, scale_t, w.global_scale, bias, 48, "bf16", h, 1e-5)
    torch.library.opcheck(OPS.linear_tiled.default, args)
    y = OPS.linear_tiled(*args)
    w_f = reference.dequantize(w.data, w.scale, w.global_scale).double()
    rows = (x.view(6, 80).double() @ w_f.T) * reference.rms_scale(h, 1e-5).view(6, 1).double()
    torch.testing.assert_close(y, (rows + bias.double()).to(torch.bfloat16), rtol=2**-8, atol=2**-8)
    h_d = h.view(6, 80).double()
    truth = (h_d * torch.rsqrt(h_d.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_w.double()) @ w_f.T
    normed = reference.rms_norm(h, norm_w, 1e-5, weight_after_cast).view(6, 80)
    unfused = OPS.linear_tiled(normed, data_t, scale_t, w.global_scale, None, 48, "bf16").double()
    fused = OPS.linear_tiled(*args[:4], None, *args[5:]).double()
    err_fused, err_unfused = ((t - truth).norm() / truth.norm() for t in (fused, unfused))
    assert err_fused < 2**-8 and err_unfused < 2**-8, (err_fused, err_unfused)
    with pytest.raises(ValueError, match="norm_h must have x's rows"):
        OPS.linear_tiled(*args[:7], h[:, :2], 1e-5)
    with pytest.raises(TypeError, match="norm_h must have dtype"):
        OPS.linear_tiled(*args[:7], h.float(), 1e-5)
    with pytest.raises(ValueError, match="norm_eps must be finite and >= 0"):
        OPS.linear_tiled(*args[:8], -1.0)


def test_tile_weight_rejects_bad_input():
    data, scale, _ = _q_args(torch.randn(32, 64))
    with pytest.raises(ValueError, match="plain scales"):
        OPS.tile_weight(data, OPS.swizzle_scales(scale))  # swizzled scales: not the plain layout
    with pytest.raises(TypeError, match="data"):
        OPS.tile_weight(data.float(), scale)



def test_untile_weight_inverts_tile_weight_and_rejects_bad_input():
    data, scale, _ = _q_args(torch.randn(80, 96))
    data_t, scale_t = OPS.tile_weight(data, scale)
    torch.library.opcheck(OPS.untile_weight.default, (data_t, scale_t, 80, 96))
    back = OPS.untile_weight(data_t, scale_t, 80, 96)
    assert torch.equal(back[0], data) and torch.equal(back[1], scale)
    with pytest.raises(ValueError, match=r"n must be a positive multiple of 16; got 81"):
        OPS.untile_weight(data_t, scale_t, 81, 96)
    with pytest.raises(ValueError, match=r"tiled data for N=80, K=160 must have shape"):
        OPS.untile_weight(data_t, scale_t, 80, 160)
    with pytest.raises(TypeError, match="scale"):
        OPS.untile_weight(data_t, scale_t.float(), 80, 96)

@pytest.mark.parametrize("activation", ["bf16", "nvfp4"])
def test_linear_tiled_silu_mul_is_the_gated_mlp(activation):
    """gate and up interleaved by 32 rows into one tiled weight: silu(gate(x)) * up(x), each linear
    as linear_tiled computes it (its own global scale per row); x's global scale joins them."""
    from nvfp4_inductor.reference import tiled

    x = torch.randn(3, 80, dtype=torch.bfloat16)
    gate, up = (nv.quantize(torch.randn(64, 80)) for _ in range(2))
    data = tiled.interleave_halves(gate.data, up.data)
    scale = tiled.interleave_halves(gate.scale.view(torch.uint8), up.scale.view(torch.uint8))
    g = tiled.interleave_halves(gate.global_scale.expand(64), up.global_scale.expand(64))
    data_t, scale_t = OPS.tile_weight(data, scale)
    args = (x, data_t, scale_t, g, None, 64, activation)
    torch.library.opcheck(OPS.linear_tiled_silu_mul.default, args)
    want = nv.reference.silu_mul(nv.linear(x, gate, activations=activation), nv.linear(x, up, activations=activation))
    assert torch.equal(OPS.linear_tiled_silu_mul(*args), want)
    x_g = torch.tensor(0.5)
    scaled = OPS.linear_tiled_silu_mul(x, data_t, scale_t, g, x_g, 64, activation)
    assert torch.equal(scaled, OPS.linear_tiled_silu_mul(x, data_t, scale_t, g * x_g, None, 64, activation))
    h = torch.randn(3, 80, dtype=torch.bfloat16)  # a deferred norm: each linear's, then silu * mul
    normed = OPS.linear_tiled_silu_mul(x, data_t, scale_t, g, None, 64, activation, h, 1e-6)
    torch.library.opcheck(OPS.linear_tiled_silu_mul.default, (*args, h, 1e-6))
    want = nv.reference.silu_mul(*(OPS.linear_tiled(x, *OPS.tile_weight(part.data, part.scale.view(torch.uint8)),
                                                    part.global_scale, None, 64, activation, h, 1e-6)
                                   for part in (gate, up)))
    assert torch.equal(normed, want)
    with pytest.raises(ValueError, match="n = 48 must be a positive multiple of 32"):
        OPS.linear_tiled_silu_mul(x, data_t, scale_t, g[:96], None, 48, activation)
    with pytest.raises(ValueError, match=r"w_global_scale must have shape \(128,\)"):
        OPS.linear_tiled_silu_mul(x, data_t, scale_t, g[:64], None, 64, activation)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_backward_w4a16(dtype):
    """dL/dx = dL/dy @ W (the bf16 rounding of x passed straight through) and dL/dbias, eagerly and
    compiled; the NVFP4 weight gets none (constant data). Fine-tuning an adapter on a converted
    model (a frozen NVFP4 base) needs this."""
    torch.manual_seed(0)
    q = nv.quantize(torch.randn(48, 64))
    x = torch.randn(2, 5, 64, dtype=dtype, requires_grad=True)
    bias = torch.randn(48, dtype=dtype, requires_grad=True)
    grad = torch.randn(2, 5, 48, dtype=dtype)
    nv.linear(x, q, bias).backward(grad)
    w = nv.dequantize(q, dtype)
    assert torch.equal(x.grad, grad @ w)
    assert torch.equal(bias.grad, grad.reshape(-1, 48).sum(0))
    x2, bias2 = x.detach().requires_grad_(), bias.detach().requires_grad_()
    torch._dynamo.reset()
    torch.compile(lambda a, b: nv.linear(a, q, b), fullgraph=True)(x2, bias2).backward(grad)
    assert torch.allclose(x2.grad.float(), x.grad.float(), rtol=1e-2, atol=1e-2)
    assert torch.allclose(bias2.grad.float(), bias.grad.float(), rtol=1e-2, atol=1e-2)


def test_no_gradient_through_quantization():
    x = torch.randn(4, 64, requires_grad=True)
    q = nv.quantize(x)
    assert not q.global_scale.requires_grad
    with pytest.raises(RuntimeError, match="activation='nvfp4' quantizes x, which has no gradient"):
        nv.linear(x, nv.quantize(torch.randn(32, 64)), activations="nvfp4").sum().backward()


@pytest.mark.parametrize("static_scale", [False, True])
def test_compiled_w4a4_forward_on_x_that_requires_grad(static_scale):
    """torch.compile traces the backward with the forward: W4A4's backward raised while tracing, so
    a forward on an x that requires grad (inference outside no_grad) failed to compile, where eager
    runs it. The compiled forward runs; only a backward raises."""
    torch.manual_seed(1)
    w = nv.quantize(torch.randn(48, 64))
    scale = {"x_global_scale": torch.tensor(0.01)} if static_scale else {}

    def fn(x):
        return nv.linear(x, w, activations="nvfp4", **scale)

    x = torch.randn(3, 64, requires_grad=True)
    torch._dynamo.reset()
    y = torch.compile(fn, backend="aot_eager", fullgraph=True)(x)
    assert y.requires_grad and torch.equal(y.detach(), fn(x.detach()))
    with pytest.raises(RuntimeError, match="quantizes x, which has no gradient"):
        y.sum().backward()
    torch._dynamo.reset()


def test_adapter_trains_on_a_converted_model():
    """A LoRA-style adapter beside a converted (frozen NVFP4) linear: one SGD step lowers the loss."""
    torch.manual_seed(0)
    base = nn.Linear(64, 64)
    nv.convert(wrapper := nn.ModuleDict({"base": base}), nv.Config(activations="bf16"))
    down, up = nn.Linear(64, 8, bias=False), nn.Linear(8, 64, bias=False)
    x, target = torch.randn(16, 64), torch.randn(16, 64)
    opt = torch.optim.SGD([*down.parameters(), *up.parameters()], lr=0.1)
    losses = []
    for _ in range(2):
        loss = ((wrapper["base"](x) + up(down(x)) - target) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[1] < losses[0]


@pytest.mark.gpu
def test_linear_backward_on_cuda():
    """The CUDA kernels' backward: the same formula as on the CPU (dequantize, then grad @ W)."""
    torch.manual_seed(0)
    q = nv.quantize(torch.randn(256, 128, device="cuda"), swizzle=True)
    x = torch.randn(3, 128, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    grad = torch.randn(3, 256, dtype=torch.bfloat16, device="cuda")
    nv.linear(x, q).backward(grad)
    assert torch.equal(x.grad, grad @ nv.dequantize(q, torch.bfloat16))


# --- the ops inside a user's torch.compile with dynamic shapes ----------------------------------

def test_swizzled_ops_compile_once_for_every_row_count():
    """Size.numel() of symbolic sizes guarded on their values: swizzle=True compiled a graph a row
    count, and the recompile limit then failed fullgraph."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()

    @torch.compile(backend=counter, dynamic=True, fullgraph=True)
    def roundtrip(x):
        q = nv.quantize(x, swizzle=True)
        return q.dequantize(torch.float32), nv.linear(x, q)

    torch._dynamo.reset()
    for m in (2, 3, 5, 17, 130):
        x = torch.randn(m, 64)
        q = nv.quantize(x, swizzle=True)
        y, z = roundtrip(x)
        assert torch.equal(y, q.dequantize(torch.float32)) and torch.equal(z, nv.linear(x, q))
    assert counter.frame_count == 1
    torch._dynamo.reset()


def test_linear_tiled_takes_a_symbolic_n():
    """n = w.shape[0] of a weight passed in is a SymInt under dynamic shapes: the check wanted an
    int."""
    def tiled(x, w, g):
        data, scale, _ = OPS.quantize(w, None, False, False)
        data, scale = OPS.tile_weight(data, scale)
        return OPS.linear_tiled(x, data, scale, g, None, w.shape[0], "bf16")

    torch._dynamo.reset()
    compiled = torch.compile(tiled, backend="aot_eager", dynamic=True, fullgraph=True)
    g = torch.tensor(0.01)
    for n in (48, 80):
        x, w = torch.randn(3, 64, dtype=torch.bfloat16), torch.randn(n, 64)
        assert torch.equal(compiled(x, w, g), tiled(x, w, g))
    with pytest.raises(ValueError, match="n must be"):
        OPS.linear_tiled(x, *OPS.tile_weight(*OPS.quantize(w, None, False, False)[:2]), g, None, True, "bf16")
    torch._dynamo.reset()


def test_a_float_global_scale_argument_inside_torch_compile():
    """A float argument of a compiled function is symbolic (dynamic=True, or its second value):
    the host check read it back (data-dependent guard: fullgraph failed, else graph breaks).
    Inside torch.compile it follows the tensor rule: not finite and > 0, NaN blocks."""
    torch.manual_seed(2)
    x = torch.randn(8, 64)
    w = nv.quantize(torch.randn(32, 64))

    def fn(x, g):
        return nv.quantize(x, g).dequantize(torch.float32), nv.linear(x, w, activations="nvfp4", x_global_scale=g)

    for dynamic in (True, None):
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend="aot_eager", dynamic=dynamic, fullgraph=True)
        for g in (0.01, 0.02):
            for got, want in zip(compiled(x, g), fn(x, g)):
                assert torch.equal(got, want)
        y, z = compiled(x, -1.0)
        assert bool(y.isnan().all()) and bool(z.isnan().all())
        with pytest.raises(ValueError, match="must be finite and > 0"):
            fn(x, -1.0)  # eagerly, a Python number is checked at once
    torch._dynamo.reset()


def test_a_float_global_scale_is_filled_on_the_device_of_x():
    """A Python number as global scale becomes a tensor made on x's device, not a CPU tensor copied
    there: on CUDA that copy synchronized with the host (the README's no-sync claim) and failed
    inside a CUDA-graph capture. Checked on the meta device here: no op
    of quantize or W4A4 linear takes a CPU tensor to x's device."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class HostToDevice(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            ins, outs = ([t for t in tree_leaves(a) if isinstance(t, torch.Tensor)] for a in ((args, kwargs), out))
            if any(t.device.type == "cpu" for t in ins) and any(t.device.type == "meta" for t in outs):
                self.ops.append(func)
            return out

    x = torch.randn(8, 64, device="meta")
    w = nv.quantize(torch.randn(32, 64, device="meta"))
    with HostToDevice() as mode:
        q = nv.quantize(x, 0.01)
        y = nv.linear(x, w, activations="nvfp4", x_global_scale=0.01)
    assert mode.ops == []
    assert q.global_scale.device.type == "meta" and y.device.type == "meta"
    assert torch.equal(nv.quantize(torch.randn(8, 64), 0.01).global_scale, torch.tensor(0.01))  # fp32's 0.01
