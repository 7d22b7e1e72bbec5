"""Seeded random test inputs of several distributions (never zeros alone)."""

import math

import torch

from nvfp4_inductor.format import BLOCK_SIZE

DISTS = ["normal", "uniform", "heavy_tailed", "log_uniform", "grid"]


def grid_blocks(shape, generator):
    """Blocks of exact ties and grid values times 2^e, each with +-6 * 2^e: scale 2^e, y exact."""
    rows = math.prod(shape[:-1])
    nblocks = shape[-1] // BLOCK_SIZE
    pool = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 3.0, 4.0, 6.0, 7.0, 0.1])
    pick = torch.randint(len(pool), (rows, nblocks, BLOCK_SIZE), generator=generator)
    sign = torch.randint(2, (rows, nblocks, BLOCK_SIZE), generator=generator) * 2.0 - 1
    x = pool[pick] * sign
    x[..., 0] = 6.0
    exp = torch.randint(-4, 5, (rows, nblocks, 1), generator=generator).float()
    return (x * torch.exp2(exp)).reshape(shape)


def sample(dist, shape, generator):
    if dist == "normal":
        return torch.randn(shape, generator=generator)
    if dist == "uniform":
        return torch.rand(shape, generator=generator) * 20 - 10
    if dist == "heavy_tailed":  # Student-t with 2 degrees of freedom
        z = torch.randn(shape, generator=generator)
        chi2 = torch.randn((*shape, 2), generator=generator).pow(2).sum(-1)
        return z / torch.sqrt(chi2 / 2)
    if dist == "log_uniform":  # magnitudes over 2^-20 .. 2^10, random signs
        mag = torch.exp2(torch.rand(shape, generator=generator) * 30 - 20)
        return mag * (torch.randint(2, shape, generator=generator) * 2 - 1)
    if dist == "grid":
        return grid_blocks(shape, generator)
    raise ValueError(dist)


def scalable_values(shape, generator):
    """Values with 8 significant bits in [2^-8, 8], random signs, about a seventh each +0 and -0:
    x * 2^e is exact in fp32 for every e >= -134 (the lowest bit stays at or above 2^-149)."""
    n = math.prod(shape)
    x = (torch.rand(n, generator=generator) * 11 - 8).exp2().to(torch.bfloat16).float()
    x = x * (torch.randint(2, (n,), generator=generator) * 2 - 1)
    x[::7] = 0.0
    x[3::7] = -0.0
    return x.reshape(shape)


def times_power_of_two(x, e):
    """x * 2^e in fp32 (in two steps: 2^e itself need not be an fp32)."""
    return x.float() * 2.0 ** (e // 2) * 2.0 ** (e - e // 2)
