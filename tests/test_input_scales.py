"""Static (calibrated) global scales for W4A4 activations: collect_input_scales, the x_global_scale
of nv.linear and nvfp4::quantize_values, NVFP4Linear.input_scale, Config.input_scales, and a
converted model with them under backend="nvfp4" (eagerly, compiled, and on CUDA in a CUDA graph)."""

import copy
import math

import pytest
import torch
from torch import nn
from torch._inductor.utils import run_and_get_code

import nvfp4_inductor as nv
from nvfp4_inductor import reference
from nvfp4_inductor.kernels import quantize as quantize_kernels

OPS = torch.ops.nvfp4


def _rel(got, want):
    got, want = got.double().cpu(), want.double().cpu()
    return ((got - want).norm() / want.norm()).item()


def _mlp(seed=0, dtype=torch.bfloat16):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32)).to(dtype).eval()


def _static_reference(x, w, bias, g_x):
    """W4A4 with x's global scale given: x quantized with g_x and decoded, products in fp32."""
    x_q = reference.dequantize(*reference.quantize(x, g_x), torch.float32)
    y = x_q @ w.dequantize(torch.float32).T
    return y if bias is None else y + bias.float()


@pytest.mark.parametrize("shape", [(1, 16), (7, 4096), (3, 5, 64)])
def test_quantize_values_static_scale_kernel_matches_reference(kernel_device, shape):
    gen = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=gen) * 3).to(torch.bfloat16)
    # half the dynamic scale: the largest blocks saturate at 448 and 6
    g = reference.compute_global_scale(x) / 2
    data, scale, want_g = reference.quantize(x, g)
    want = reference.dequantize(data, scale, torch.tensor(1.0), torch.float32)
    values, _, got_g = quantize_kernels.quantize(x.to(kernel_device), g.to(kernel_device), False, False,
                                                 values=True)
    assert torch.equal(values.cpu().float(), want) and torch.equal(got_g.cpu(), want_g)
    op_values, op_g = OPS.quantize_values(x.to(kernel_device), g.to(kernel_device))
    assert torch.equal(op_values.cpu().float(), want) and torch.equal(op_g.cpu(), g)
    assert (want.abs().amax() == 6 * 448)  # saturated: the static scale is used, not x's amax
    assert torch.equal(OPS.quantize_values(x, g)[0].float(), want)  # the CPU op: the reference


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_linear_with_a_static_x_scale(dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 64, generator=gen).to(dtype)
    w = nv.quantize(torch.randn(48, 64, generator=gen))
    bias = torch.randn(48, generator=gen).to(dtype)
    for g_x in (0.002, torch.tensor(0.0007)):  # 0.0007: x saturates
        got = nv.linear(x, w, bias, activations="nvfp4", x_global_scale=g_x)
        assert got.dtype == dtype and got.shape == (2, 5, 48)
        want = _static_reference(x, w, bias, torch.as_tensor(g_x, dtype=torch.float32))
        assert _rel(got, want) <= (1e-6 if dtype == torch.float32 else 4e-3)
    # the scale the dynamic rule computes from x: the dynamic result, up to fp32 rounding order
    dynamic = nv.linear(x, w, bias, activations="nvfp4")
    same = nv.linear(x, w, bias, activations="nvfp4", x_global_scale=reference.compute_global_scale(x))
    assert _rel(same, dynamic) <= (1e-6 if dtype == torch.float32 else 4e-3)


def test_linear_static_x_scale_errors():
    x, w = torch.randn(4, 64), nv.quantize(torch.randn(32, 64))
    with pytest.raises(ValueError, match='needs activations="nvfp4"'):
        nv.linear(x, w, x_global_scale=0.1)
    with pytest.raises(ValueError, match=r"x_global_scale \(per tensor\) must have shape \(\)"):
        nv.linear(x, w, activations="nvfp4", x_global_scale=torch.ones(4))
    with pytest.raises(ValueError, match="x_global_scale must be finite and > 0"):
        nv.linear(x, w, activations="nvfp4", x_global_scale=-1.0)
    with pytest.raises(TypeError, match="x_global_scale must have dtype float32"):
        nv.linear(x, w, activations="nvfp4", x_global_scale=torch.tensor(0.1, dtype=torch.float64))
    # no gradient for x, as dynamic W4A4: the forward runs, a backward raises
    y = nv.linear(x.clone().requires_grad_(), w, activations="nvfp4", x_global_scale=0.1)
    with pytest.raises(RuntimeError, match="quantizes x, which has no gradient"):
        y.sum().backward()
    with pytest.raises(TypeError, match="global_scale must have dtype float32"):
        OPS.quantize_values(x, torch.tensor(1, dtype=torch.int32))


def test_collect_input_scales():
    model = _mlp(dtype=torch.float32)
    batches = [torch.randn(3, 5, 64), torch.randn(7, 64) * 4]
    scales = nv.collect_input_scales(model, batches)
    assert sorted(scales) == ["0", "2"]
    x0 = torch.cat([b.reshape(-1, 64) for b in batches])
    x2 = torch.relu(model[0](x0)).detach()
    for name, x in (("0", x0), ("2", x2)):
        assert scales[name].dtype == torch.float32 and scales[name].shape == ()
        assert torch.equal(scales[name], reference.compute_global_scale(x))
    assert not model[0]._forward_pre_hooks  # hooks removed
    assert sorted(nv.collect_input_scales(model, batches, include=lambda name, m: name == "2")) == ["2"]
    with pytest.raises(ValueError, match="layer '0' saw only zeros"):
        nv.collect_input_scales(model, [torch.zeros(2, 64)])
    nan = torch.randn(2, 64)
    nan[1, 3] = math.nan
    with pytest.raises(ValueError, match="layer '0' saw a NaN or Inf input"):
        nv.collect_input_scales(model, [nan])
    with pytest.warns(UserWarning, match="training mode"):
        nv.collect_input_scales(model.train(), batches)


def test_converted_layers_quantize_x_with_their_input_scale():
    model = _mlp()
    batches = [torch.randn(4, 64, dtype=torch.bfloat16) for _ in range(3)]
    scales = nv.collect_input_scales(model, batches)
    static = copy.deepcopy(model)
    config = nv.Config(activations="nvfp4", input_scales=scales, skip_output_head=False)
    assert nv.convert(static, config).converted == ["0", "2"]
    assert torch.equal(static[0].input_scale, scales["0"]) and "static input_scale" in repr(static)
    x = torch.randn(4, 64, dtype=torch.bfloat16) * 2  # beyond the calibrated range: saturates
    with torch.no_grad():
        h = nv.linear(x, static[0].nvfp4_weight(), static[0].bias, activations="nvfp4",
                      x_global_scale=scales["0"])
        want = nv.linear(torch.relu(h), static[2].nvfp4_weight(), static[2].bias, activations="nvfp4",
                         x_global_scale=scales["2"])
        assert torch.equal(static(x), want)
        # W4A16 layers have no use for the scale; clearing it gives back the dynamic scale
        static[0].activations = "bf16"
        assert torch.equal(static[0](x), nv.linear(x, static[0].nvfp4_weight(), static[0].bias))
        static[0].activations = "nvfp4"
        static[0].set_input_scale(None)
        assert torch.equal(static[0](x), nv.linear(x, static[0].nvfp4_weight(), static[0].bias,
                                                   activations="nvfp4"))
    with pytest.raises(ValueError, match=r"no input scale for layers \['2'\]"):
        nv.convert(copy.deepcopy(model), nv.Config(activations="nvfp4", input_scales={"0": scales["0"]},
                                                   skip_output_head=False))
    with pytest.raises(TypeError, match="input_scales must be a dict"):
        nv.Config(input_scales=[scales["0"]])
    with pytest.raises(ValueError, match='they need activations="nvfp4"'):
        nv.Config(activations="bf16", input_scales=scales)
    # checked before any layer is replaced
    partial = copy.deepcopy(model)
    with pytest.raises(ValueError, match=r"input_scales\['2'\] must be finite and > 0"):
        nv.convert(partial, nv.Config(activations="nvfp4", input_scales={**scales, "2": torch.tensor(-1.0)},
                                      skip_output_head=False))
    assert type(partial[0]) is nn.Linear
    with pytest.raises(ValueError, match="input_scale must be finite and > 0"):
        static[2].set_input_scale(torch.tensor(0.0))
    with pytest.raises(ValueError, match="one per-tensor scale"):
        static[2].set_input_scale(torch.ones(2))
    with pytest.raises(TypeError, match="input_scale must have dtype float32"):
        static[2].set_input_scale(torch.tensor(0.1, dtype=torch.float16))


def test_input_scale_in_state_dicts_and_module_casts():
    model = _mlp()
    scales = nv.collect_input_scales(model, [torch.randn(4, 64, dtype=torch.bfloat16)])
    static = copy.deepcopy(model)
    nv.convert(static, nv.Config(activations="nvfp4", input_scales=scales, skip_output_head=False))
    state = static.state_dict()
    assert torch.equal(state["0.input_scale"], scales["0"])
    fresh = copy.deepcopy(model)
    nv.convert(fresh, nv.Config(activations="nvfp4", skip_output_head=False))
    assert "0.input_scale" not in fresh.state_dict()  # dynamic: nothing saved
    fresh.load_state_dict(state)  # a calibrated checkpoint sets the scales
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(fresh(x), static(x))
    static.half()
    assert static[0].input_scale.dtype == torch.float32 and torch.equal(static[0].input_scale, scales["0"])
    # a checkpoint's scale is checked as set_input_scale checks it; a failed load leaves no slot
    for bad, match in ((torch.tensor(0.0), "finite and > 0"), (torch.tensor(float("nan")), "finite and > 0"),
                       (torch.tensor([1.0, 2.0]), "one per-tensor scale"), (torch.tensor(1), "dtype")):
        dynamic = copy.deepcopy(model)
        nv.convert(dynamic, nv.Config(activations="nvfp4", skip_output_head=False))
        with pytest.raises(RuntimeError, match=match):
            dynamic.load_state_dict({**state, "0.input_scale": bad}, strict=False)
        assert dynamic[0].input_scale is None
    fresh.load_state_dict({**state, "0.input_scale": scales["0"].reshape(1) * 2})  # shape (1,) loads
    assert fresh[0].input_scale.shape == () and torch.equal(fresh[0].input_scale, scales["0"] * 2)


def test_backend_rejects_input_scales_and_compiles_a_calibrated_model():
    model = _mlp()
    scales = nv.collect_input_scales(model, [torch.randn(4, 64, dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match="cannot use Config.input_scales"):
        nv.compile(model, nv.Config(activations="nvfp4", input_scales=scales))
    nv.convert(model, nv.Config(activations="nvfp4", input_scales=scales, skip_output_head=False))
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            y, code = run_and_get_code(nv.compile(model, fullgraph=True), x)
            assert torch.equal(y, model(x))
    finally:
        torch._dynamo.reset()
    source = "\n".join(code)
    # the weights tiled at compile time; x quantized with the constant scale, multiplied as W4A16
    assert source.count("torch.ops.nvfp4.linear_tiled.default(") == 2
    assert source.count("torch.ops.nvfp4.quantize_values.default(") == 2
    assert "torch.ops.nvfp4.linear.default(" not in source


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 7, 33, 257])  # the skinny kernel; dequantize + cuBLASLt
def test_static_x_scale_on_cuda_matches_the_cpu_and_replays_in_a_cuda_graph(m):
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, 1024, generator=gen, dtype=torch.bfloat16)
    w = nv.quantize(torch.randn(512, 1024, generator=gen))
    bias = torch.randn(512, generator=gen, dtype=torch.bfloat16)
    g_x = reference.compute_global_scale(x) * 0.75
    want = nv.linear(x, w, bias, activations="nvfp4", x_global_scale=g_x)
    w_cuda = nv.NVFP4(*(t.cuda() if isinstance(t, torch.Tensor) else t for t in w))
    x_cuda, bias_cuda, g_cuda = x.cuda(), bias.cuda(), g_x.cuda()

    def run():
        return nv.linear(x_cuda, w_cuda, bias_cuda, activations="nvfp4", x_global_scale=g_cuda)

    got = run()
    assert got.dtype == torch.bfloat16 and _rel(got, want.float()) <= 1e-3
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            out = run()
        x_cuda.copy_(x_cuda * 2)  # new input, same buffers: the graph reads them again
        graph.replay()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    want2 = nv.linear(x * 2, w, bias, activations="nvfp4", x_global_scale=g_x)
    assert _rel(out, want2.float()) <= 1e-3


@pytest.mark.gpu
def test_calibrated_model_compiled_on_cuda_with_cuda_graphs():
    model = _mlp().cuda()
    scales = nv.collect_input_scales(model, [torch.randn(4, 64, dtype=torch.bfloat16, device="cuda")])
    nv.convert(model, nv.Config(activations="nvfp4", input_scales=scales, skip_output_head=False))
    x = torch.randn(2, 64, dtype=torch.bfloat16, device="cuda")
    from torch._dynamo.utils import counters

    counters.clear()
    torch._dynamo.reset()
    try:
        compiled = nv.compile(model, mode="reduce-overhead", fullgraph=True)
        with torch.no_grad():
            want = model(x)
            for _ in range(3):  # compile, warm up, record
                got = compiled(x).clone()
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                replayed = compiled(x).clone()
            finally:
                torch.cuda.set_sync_debug_mode(0)
    finally:
        torch._dynamo.reset()
    assert counters["inductor"]["cudagraph_skips"] == 0
    for y in (got, replayed):
        assert _rel(y, want.float()) <= 1e-3
