"""kernels/dequantize.py against the reference, bit for bit: whole tensors (plain, swizzled and
tiled scales; with and without the global scale), any scale byte a checkpoint may hold, and
rows gathered by index (nvfp4::dequantize_rows).

On a machine without a GPU the kernels run under the Triton interpreter; on a GPU the same tests
run on CUDA, plus the `gpu`-marked ones.
"""

import math

import pytest
import torch

import nvfp4_inductor as nv
from helpers.inputs import sample
from nvfp4_inductor.kernels import dequantize as dequantize_kernels

OPS = torch.ops.nvfp4
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("shape", [(1, 16), (157, 48), (3, 5, 64), (130, 272)])
@pytest.mark.parametrize("swizzle", [False, True])
@pytest.mark.parametrize("per_row", [False, True])
def test_dequantize_kernel_matches_reference(kernel_device, shape, swizzle, per_row):
    gen = torch.Generator().manual_seed(hash((shape, swizzle, per_row)) % 2**31)
    x = sample("heavy_tailed", shape, gen)
    x.view(-1)[7] = math.nan  # one NaN block must come out NaN
    data, scale, g = OPS.quantize(x, None, per_row, swizzle)
    for dtype in DTYPES:
        want = OPS.dequantize(data, scale, g, swizzle, dtype)
        got = dequantize_kernels.dequantize(
            data.to(kernel_device), scale.to(kernel_device), g.to(kernel_device), swizzle, dtype)
        assert got.dtype == dtype and got.shape == want.shape
        if kernel_device == "cpu" and dtype == torch.bfloat16:
            # The Triton 3.6 interpreter truncates fp32 -> bf16 (the GPU rounds to nearest even,
            # checked exactly on the device): allow one bf16 ulp here; fp32 and fp16 stay exact.
            torch.testing.assert_close(got, want, rtol=2**-7, atol=0, equal_nan=True)
        else:
            torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0, equal_nan=True)


def _foreign_scale_bytes(scale):
    """Scale bytes this package never writes but a checkpoint's may hold, as float8_e4m3fn reads
    them: 0xFF (NaN, what torch writes for NaN on x86), 0x80 (-0), 0xB8 (-1.0), 0x81 (the
    smallest negative subnormal)."""
    scale = scale.clone()
    flat = scale.view(torch.uint8).view(-1)
    flat[0], flat[1], flat[2], flat[5] = 0xFF, 0x80, 0xB8, 0x81
    return scale


@pytest.mark.parametrize("swizzle", [False, True])
def test_dequantize_kernel_reads_any_scale_byte(kernel_device, swizzle):
    gen = torch.Generator().manual_seed(17)
    data, scale, g = OPS.quantize(torch.randn(4, 48, generator=gen), None, False, swizzle)
    scale = _foreign_scale_bytes(scale)
    want = OPS.dequantize(data, scale, g, swizzle, torch.float32)
    got = dequantize_kernels.dequantize(data.to(kernel_device), scale.to(kernel_device), g.to(kernel_device),
                                        swizzle, torch.float32)
    assert want.isnan().any() and (want < 0).any()
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("swizzle", [False, True])
def test_dequantize_rows_kernel(kernel_device, index_dtype, swizzle):
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(200, 80, generator=gen)
    data, scale, g = (t.to(kernel_device) for t in OPS.quantize(x, None, True, swizzle))
    full = dequantize_kernels.dequantize(data, scale, g, swizzle, torch.float32).cpu()
    indices = torch.randint(0, 200, (3, 7), generator=gen).to(index_dtype).to(kernel_device)
    got = dequantize_kernels.dequantize(data, scale, g, swizzle, torch.float32, indices)
    assert got.shape == (3, 7, 80)
    assert torch.equal(got.cpu(), full[indices.cpu().long()])
    # a strided view of indices (a block table's column): read by its strides, not as packed
    table = torch.randint(0, 200, (6, 3), generator=gen).to(index_dtype).to(kernel_device)
    got = dequantize_kernels.dequantize(data, scale, g, swizzle, torch.float32, table[:, 1])
    assert torch.equal(got.cpu(), full[table[:, 1].cpu().long()])
    # Unchecked out-of-range indices (what a CUDA-graph capture would see) give NaN rows.
    bad = torch.tensor([0, -1, 200, 5], dtype=index_dtype, device=kernel_device)
    rows = dequantize_kernels.dequantize(data, scale, g, swizzle, torch.float32, bad).cpu()
    assert torch.equal(rows[0], full[0]) and torch.equal(rows[3], full[5])
    assert rows[1:3].isnan().all()


def test_dequantize_rows_checks_indices_eagerly(kernel_device):
    q = nv.quantize(torch.randn(10, 32, device=kernel_device))
    with pytest.raises(IndexError, match="indices: 10 is out of range for q with 10 rows"):
        nv.dequantize_rows(q, torch.tensor([1, 10], device=kernel_device))
    with pytest.raises(IndexError, match="indices: -1 is out of range"):
        nv.dequantize_rows(q, torch.tensor([-1], device=kernel_device))
    with pytest.raises(TypeError, match="indices must have dtype int32, int64"):
        nv.dequantize_rows(q, torch.tensor([1.0], device=kernel_device))
    with pytest.raises(ValueError, match="q must be 2-D"):
        nv.dequantize_rows(nv.quantize(torch.randn(2, 3, 32)), torch.tensor([0]))


def test_dequantize_rows_op(kernel_device):
    torch.library.opcheck(
        OPS.dequantize_rows.default,
        (*OPS.quantize(torch.randn(20, 48), None, False, True), True,
         torch.tensor([[3, 1], [19, 0]]), torch.bfloat16),
    )
    q = nv.quantize(torch.randn(20, 48), per_row=True)
    idx = torch.tensor([4, 4, 0, 19])
    assert torch.equal(nv.dequantize_rows(q, idx, torch.float32), q.dequantize(torch.float32)[idx])


@pytest.mark.gpu
def test_dequantize_rows_in_cuda_graph():
    q = nv.quantize(torch.randn(1024, 128, device="cuda"), per_row=True)
    idx = torch.randint(0, 1024, (64,), device="cuda")
    nv.dequantize_rows(q, idx)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = nv.dequantize_rows(q, idx)
    idx.copy_(torch.randint(0, 1024, (64,), device="cuda"))
    graph.replay()
    assert torch.equal(out, q.dequantize()[idx])


def test_dequantize_kernel_without_global_scale(kernel_device):
    # global_scale None leaves g out: e2m1 * block scale, exact in bf16 (the dequantize + cuBLAS
    # linear applies g after the GEMM).
    gen = torch.Generator().manual_seed(12)
    data, scale, g = OPS.quantize(torch.randn(37, 96, generator=gen), None, False, True)
    want = OPS.dequantize(data, scale, torch.tensor(1.0), True, torch.float32)
    got = dequantize_kernels.dequantize(data.to(kernel_device), scale.to(kernel_device), None, True,
                                        torch.float32)
    assert torch.equal(got.cpu(), want)
    assert torch.equal(want.to(torch.bfloat16).float(), want)  # exact in bf16


@pytest.mark.parametrize("n, k", [(64, 64), (80, 208), (130, 1040)])
def test_dequantize_reads_the_tiled_layout(kernel_device, n, k):
    from nvfp4_inductor.reference import tiled

    gen = torch.Generator().manual_seed(n + k)
    x = torch.randn(n, k, generator=gen) * 5
    x[1, 16:32] = float("nan")  # a NaN block stays NaN
    x[2, :16] = 1e-30           # a zero scale: zeros
    q = nv.quantize(x)
    data_t, scale_t = tiled.tile(q.data, q.scale.view(torch.uint8))
    got = dequantize_kernels.dequantize(data_t.to(kernel_device), scale_t.to(kernel_device), None, False,
                                        torch.float32, tiled_nk=(n, k))
    want = OPS.dequantize(q.data, q.scale.view(torch.uint8), torch.tensor(1.0), False, torch.float32)
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0, equal_nan=True)
    assert got.shape == (n, k) and want[1, 16:32].isnan().all() and (want[2, :16] == 0).all()
    # bf16 without g: the tile kernel (the word decode), exact
    got = dequantize_kernels.dequantize(data_t.to(kernel_device), scale_t.to(kernel_device), None, False,
                                        torch.bfloat16, tiled_nk=(n, k))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.cpu().float(), want, rtol=0, atol=0, equal_nan=True)
