"""What a device can run: the capability checks every other module asks, in one place."""

import functools

import torch


@functools.cache
def sm90_or_later(device: torch.device) -> bool:
    """CUDA sm_90 and up: the kernels' inline PTX (bf16x2 arithmetic, max.s16x2) and programmatic
    dependent launch. Cached: the eager launchers ask on every call."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


@functools.cache
def wgmma(device: torch.device) -> bool:
    """Hopper (sm_90): warpgroup MMA, which sm_100 and sm_120 do not have (Triton lowers tl.dot
    there to other instructions, for which nothing here is tuned)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


@functools.cache
def gluon_hopper() -> bool:
    """Whether the installed Triton's Gluon is the API kernels/hopper_gemm.py is written and tested
    against (Triton 3.6's; its names and signatures changed after it). Elsewhere the planner keeps
    the Triton kernels and cuBLAS paths."""
    try:
        import triton
    except ImportError:
        return False
    return triton.__version__.split(".")[:2] == ["3", "6"]


@functools.cache
def block_scaled_mma(device: torch.device) -> bool:
    """Whether a device multiplies NVFP4 natively (sm_100 and up: tcgen05 block-scaled MMA)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 10


def template_device(device: torch.device) -> bool:
    """Where the NVFP4 GEMM's Inductor template runs: CUDA, or the CPU when Inductor emits Triton
    for it (its CPU backend set to "triton", the kernels then run by Triton's interpreter)."""
    from torch._inductor import config as inductor_config

    return device.type == "cuda" or (device.type == "cpu" and inductor_config.cpu_backend == "triton")


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 8 elsewhere (the Triton interpreter or CPU
    backend: a small grid)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8
