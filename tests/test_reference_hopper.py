"""reference/hopper.py, the Hopper GEMM's weight layout: pack and unpack are inverse on what the
quantizer writes, and the kernel's bit-trick decode of the packed words, done in torch, gives the
reference's dequantized values exactly, for every code and every scale byte."""

import pytest
import torch

from nvfp4_inductor import reference
from nvfp4_inductor.reference import hopper


@pytest.mark.parametrize("n, k", [(64, 64), (70, 112), (130, 256), (17, 48)])
def test_pack_unpack_round_trip_and_decode(n, k):
    gen = torch.Generator().manual_seed(n * 7 + k)
    w = torch.randn(n, k, generator=gen) * torch.logspace(-3, 3, n)[:, None]
    w[0, :16] = 0  # a zero block: zero scale, zero codes
    data, scale, _ = reference.quantize(w)
    codes, scales = hopper.pack(data, scale)
    n_pad, k_pad = hopper.padded_shape(n, k)
    assert codes.shape == (k_pad // 64, 2 * n_pad, 4) and codes.dtype == torch.int32
    assert scales.shape == (k_pad // 64, 2 * n_pad) and scales.dtype == torch.int16
    data_back, scale_back = hopper.unpack(codes, scales, n, k)
    assert torch.equal(data_back, data)
    assert torch.equal(scale_back, scale.view(torch.uint8))
    values = hopper.decode(codes, scales) * 2.0**hopper.UNSCALE_LOG2
    want = reference.dequantize(data, scale, torch.ones(()), torch.float32)
    assert torch.equal(values[:n, :k], want)
    assert not values[n:].any() and not values[:, k:].any()


def test_every_code_and_scale_byte_decodes_to_the_reference():
    """All 256 scale bytes (subnormal, 448, both NaNs, negative, -0) under all 256 code bytes: the
    decode is the reference's value, NaN where it is NaN."""
    gen = torch.Generator().manual_seed(3)
    n, k = 256, 256
    data = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    data[:, :8] = torch.arange(256, dtype=torch.uint8).view(256, 1)  # every code byte in block 0
    scale_bits = torch.arange(n * k // 16).remainder(256).to(torch.uint8).view(n, k // 16)
    scale = scale_bits.view(torch.float8_e4m3fn)
    codes, scales = hopper.pack(data, scale)
    got = hopper.decode(codes, scales) * 2.0**hopper.UNSCALE_LOG2
    want = reference.dequantize(data, scale, torch.ones(()), torch.float32)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


def test_the_layout_is_a_bijection_on_its_words():
    """Every bit of a code word is one code's bit: random words survive unpack then pack (scales
    positive and non-zero, so pack changes no code)."""
    gen = torch.Generator().manual_seed(5)
    codes = torch.randint(-2**31, 2**31, (2, 128, 4), dtype=torch.int32, generator=gen)
    s = torch.randint(1, 0x7F, (64, 8), dtype=torch.uint8, generator=gen)
    _, scales = hopper.pack(torch.zeros(64, 64, dtype=torch.uint8), s.view(torch.float8_e4m3fn))
    data, scale_bits = hopper.unpack(codes, scales, 64, 128)
    codes_back, scales_back = hopper.pack(data, scale_bits)
    assert torch.equal(codes_back, codes)
    assert torch.equal(scales_back, scales)
