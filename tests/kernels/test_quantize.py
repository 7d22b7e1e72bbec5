"""kernels/quantize.py against the reference, bit for bit: the quantize kernel (dynamic, static and
per-row global scales, swizzled scales, special blocks), its encode helpers, quantize_values and
the fused RMSNorm + quantize_values.

On a machine without a GPU the kernels run under the Triton interpreter (small sizes); on a GPU
the same tests run on CUDA, plus the `gpu`-marked ones (large shapes, PDL, CUDA graphs, no host
sync).
"""

import math

import pytest
import torch
import triton
import triton.language as tl

import nvfp4_inductor as nv
from helpers.inputs import DISTS, sample, scalable_values, times_power_of_two
from helpers.pdl import late_copy
from nvfp4_inductor import capability
from nvfp4_inductor.format import GLOBAL_SCALE_DIVISOR
from nvfp4_inductor.kernels.device import common as _common
from nvfp4_inductor.kernels import dequantize as dequantize_kernels
from nvfp4_inductor.kernels import quantize as quantize_kernels

OPS = torch.ops.nvfp4
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _reference_quantize(x, g, per_row, swizzle):
    """The reference: on CPU tensors the op runs its default (pure-torch) implementation."""
    return OPS.quantize(x.cpu(), None if g is None else g.cpu(), per_row, swizzle)


def _assert_quantize_matches(x, g=None, per_row=False, swizzle=False):
    got = quantize_kernels.quantize(x, g, per_row, swizzle)
    want = _reference_quantize(x, g, per_row, swizzle)
    for name, a, b in zip(("data", "scale", "global_scale"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        if name == "global_scale":  # a given NaN global scale is passed through
            torch.testing.assert_close(a.cpu(), b, rtol=0, atol=0, equal_nan=True)
        else:
            assert torch.equal(a.cpu(), b), f"{name} differs in {int((a.cpu() != b).sum())} places"
    return got


# Shapes: single block, odd rows, K not a multiple of the tile, 3-D, and one above the
# fused-amax size (two-pass dynamic scale).
SHAPES = [(1, 16), (157, 48), (3, 5, 64), (7, 4096), (300, 256)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("swizzle", [False, True])
@pytest.mark.parametrize("mode", ["dynamic", "static", "dynamic_row", "static_row"])
def test_quantize_kernel_matches_reference(kernel_device, shape, swizzle, mode):
    gen = torch.Generator().manual_seed(hash((shape, swizzle, mode)) % 2**31)
    dtype = DTYPES[len(shape) % 3]
    x = (sample("normal", shape, gen) * 3).to(dtype).to(kernel_device)
    per_row = mode.endswith("row")
    g = None
    if mode == "static":
        g = torch.tensor(0.5 * x.float().abs().max().item() / GLOBAL_SCALE_DIVISOR)  # saturates some
    elif mode == "static_row":
        g = torch.rand(shape[:-1], generator=gen) * 1e-3 + 1e-4
    if g is not None:
        g = g.to(kernel_device)
    _assert_quantize_matches(x, g, per_row, swizzle)


def test_static_row_scales_with_any_strides(kernel_device):
    """A per-row static scale given as a transposed view: each row still gets its own scale (the
    kernel reads the scales as a contiguous list of rows), and the returned scale is contiguous,
    as the fake kernel says."""
    gen = torch.Generator().manual_seed(11)
    x = (torch.randn(4, 6, 32, generator=gen) * 3).to(torch.bfloat16).to(kernel_device)
    g_t = (torch.rand(6, 4, generator=gen) * 1e-3 + 1e-4).to(kernel_device).t()
    assert not g_t.is_contiguous()
    got = _assert_quantize_matches(x, g_t, True, False)
    want = _reference_quantize(x, g_t.contiguous(), True, False)
    for a, b in zip(got, want):
        assert torch.equal(a.cpu(), b)
    assert got[2].is_contiguous() and _reference_quantize(x, g_t, True, False)[2].is_contiguous()
    data, scale, g = (t.to(kernel_device) for t in want)
    g_strided = g.t().contiguous().t()  # the same per-row scales, other strides
    assert not g_strided.is_contiguous()
    for rows in (None, torch.tensor([5, 0, 3], device=kernel_device)):
        want_x = dequantize_kernels.dequantize(data, scale, g, False, torch.float32, rows)
        got_x = dequantize_kernels.dequantize(data, scale, g_strided, False, torch.float32, rows)
        assert torch.equal(got_x, want_x)


@pytest.mark.parametrize("swizzle", [False, True])
@pytest.mark.parametrize("mode", ["dynamic", "static", "static_row"])
def test_quantize_row_tiles_beyond_the_grid_rows(kernel_device, monkeypatch, swizzle, mode):
    """Row tiles past the grid's second dimension (65535 on CUDA, a million rows) go to its third:
    with that limit at 2, 70 rows (5 row tiles) run on a 2 x 3 grid of row tiles, one of them past
    the last row (it must store nothing)."""
    monkeypatch.setattr(quantize_kernels, "MAX_GRID_Y", 2)
    gen = torch.Generator().manual_seed(7)
    x = (sample("normal", (70, 272), gen) * 3).to(torch.bfloat16).to(kernel_device)
    g = {"dynamic": None, "static": torch.tensor(1e-3),
         "static_row": torch.rand(70, generator=gen) * 1e-3 + 1e-4}[mode]
    _assert_quantize_matches(x, None if g is None else g.to(kernel_device), mode == "static_row",
                             swizzle)


@pytest.mark.parametrize("dist", DISTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_kernel_distributions(kernel_device, dist, dtype):
    gen = torch.Generator().manual_seed(hash((dist, str(dtype))) % 2**31)
    x = sample(dist, (33, 96), gen).to(dtype).to(kernel_device)
    _assert_quantize_matches(x)
    # Static g = 1 keeps the grid distribution's exact ties (its block scales are powers of two).
    _assert_quantize_matches(x, torch.tensor(1.0, device=kernel_device), swizzle=True)


@triton.jit
def _rounding_kernel(y_ptr, t_ptr, code_ptr, e4m3_ptr, back_ptr, n, HW: tl.constexpr, BLOCK: tl.constexpr):
    """The encode helpers the quantize kernel uses, element by element: E2M1 code of y (sign from
    y's bit), e4m3 bits of t and those bits back to fp32."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    y = tl.load(y_ptr + offs, mask=ok)
    sign = (y.to(tl.int32, bitcast=True) >> 28) & 8
    tl.store(code_ptr + offs, ((_common.e2m1_index_bits(y) & 7) | sign).to(tl.uint8), mask=ok)
    bits = _common.e4m3_rne_bits(tl.load(t_ptr + offs, mask=ok), HW)
    tl.store(e4m3_ptr + offs, bits.to(tl.uint8), mask=ok)
    tl.store(back_ptr + offs, _common.e4m3_bits_to_f32(bits, HW), mask=ok)


def _near(points: torch.Tensor, ulps: int) -> torch.Tensor:
    """fp32 points and their neighbours up to `ulps` apart (bit patterns, positive points)."""
    bits = points.float().view(torch.int32)
    return torch.cat([(bits + d).view(torch.float32) for d in range(-ulps, ulps + 1)])


@pytest.mark.parametrize("hw", [False, True])
def test_rounding_helpers_match_the_reference(kernel_device, hw):
    """E2M1 encode (the min-of-three-roundings formula) and the e4m3 conversions (bit formulas, or
    with hw the GPU's cvt instructions) on every tie and its neighbours, and a dense sweep."""
    if hw and kernel_device != "cuda":
        pytest.skip("the hardware conversions need a CUDA GPU")
    gen = torch.Generator().manual_seed(11)
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.5, 1.0, 2.0, 4.0])
    y = torch.cat([_near(midpoints, 4), torch.linspace(0, 7, 70001), torch.rand(50000, generator=gen) * 7,
                   torch.tensor([0.0, 1e-40, 1e30, math.inf, math.nan])])
    y = torch.cat([y, -y])
    e4m3 = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    ties = (e4m3[1:] + e4m3[:-1]) / 2  # exact in fp32
    n = y.numel()
    t = torch.cat([_near(torch.cat([ties, e4m3[1:]]), 3), torch.tensor([0.0])]).clamp(0, 448)
    t = torch.cat([t, torch.rand(n - t.numel(), generator=gen) * 448])  # as many as y
    out = [torch.empty(n, dtype=dt, device=kernel_device) for dt in (torch.uint8, torch.uint8, torch.float32)]
    _rounding_kernel[(triton.cdiv(n, 1024),)](y.to(kernel_device), t.to(kernel_device), *out, n, HW=hw,
                                             BLOCK=1024)
    code, bits, back = (o.cpu() for o in out)
    finite = y.abs() < math.inf  # NaN and +-inf blocks never reach the encode (all +0 there)
    assert torch.equal(code[finite], nv.reference.e2m1_encode(y)[finite])
    assert torch.equal(bits, t.to(torch.float8_e4m3fn).view(torch.uint8))
    assert torch.equal(back, t.to(torch.float8_e4m3fn).float())


def test_quantize_kernel_special_blocks(kernel_device):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(5, 160, generator=gen)
    x[0, :16] = 0.0                                   # zero block
    x[0, 16:32] = 1e-30                               # scale underflows to 0
    x[1, :16] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * 2)  # ties (g below)
    x[1, 32] = 5e3                                    # outlier: the amax
    x[2, 0], x[2, 20], x[2, 40] = math.nan, math.inf, -math.inf  # non-finite blocks
    x[3, :16] = -0.0                                  # negative zero
    x[4, 16:32] = torch.randn(16, generator=gen) * 2**-12  # subnormal e4m3 scales (g = 1)
    x = x.to(kernel_device)
    _assert_quantize_matches(x)
    _assert_quantize_matches(x, swizzle=True, per_row=True)
    _assert_quantize_matches(x, torch.tensor(1.0, device=kernel_device))  # saturation at 448
    for bad_g in (0.0, -2.0, math.nan, math.inf):
        _assert_quantize_matches(x, torch.tensor(bad_g, device=kernel_device), swizzle=True)


@pytest.mark.parametrize("e", [-91, -126, -134])
def test_quantize_kernel_tiny_global_scales(kernel_device, e):
    """g below 2^-100 (x and g scaled by 2^64 before r = 1 / (s g)): the kernel's codes and scales
    are the reference's, static (then x's own at g = 2^-10, as the reference test shows) and
    dynamic (g subnormal), per tensor and per row, in fp32 and, where it holds the values, bf16.
    Unscaled, r overflows below a block amax of ~1.8e-38 and the kernel's zeros become +-6."""
    gen = torch.Generator().manual_seed(-e)
    x = scalable_values((5, 96), gen)
    scaled = times_power_of_two(x, e)
    g = torch.tensor(2.0**-10 * 2.0**e, device=kernel_device)
    got = _assert_quantize_matches(scaled.to(kernel_device), g)
    want = _reference_quantize(x, torch.tensor(2.0**-10), False, False)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
    for dtype in (torch.float32, torch.bfloat16):
        xd = scaled.to(dtype)
        if dtype != torch.float32 and not torch.equal(xd.float(), scaled):
            continue  # below bf16's subnormals
        _assert_quantize_matches(xd.to(kernel_device))
        _assert_quantize_matches(xd.to(kernel_device), per_row=True, swizzle=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (3, 256)])
def test_quantize_fused_amax_skips_non_finite(kernel_device, dtype, shape):
    """The decode-sized dynamic scale (one launch, every program reduces all of x; bf16 / fp16 on
    the bits): NaN and +-Inf are skipped, the largest finite magnitude of the dtype, negative,
    is the amax, and x with nothing finite but zeros gets g = 1."""
    assert quantize_kernels.fits_fused_amax(math.prod(shape[:-1]), shape[-1])
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(shape, generator=gen).to(dtype)
    big = torch.finfo(dtype).max
    flat = x.view(-1)
    flat[3], flat[17], flat[30] = math.nan, math.inf, -math.inf
    flat[40] = -big                                   # the amax: bits just below Inf's
    flat[50] = torch.finfo(dtype).tiny / 4 if dtype != torch.bfloat16 else 1e-40  # subnormal
    _assert_quantize_matches(x.to(kernel_device))
    flat[40] = 0.0
    _assert_quantize_matches(x.to(kernel_device))     # amax from the random values
    none_finite = torch.full(shape, math.inf, dtype=dtype)
    none_finite.view(-1)[::2] = -0.0
    none_finite.view(-1)[1] = math.nan
    got = _assert_quantize_matches(none_finite.to(kernel_device))
    assert got[2].item() == 1.0


def test_quantize_kernel_empty_and_strided(kernel_device):
    for per_row in (False, True):
        for swizzle in (False, True):
            _assert_quantize_matches(torch.randn(0, 32, device=kernel_device), None, per_row, swizzle)
    wide = torch.randn(40, 192, device=kernel_device)
    _assert_quantize_matches(wide[:, 32:160])          # row stride 192, last dim contiguous
    _assert_quantize_matches(wide.t().contiguous().t()[:, :64])  # last dim strided: copied
    # contiguous but starting off a pair (one bf16 into its storage): copied too (.contiguous()
    # would have handed the kernels the same misaligned start)
    off_pair = torch.randn(65, device=kernel_device).to(torch.bfloat16)[1:].view(1, 64)
    assert off_pair.is_contiguous() and off_pair.data_ptr() % 4
    assert quantize_kernels._pair_aligned(off_pair).data_ptr() % 4 == 0
    _assert_quantize_matches(off_pair)
    _assert_quantize_matches(wide[::3, :96], swizzle=True)


@pytest.mark.parametrize("shape", [(1, 16), (157, 48), (3, 5, 64), (7, 4096), (300, 256)])
def test_quantize_values_kernel_matches_reference(kernel_device, shape):
    # quantize_values: the quantize kernel storing e2m1 * block scale (bf16, exact) instead of codes
    gen = torch.Generator().manual_seed(hash(shape) % 2**31)
    x = sample("heavy_tailed", shape, gen) * 3
    nan_block = x.numel() > 16
    if nan_block:
        x.view(-1)[5] = math.nan              # a NaN block decodes to NaN
        x.view(-1)[-16:] = 1e-30              # its scale underflows to 0: zeros
    x = x.to(DTYPES[len(shape) % 3])
    values, scale, g = quantize_kernels.quantize(x.to(kernel_device), None, False, False, values=True)
    data, want_scale, want_g = _reference_quantize(x, None, False, False)
    want = OPS.dequantize(data, want_scale, torch.tensor(1.0), False, torch.float32)
    assert scale is None and values.dtype == torch.bfloat16 and values.shape == x.shape
    finite = want.isfinite()
    assert torch.equal(want[finite].to(torch.bfloat16).float(), want[finite])  # exact in bf16
    torch.testing.assert_close(values.cpu().float(), want, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(g.cpu(), want_g)
    torch.testing.assert_close(OPS.quantize_values(x.to(kernel_device))[0].cpu().float(), want,
                               rtol=0, atol=0, equal_nan=True)
    if nan_block:
        assert values.isnan().sum() == 16 and (values.view(-1)[-16:] == 0).all()


# (weight dtype or None, weight_after_cast): no weight, fp32 weight before the cast (the example's
# RMSNorm, nn.RMSNorm), bf16 weight after it (Hugging Face Llama)
NORM_FORMS = [(None, False), (torch.float32, False), (torch.bfloat16, True), (torch.bfloat16, False)]


@pytest.mark.parametrize("shape", [(1, 16), (1, 4096), (3, 48), (2, 3, 64), (4, 4096)])
@pytest.mark.parametrize("form", range(len(NORM_FORMS)))
def test_rms_norm_quantize_values_kernel_matches_reference(kernel_device, shape, form):
    """One launch: RMSNorm of h (any weight form) quantized to values. h holds multiples of 1/8 of
    magnitude at most 4, so sum(h^2) is exact in fp32 in any order and the kernel's norm rounds
    like the reference's: values and g bit for bit; then random normal h (mean's order may differ
    in the last bit: values may differ in a few elements, g to an ulp)."""
    w_dtype, after_cast = NORM_FORMS[form]
    gen = torch.Generator().manual_seed(hash((shape, form)) % 2**31)
    dtype = torch.float16 if form == 3 else torch.bfloat16
    k = shape[-1]
    # (an fp32 weight one element into its storage: the kernel reads it as aligned pairs)
    weight = None if w_dtype is None else (torch.rand(k + 1, generator=gen) * 2 - 0.5).to(w_dtype)[1:]
    exact = torch.randint(-32, 33, shape, generator=gen) / 8.0
    for h, tol in ((exact, 0), (torch.randn(shape, generator=gen) * 3, 1)):
        h = h.to(dtype)
        if h.numel() > 16:
            h.view(-1)[3] = 0  # rows of zeros stay 0; a zero element anywhere is fine
        values, g = quantize_kernels.rms_norm_quantize_values(
            h.to(kernel_device), None if weight is None else weight.to(kernel_device), 1e-5, after_cast)
        y = nv.reference.rms_norm(h, weight, 1e-5, after_cast)
        want, want_g = nv.reference.quantize_values(y)
        assert values.shape == h.shape and values.dtype == torch.bfloat16 and g.shape == ()
        if tol == 0:
            assert torch.equal(values.cpu(), want) and torch.equal(g.cpu(), want_g)
        else:
            torch.testing.assert_close(g.cpu(), want_g, rtol=2**-22, atol=0)
            differ = int((values.cpu() != want).sum())
            assert differ <= max(2, h.numel() // 1000), differ
    # (a NaN in h makes its row NaN; the other rows are quantized as usual, as the reference does)
    h = torch.randn(shape, generator=gen).to(dtype)
    h.view(-1)[0] = math.nan
    values, g = quantize_kernels.rms_norm_quantize_values(
        h.to(kernel_device), None if weight is None else weight.to(kernel_device), 1e-5, after_cast)
    want, want_g = nv.reference.quantize_values(nv.reference.rms_norm(h, weight, 1e-5, after_cast))
    torch.testing.assert_close(values.cpu(), want, rtol=0, atol=0, equal_nan=True)
    assert values.reshape(-1, k)[0].isnan().all() and torch.equal(g.cpu(), want_g)
    if h.numel() > k:
        assert values.reshape(-1, k)[1:].isfinite().all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_norm_quantize_values_overflow(kernel_device, dtype):
    """A weight so large that some normalized elements round to Inf in h's dtype, one of them
    just below the threshold: those blocks come out NaN, the global scale is taken from the
    largest finite element, as the reference does."""
    gen = torch.Generator().manual_seed(12)
    h = (torch.randint(2, (1, 256), generator=gen) * 2.0 - 1).to(dtype)  # |h| = 1: h * r ~ +-1
    weight = torch.rand(256, generator=gen)
    weight[::37] = 3.4e38 if dtype == torch.bfloat16 else 7e4  # rounds to Inf
    weight[5] = 3.39e38 if dtype == torch.bfloat16 else 65500.0  # the largest finite
    values, g = quantize_kernels.rms_norm_quantize_values(h.to(kernel_device), weight.to(kernel_device),
                                                          1e-5, False)
    want, want_g = nv.reference.quantize_values(nv.reference.rms_norm(h, weight, 1e-5, False))
    assert not nv.reference.rms_norm(h, weight, 1e-5, False).isfinite().all()
    torch.testing.assert_close(values.cpu(), want, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(g.cpu(), want_g)


def test_rms_norm_quantize_values_large_h_takes_two_steps(kernel_device):
    """Above the fused-amax size the op is the norm in torch ops + quantize_values' kernels."""
    gen = torch.Generator().manual_seed(11)
    h = torch.randn(9, 4096, generator=gen).to(torch.bfloat16)
    weight = torch.rand(4096, generator=gen)
    values, g = quantize_kernels.rms_norm_quantize_values(h.to(kernel_device), weight.to(kernel_device),
                                                          1e-6, False)
    want, want_g = nv.reference.quantize_values(nv.reference.rms_norm(h, weight, 1e-6, False))
    differ = int((values.cpu() != want).sum())
    assert differ <= h.numel() // 1000, differ
    torch.testing.assert_close(g.cpu(), want_g, rtol=2**-22, atol=0)


# --- GPU only --------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_cuda_ops_dispatch_to_the_kernels():
    for op in ("quantize", "quantize_values", "dequantize", "dequantize_rows"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"nvfp4::{op}", "CUDA"), op


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 14336), (2, 3, 4096), (16384, 1024)])
def test_quantize_large_shapes_on_gpu(shape):
    gen = torch.Generator().manual_seed(1)
    x = sample("heavy_tailed", shape, gen).to(torch.bfloat16).cuda()
    for swizzle in (False, True):
        got = nv.quantize(x, swizzle=swizzle)
        want = _reference_quantize(x, None, False, swizzle)
        assert torch.equal(got.data.cpu(), want[0])
        assert torch.equal(got.scale.view(torch.uint8).cpu(), want[1])
        assert torch.equal(got.global_scale.cpu(), want[2])
        torch.testing.assert_close(got.dequantize(torch.float32).cpu(),
                                   OPS.dequantize(*want, swizzle, torch.float32), rtol=0, atol=0)


def _quantize_outputs(x, g=None):
    q = nv.quantize(x, g)
    return q.data, q.scale, q.global_scale


@pytest.mark.gpu
@pytest.mark.parametrize("shape,mode", [((1, 4096), "dynamic"), ((1, 4096), "values"),
                                        ((512, 4096), "static"), ((512, 4096), "dynamic")])
def test_quantize_waits_for_a_pdl_producer(shape, mode):
    """The quantize kernel is launched with programmatic dependent launch: it may start while the
    kernel before it runs, so it must wait before reading x. The producer here releases it at once
    and writes x only after ~0.5 ms; a kernel that read x early would see its old zeros. (At
    512 x 4096 a dynamic scale runs the partial-amax kernel first, on PDL too.)"""
    assert capability.sm90_or_later(torch.device("cuda"))
    src = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    x = torch.zeros_like(src)
    g = torch.tensor(0.01, device="cuda")
    quantize = {"dynamic": _quantize_outputs, "values": OPS.quantize_values,
                "static": lambda x: _quantize_outputs(x, g)}[mode]
    quantize(x)  # compiled outside the timed sequence
    torch.cuda.synchronize()
    late_copy(src, x)
    got = quantize(x)
    want = quantize(src)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("static", [False, True])
def test_quantize_in_cuda_graph_without_host_sync(static):
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    big = torch.randn(512, 4096, device="cuda", dtype=torch.bfloat16)  # two-pass amax
    g = torch.tensor(0.01, device="cuda") if static else None

    def step():
        q = nv.quantize(x, g, swizzle=True)
        qb = nv.quantize(big, g)
        return q.data, q.scale, q.global_scale, qb.data, qb.scale, nv.dequantize(q)

    step()  # compile the kernels outside the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager = [t.clone() for t in step()]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for fresh in range(3):  # new inputs each replay: the graph recomputes the dynamic scale
        x.copy_(torch.randn_like(x) * (fresh + 1))
        big.copy_(torch.randn_like(big))
        graph.replay()
        want = step()
        for a, b in zip(outs, want):
            assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                               b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
    assert eager[0].shape == outs[0].shape
