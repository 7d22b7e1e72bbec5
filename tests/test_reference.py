"""The reference quantizer (the spec in code) against hand-worked cases and brute-force oracles."""

import math

import pytest
import torch

import nvfp4_inductor as nv
from helpers import brute_force
from helpers.inputs import DISTS, scalable_values, times_power_of_two
from helpers.inputs import sample as _sample
from nvfp4_inductor import reference
from nvfp4_inductor.format import BLOCK_SIZE, GLOBAL_SCALE_DIVISOR

E4M3 = torch.float8_e4m3fn


def codes_of(q: nv.NVFP4) -> torch.Tensor:
    return reference.unpack_nibbles(q.data)


def scale_bits(q: nv.NVFP4) -> torch.Tensor:
    return q.scale.view(torch.uint8)


# --- hand-worked cases (global scale 1, so block scale = block_amax / 6 and y = x / s) --------

def test_every_tie_and_its_neighbours():
    # Block amax 6 -> scale exactly 1 -> y == x.
    x = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0,
                      -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, 2.6])
    # magnitude indices: 6->7, 0.25->0, 0.75->2 (1.0), 1.25->2, 1.75->4 (2.0), 2.5->4, 3.5->6 (4.0),
    # 5->6; negatives carry the sign bit (-0.25 rounds to -0, code 8); 2.6 -> 5 (3.0), not 2.5's 4.
    expected = [7, 0, 2, 2, 4, 4, 6, 6, 8, 10, 10, 12, 12, 14, 14, 5]
    q = nv.quantize(x, 1.0)
    assert scale_bits(q).tolist() == [0x38]  # e4m3 1.0
    assert codes_of(q).tolist() == expected
    # One fp32 ulp either side of each tie decides by distance alone.
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    up = torch.nextafter(ties, torch.tensor(math.inf))
    down = torch.nextafter(ties, torch.tensor(0.0))
    q_up = nv.quantize(torch.cat([torch.tensor([6.0]), up, up[:-1], torch.zeros(2)]), 1.0)
    q_dn = nv.quantize(torch.cat([torch.tensor([6.0]), down, down[:-1], torch.zeros(2)]), 1.0)
    assert codes_of(q_up)[1:8].tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert codes_of(q_dn)[1:8].tolist() == [0, 1, 2, 3, 4, 5, 6]


def test_element_saturates_at_six_times_scale():
    # Static g = 1: a block amax of 6 * 448 * 4 saturates the scale at 448; |y| up to 24 -> +-6.
    x = torch.zeros(16)
    x[0], x[1], x[2], x[3] = 6 * 448 * 4, -6 * 448 * 2, 6 * 448 * 1.1, 6 * 448
    q = nv.quantize(x, 1.0)
    assert q.scale.float().item() == 448.0
    assert codes_of(q)[:4].tolist() == [7, 15, 7, 7]
    assert q.dequantize(torch.float32)[:4].tolist() == [2688.0, -2688.0, 2688.0, 2688.0]


def test_all_zero_tensor():
    q = nv.quantize(torch.zeros(4, 32, dtype=torch.bfloat16))
    assert q.global_scale.item() == 1.0
    assert scale_bits(q).eq(0).all() and q.data.eq(0).all()
    assert q.dequantize().eq(0).all()


def test_block_scale_underflows_to_zero():
    # amax 2688 -> g = 1; the second block's scale 1e-3 / 6 is below half the smallest e4m3
    # subnormal (2^-10), rounds to 0, and the block becomes all +0 codes.
    x = torch.cat([torch.full((16,), 2688.0), torch.full((16,), -1e-3)])
    q = nv.quantize(x)
    assert q.global_scale.item() == 1.0
    assert scale_bits(q).tolist() == [0x7E, 0x00]
    assert codes_of(q)[16:].eq(0).all()


def test_subnormal_e4m3_scales():
    # Static g = 1: block amax 6 * k * 2^-9 gives the subnormal scale k * 2^-9 (bits k), exactly.
    blocks = []
    for k in (1, 2, 3, 5, 7):
        block = torch.linspace(-1, 1, 16) * 6 * k * 2.0**-9
        blocks.append(block)
    x = torch.cat(blocks)
    q = nv.quantize(x, 1.0)
    assert scale_bits(q).tolist() == [1, 2, 3, 5, 7]
    y = x.reshape(-1, 16) * (1 / q.scale.float()).unsqueeze(-1)
    assert torch.equal(codes_of(q), brute_force.e2m1_codes(y).flatten())


@pytest.mark.parametrize("e", [-90, -91, -117, -126, -134])
def test_tiny_global_scale_quantizes_as_if_scaled_up(e):
    """x * 2^e with g * 2^e gives x's scales and codes: every product with 2^e is exact, and below
    g = 2^-100 (e <= -91 here) y is computed on x and g times 2^64, so s * g and r = 1 / (s g) stay
    in fp32's normal range. Before that rule, r overflowed for a block amax below ~1.8e-38: zeros
    became 0 * inf (NaN) and every nonzero code +-6."""
    gen = torch.Generator().manual_seed(-e)
    x = scalable_values((40, 16), gen)
    g = torch.tensor(2.0**-10)
    scaled = times_power_of_two(x, e)
    assert torch.equal(times_power_of_two(scaled, -e), x)  # exact
    want = nv.quantize(x, g)
    got = nv.quantize(scaled, g * 2.0**e)
    assert torch.equal(got.scale.view(torch.uint8), want.scale.view(torch.uint8))
    assert torch.equal(got.data, want.data)
    assert scale_bits(want).gt(0).all() and codes_of(want).ne(0).any()
    zeros = codes_of(got).reshape(x.shape)[x == 0]
    assert torch.equal(zeros, torch.signbit(x[x == 0]).to(torch.uint8) * 8)  # +-0, not +-6


def test_single_huge_outlier_does_not_flatten_other_blocks():
    torch.manual_seed(0)
    x = torch.randn(8, 64)
    x[3, 17] = 1e4
    q = nv.quantize(x)
    assert q.global_scale.item() == pytest.approx(1e4 / GLOBAL_SCALE_DIVISOR, rel=1e-7)
    dq = q.dequantize(torch.float32)
    assert dq[3, 17].item() == pytest.approx(1e4, rel=2**-4)
    others = torch.ones_like(x, dtype=torch.bool)
    others[3, 16:32] = False
    rel = (dq - x)[others].norm() / x[others].norm()
    assert rel < 0.15  # ~0.09 for Gaussian blocks; a shared per-tensor FP4 scale would give ~1


def test_negative_zero_keeps_its_sign():
    x = torch.tensor([-0.0, 0.0, -1e-9, 6.0] + [1.0] * 12)
    q = nv.quantize(x, 1.0)
    assert codes_of(q)[:4].tolist() == [8, 0, 8, 7]
    dq = q.dequantize(torch.float32)
    assert torch.signbit(dq[0]) and not torch.signbit(dq[1])


def test_nibble_order():
    # Element 2i in the low nibble, 2i+1 in the high one.
    x = torch.tensor([6.0, -6.0, 1.0, 0.0] + [0.0] * 12)
    assert nv.quantize(x, 1.0).data[:2].tolist() == [0x7 | 0xF << 4, 0x2 | 0x0 << 4]


# --- non-finite policy ---------------------------------------------------------------------------

def test_nan_and_inf_poison_only_their_block():
    torch.manual_seed(1)
    x = torch.randn(4, 64)
    x[1, 5] = math.nan
    x[2, 40] = -math.inf
    x[0, 0] = 50.0  # the amax, finite, skips the non-finite values
    q = nv.quantize(x)
    assert q.global_scale.item() == pytest.approx(50.0 / GLOBAL_SCALE_DIVISOR, rel=1e-7)
    bits = scale_bits(q)
    bad = torch.zeros(4, 4, dtype=torch.bool)
    bad[1, 0] = bad[2, 2] = True
    assert bits[bad].eq(0x7F).all() and bits[~bad].ne(0x7F).all()
    dq = q.dequantize(torch.float32).reshape(4, 4, 16)
    assert dq[bad].isnan().all() and not dq[~bad].isnan().any()
    # Every other block is what quantizing with the same global scale gives without the bad values.
    clean = nv.quantize(torch.nan_to_num(x, nan=0.0, neginf=0.0), q.global_scale)
    assert torch.equal(bits[~bad], scale_bits(clean)[~bad])
    codes = codes_of(q).reshape(4, 4, 16)
    assert torch.equal(codes[~bad], codes_of(clean).reshape(4, 4, 16)[~bad])
    assert codes[bad].eq(0).all()


@pytest.mark.parametrize("bad_g", [0.0, -1.0, math.nan, math.inf])
def test_unusable_global_scale_tensor_gives_nan_blocks(bad_g):
    q = nv.quantize(torch.randn(2, 32), torch.tensor(bad_g))
    assert scale_bits(q).eq(0x7F).all() and q.data.eq(0).all()
    assert q.dequantize(torch.float32).isnan().all()


# --- property tests against brute force ----------------------------------------------------------

SHAPES = [(1, 16), (157, 48), (3, 5, 64), (2, 1024), (64,)]


def _check_against_brute_force(x, q, per_row):
    lead, k = x.shape[:-1], x.shape[-1]
    xf = x.float()
    if q.global_scale.dim() == 0 or not per_row:
        g = q.global_scale
    else:
        g = q.global_scale.unsqueeze(-1)
    # global scale
    amax = xf.abs().amax(dim=-1) if per_row else xf.abs().amax()
    expected_g = torch.where(amax == 0, torch.ones_like(amax), amax / GLOBAL_SCALE_DIVISOR)
    assert torch.equal(q.global_scale, expected_g)
    # block scales: nearest e4m3, ties to even, saturating
    blocks = xf.reshape(*lead, k // BLOCK_SIZE, BLOCK_SIZE)
    target = blocks.abs().amax(-1) / (g * 6.0)
    assert torch.equal(scale_bits(q), brute_force.e4m3_bits(target))
    # codes: nearest e2m1 of y = x * (1 / (s * g)), ties to even; zero-scale blocks all +0
    s = q.scale.float()
    y = blocks * (1 / (s * g)).unsqueeze(-1)
    expected = torch.where((s > 0).unsqueeze(-1), brute_force.e2m1_codes(y), 0)
    assert torch.equal(codes_of(q), expected.reshape(*lead, k).to(torch.uint8))


@pytest.mark.parametrize("dist", DISTS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_codes_and_scales_match_brute_force(dist, shape, dtype):
    gen = torch.Generator().manual_seed(hash((dist, shape, str(dtype))) % 2**31)
    x = _sample(dist, shape, gen).to(dtype)
    _check_against_brute_force(x, nv.quantize(x), per_row=False)
    if len(shape) > 1:
        _check_against_brute_force(x, nv.quantize(x, per_row=True), per_row=True)


@pytest.mark.parametrize("dist", DISTS)
def test_static_global_scale_matches_brute_force(dist):
    gen = torch.Generator().manual_seed(7)
    x = _sample(dist, (33, 96), gen)
    # A scale calibrated on a smaller amax: the largest blocks saturate at 448 and 6.
    g = torch.tensor(0.3 * x.abs().max().item() / GLOBAL_SCALE_DIVISOR)
    q = nv.quantize(x, g)
    assert torch.equal(q.global_scale, g)
    blocks = x.reshape(33, 6, 16)
    assert torch.equal(scale_bits(q), brute_force.e4m3_bits(blocks.abs().amax(-1) / (g * 6.0)))
    s = q.scale.float()
    y = blocks * (1 / (s * g)).unsqueeze(-1)
    expected = torch.where((s > 0).unsqueeze(-1), brute_force.e2m1_codes(y), 0).to(torch.uint8)
    assert torch.equal(codes_of(q), expected.reshape(33, 96))


def _half_gap(a):
    """Largest rounding error of |y| = a to the E2M1 grid, in units of the block scale."""
    return torch.where(a <= 2, 0.25, torch.where(a <= 4, 0.5, torch.where(a <= 6, 1.0, a - 6)))


@pytest.mark.parametrize("dist", ["normal", "uniform", "heavy_tailed"])
@pytest.mark.parametrize("per_row", [False, True])
def test_dequantize_error_within_format_bound(dist, per_row):
    gen = torch.Generator().manual_seed(11)
    x = _sample(dist, (157, 48), gen)
    q = nv.quantize(x, per_row=per_row)
    dq = q.dequantize(torch.float32)
    g = q.global_scale.unsqueeze(-1) if per_row else q.global_scale
    step = (q.scale.float() * g).repeat_interleave(BLOCK_SIZE, dim=-1)  # s * g per element
    bound = (_half_gap(x.abs() / step) + 2**-16) * step  # + fp32 rounding of the products
    assert ((dq - x).abs() <= bound).all()
    # Block view: error at most (1 + 2^-4) * block_amax / 6 (e4m3 rounds the scale by <= 2^-4).
    block_amax = x.reshape(157, 3, 16).abs().amax(-1, keepdim=True)
    err = (dq - x).reshape(157, 3, 16).abs()
    assert (err <= block_amax * (17 / 16) / 6 * 1.0001).all()


# --- swizzle --------------------------------------------------------------------------------------

@pytest.mark.parametrize("rows, cols", [(1, 1), (128, 4), (129, 5), (300, 9), (7, 256), (0, 3)])
def test_swizzle_matches_index_formula_and_round_trips(rows, cols):
    gen = torch.Generator().manual_seed(rows * 1000 + cols)
    # Random non-zero e4m3 bit patterns (1..0x7E), so padding zeros are told apart.
    plain = torch.randint(1, 0x7F, (rows, cols), generator=gen, dtype=torch.uint8)
    plain = plain.view(E4M3)
    sw = nv.swizzle_scales(plain)
    rows_pad, cols_pad = -(-rows // 128) * 128, -(-cols // 4) * 4
    assert sw.shape == (rows_pad, cols_pad) and sw.dtype == E4M3
    flat = sw.view(torch.uint8).flatten().tolist()
    bits = plain.view(torch.uint8)
    for r in range(rows_pad):
        for c in range(cols_pad):
            tile = (r // 128) * (cols_pad // 4) + c // 4
            offset = tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
            want = bits[r, c].item() if r < rows and c < cols else 0
            assert flat[offset] == want, (r, c)
    assert torch.equal(nv.unswizzle_scales(sw, rows, cols).view(torch.uint8), bits)


def test_swizzled_quantize_equals_swizzled_plain_scales():
    x = torch.randn(3, 70, 96)
    plain = nv.quantize(x)
    sw = nv.quantize(x, swizzle=True)
    assert sw.swizzled and sw.scale.shape == (256, 8)
    assert torch.equal(sw.scale.view(torch.uint8),
                       nv.swizzle_scales(plain.scale.reshape(210, 6)).view(torch.uint8))
    assert torch.equal(sw.data, plain.data)
    assert torch.equal(sw.dequantize(), plain.dequantize())
