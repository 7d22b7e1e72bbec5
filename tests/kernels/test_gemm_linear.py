"""kernels/gemm.py: the CUDA implementations of nvfp4::linear / linear_tiled (the plan's kernel:
split-K, or dequantize + cuBLASLt) against the reference linear: on CUDA (marked gpu), and on CPU
tensors through the interpreted kernels."""

import pytest
import torch

import nvfp4_inductor as nv
from helpers.pdl import late_copy
from nvfp4_inductor import capability
from nvfp4_inductor.kernels import gemm, plan

OPS = torch.ops.nvfp4


def _rel(got, want):
    got, want = got.double().cpu(), want.double().cpu()
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 7, 24, 33, 257])
@pytest.mark.parametrize("n, k", [(48, 64), (80, 160), (96, 1344), (1024, 1056)])
@pytest.mark.parametrize("activation", ["bf16", "nvfp4"])
def test_linear_on_cuda_matches_reference(m, n, k, activation):
    gen = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=gen, dtype=torch.bfloat16)
    bias = torch.randn(n, generator=gen, dtype=torch.bfloat16)
    for swizzled in (False, True):
        w = nv.quantize(torch.randn(n, k, generator=gen), swizzle=swizzled)
        want = nv.linear(x, w, bias, activations=activation)  # CPU: the reference
        w_cuda = nv.NVFP4(*(t.cuda() if isinstance(t, torch.Tensor) else t for t in w))
        got = nv.linear(x.cuda(), w_cuda, bias.cuda(), activations=activation)
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        assert _rel(got, want.float()) <= 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 7, 16, 24, 33])
@pytest.mark.parametrize("activation", ["bf16", "nvfp4"])
def test_linear_tiled_on_cuda_matches_reference(m, activation):
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(2, m, 1040, generator=gen, dtype=torch.bfloat16)  # K padded to 1088 in tiles
    bias = torch.randn(1056, generator=gen, dtype=torch.bfloat16)
    w = nv.quantize(torch.randn(1056, 1040, generator=gen), per_row=m % 2 == 1)
    data_t, scale_t = OPS.tile_weight(w.data, w.scale.view(torch.uint8))
    want = nv.linear(x, w, bias, activations=activation)  # CPU: the reference
    got = OPS.linear_tiled(x.cuda(), data_t.cuda(), scale_t.cuda(), w.global_scale.cuda(), bias.cuda(),
                           1056, activation)
    assert got.dtype == torch.bfloat16 and got.shape == (2, m, 1056)
    assert _rel(got, want.float()) <= 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 64, 300])
@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16])
def test_linear_on_cuda_ignores_a_users_autocast(m, autocast_dtype):
    """The CUDA linears inside torch.autocast give what they give outside it: the dequantize +
    cuBLAS paths (M > 16) multiply through torch.mm, which autocast would run in fp16."""
    gen = torch.Generator().manual_seed(m)
    x = (torch.randn(m, 1024, generator=gen) * 8).to(torch.bfloat16).cuda()
    bias = torch.randn(320, generator=gen).cuda()
    w = nv.quantize(torch.randn(320, 1024, generator=gen).cuda())
    data_t, scale_t = OPS.tile_weight(w.data, w.scale.view(torch.uint8))
    calls = [lambda: nv.linear(x, w, bias), lambda: nv.linear(x.float(), w, bias),
             lambda: OPS.linear_tiled(x, data_t, scale_t, w.global_scale, bias, 320, "bf16")]
    want = [call() for call in calls]
    with torch.autocast("cuda", dtype=autocast_dtype):
        got = [call() for call in calls]
    for g, w_ in zip(got, want):
        assert g.dtype == w_.dtype and torch.equal(g, w_)


@pytest.mark.gpu
def test_linear_tiled_on_cuda_takes_tiled_weights_off_word_boundaries():
    """Tiled codes or scales in views off the register-fed loads' boundaries (8 and 4 bytes) run
    the tl.dot mainloop instead: the same result."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 1024, generator=gen, dtype=torch.bfloat16).cuda()
    w = nv.quantize(torch.randn(192, 1024, generator=gen))
    data_t, scale_t = (t.cuda() for t in OPS.tile_weight(w.data, w.scale.view(torch.uint8)))
    want = nv.linear(x.cpu(), w).float()

    def shifted(t, by):
        out = torch.empty(t.numel() + by, dtype=t.dtype, device=t.device)[by:]
        return out.copy_(t)

    for data, scale in ((data_t, scale_t), (shifted(data_t, 4), scale_t), (data_t, shifted(scale_t, 2))):
        got = OPS.linear_tiled(x, data, scale, w.global_scale.cuda(), None, 192, "bf16")
        assert _rel(got.cpu(), want) <= 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("m, tiled, activation", [(1, True, "bf16"), (1, True, "nvfp4"), (16, True, "bf16"),
                                                  (33, True, "bf16"), (1, False, "bf16"), (20, False, "bf16")])
@pytest.mark.parametrize("late", ["x", "codes"])
def test_skinny_gemm_waits_for_a_pdl_producer(m, tiled, activation, late):
    """The skinny GEMM is launched with programmatic dependent launch (on sm_90+): it
    may start while the kernel before it runs, so it must wait before it reads x or the weights. The
    producer releases it at once and writes x (or the weight codes) ~0.5 ms later; a GEMM that read
    early would see zeros. Register-fed (M = 1 / 16 / 20) and tl.dot (M = 33, tiled) mainloops; W4A4
    quantizes x in a kernel of its own first (on PDL too)."""
    assert capability.sm90_or_later(torch.device("cuda"))
    gen = torch.Generator().manual_seed(m + tiled)
    x = torch.randn(m, 1024, generator=gen, dtype=torch.bfloat16).cuda()
    w = nv.quantize(torch.randn(4096, 1024, generator=gen).cuda())
    data_t, scale_t = OPS.tile_weight(w.data, w.scale.view(torch.uint8))
    if tiled:
        def linear(x, codes):
            return OPS.linear_tiled(x, codes, scale_t, w.global_scale, None, 4096, activation)
        codes = data_t
    else:
        def linear(x, codes):
            return nv.linear(x, w._replace(data=codes), activations=activation)
        codes = w.data
    want = linear(x, codes)  # also compiles the kernels outside the timed sequence
    operands = {"x": x, "codes": codes}
    target = torch.zeros_like(operands[late])
    operands[late] = target
    torch.cuda.synchronize()
    late_copy(x if late == "x" else codes, target)
    got = linear(operands["x"], operands["codes"])
    assert torch.equal(got, want)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the gpu-marked tests run these paths")
@pytest.mark.parametrize("m", [1, 5, 20])
@pytest.mark.parametrize("activation", ["bf16", "nvfp4"])
def test_cuda_linear_launchers_under_the_interpreter(m, activation, monkeypatch):
    """The CUDA implementations of nvfp4::linear / linear_tiled (path choice, activation operand,
    global scales, tiled dequantize) run on CPU tensors through the interpreted kernels; the
    cuBLASLt GEMM is stood in for by an fp32 matmul. Tolerance: the interpreter truncates fp32 ->
    bf16 (up to 1 ulp) where the GPU rounds; the GPU tests hold these paths to 1e-3."""
    from nvfp4_inductor.reference import tiled

    from nvfp4_inductor.kernels import cublaslt

    def scaled_mm(a, b, alpha, bias, out_dtype):  # cuBLASLt's numbers: fp32, rounded once
        y = (a.float() @ b.float().T) * alpha
        return (y if bias is None else y + bias.float()).to(out_dtype)

    monkeypatch.setattr(cublaslt, "scaled_mm", scaled_mm)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, 96, generator=gen).to(torch.bfloat16)
    w = nv.quantize(torch.randn(48, 96, generator=gen), per_row=m == 5)
    bias = torch.randn(48, generator=gen).to(torch.bfloat16)
    want = nv.linear(x, w, bias, activations=activation).float()  # the reference
    parts = (w.data, w.scale.view(torch.uint8), w.global_scale)
    got = gemm.linear(x, *parts, bias, False, activation)  # the plan's kernel: split-K at these M
    assert _rel(got, want) <= 1e-2
    if w.global_scale.dim():  # per-row scales as a strided view: each row still gets its own
        strided = torch.stack([w.global_scale, torch.zeros_like(w.global_scale)], 1)[:, 0]
        assert not strided.is_contiguous()
        assert torch.equal(gemm.linear(x, *parts[:2], strided, bias, False, activation), got)
    # dequantize + cuBLASLt, the plan's kernel above the decode sizes, at this M
    monkeypatch.setattr(plan, "SPLITK_MAX_M", 0)
    assert _rel(gemm.linear(x, *parts, bias, False, activation), want) <= 1e-2
    monkeypatch.setattr(plan, "SPLITK_MAX_M", 32)
    data_t, scale_t = tiled.tile(parts[0], parts[1])
    assert _rel(gemm.linear_tiled(x, data_t, scale_t, w.global_scale, bias, 48, activation), want) <= 1e-2
    if activation == "bf16":  # the backend's prefill extern (g read on the device)
        got = gemm.scaled_mm_tiled(x, data_t, scale_t, w.global_scale, bias, 48, torch.bfloat16)
        assert got.dtype == torch.bfloat16 and _rel(got, want) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [5, 130])  # the skinny kernel; dequantize + cuBLASLt
@pytest.mark.parametrize("activation", ["bf16", "nvfp4"])
def test_linear_on_cuda_output_dtypes_and_3d(dtype, rows, activation):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(2, rows, 128, generator=gen).to(dtype)
    bias = torch.randn(64, generator=gen).to(dtype)
    w = nv.quantize(torch.randn(64, 128, generator=gen))
    want = nv.linear(x, w, bias, activations=activation)
    w_cuda = nv.NVFP4(*(t.cuda() if isinstance(t, torch.Tensor) else t for t in w))
    got = nv.linear(x.cuda(), w_cuda, bias.cuda(), activations=activation)
    assert got.dtype == dtype and got.shape == (2, rows, 64)
    assert _rel(got, want.float()) <= 1e-3


@pytest.mark.gpu
def test_linear_of_one_output_feature_at_large_m():
    """N = 1 above the skinny kernels' M (dequantize + cuBLASLt; torch avoids cuBLASLt there)."""
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(1, 128, generator=gen).to(torch.bfloat16)
    x = torch.randn(300, 128, generator=gen).to(torch.bfloat16)
    bias = torch.randn(1, generator=gen).to(torch.bfloat16)
    want = nv.linear(x, nv.quantize(w), bias)  # the CPU reference
    got = nv.linear(x.cuda(), nv.quantize(w.cuda()), bias.cuda())
    assert _rel(got.cpu(), want) <= 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["bf16", "nvfp4"])
def test_large_m_linear_in_cuda_graph_without_host_sync(activation):
    """The dequantize + cuBLASLt path reads the global scales on the device: capturable, no sync,
    and each replay uses the x (and for W4A4 its dynamic scale) of that replay."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(257, 1040, generator=gen, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(1056, generator=gen, device="cuda", dtype=torch.bfloat16)
    w = nv.quantize(torch.randn(1056, 1040, generator=gen, device="cuda"), per_row=activation == "bf16")
    data_t, scale_t = OPS.tile_weight(w.data, w.scale.view(torch.uint8))

    def step():
        return (nv.linear(x, w, bias, activations=activation),
                OPS.linear_tiled(x, data_t, scale_t, w.global_scale, bias, 1056, activation))

    step()  # compile the kernels, plan the GEMM outside the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for scale in (1.0, 3.0):
        x.copy_(torch.randn(x.shape, generator=gen, device="cuda") * scale)
        graph.replay()
        want = nv.linear(x.cpu(), nv.NVFP4(*(t.cpu() if isinstance(t, torch.Tensor) else t for t in w)),
                         bias.cpu(), activations=activation)  # the reference
        for got in outs:
            assert _rel(got, want.float()) <= 1e-3


@pytest.mark.gpu
def test_w4a4_sqnr_against_bf16_on_cuda():
    torch.manual_seed(4)
    x = torch.randn(64, 512, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(256, 512, dtype=torch.bfloat16, device="cuda")
    ref = (x.float() @ w.float().T).double()
    got = nv.linear(x, nv.quantize(w), activations="nvfp4").double()
    sqnr = 10 * torch.log10(ref.pow(2).sum() / (ref - got).pow(2).sum()).item()
    assert sqnr > 14.0  # the reference gives 17.3 dB on the same data (tests/test_ops.py)
