"""Independent brute-force oracles for the NVFP4 rounding rules (the README's numerics contract),
used by the tests.

They search every candidate value instead of using the reference's thresholds, so they check the
reference rather than restate it.
"""

import torch

E2M1_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def _nearest_even(dist: torch.Tensor) -> torch.Tensor:
    """dist (..., C) to C ascending candidates -> index of the nearest, ties to the even index."""
    best = dist.min(dim=-1, keepdim=True).values
    candidates = dist == best
    even = torch.arange(dist.shape[-1]) % 2 == 0
    even_candidates = candidates & even
    pick_even = even_candidates.any(dim=-1)
    return torch.where(
        pick_even, even_candidates.float().argmax(dim=-1), candidates.float().argmax(dim=-1)
    )


def e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """fp32 scaled values -> uint8 codes by nearest search over all 8 magnitudes (ties to even)."""
    dist = (y.double().abs().unsqueeze(-1) - E2M1_MAGNITUDES).abs()
    index = _nearest_even(dist).to(torch.uint8)
    return (torch.signbit(y).to(torch.uint8) << 3) | index


def e4m3_bits(t: torch.Tensor) -> torch.Tensor:
    """Non-negative fp32 (NaN allowed) -> uint8 e4m3 bits: nearest of the 127 finite non-negative
    e4m3 values, ties to the even bit pattern (= even mantissa), saturating at 448; NaN -> 0x7F."""
    finite_bits = torch.arange(0, 0x7F, dtype=torch.uint8)
    values = finite_bits.view(torch.float8_e4m3fn).double()
    dist = (t.double().unsqueeze(-1) - values).abs()
    bits = _nearest_even(torch.nan_to_num(dist, nan=0.0)).to(torch.uint8)
    bits = torch.where(torch.isinf(t), torch.full_like(bits, 0x7E), bits)  # +inf saturates too
    return torch.where(torch.isnan(t), torch.full_like(bits, 0x7F), bits)
