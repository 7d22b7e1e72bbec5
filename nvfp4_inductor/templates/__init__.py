"""Triton templates for Inductor's NVFP4 GEMM choices (the `backend="nvfp4"` work; not implemented yet)."""
