"""Inductor lowerings for the nvfp4:: ops: nvfp4::linear_tiled -> the NVFP4 GEMM template
(linear.py). Installed by backend="nvfp4" when it compiles, never at import."""

from .linear import register

__all__ = ["register"]
