"""Triton kernels: the CUDA implementations of the nvfp4:: ops.

Imported lazily (only when a CUDA op runs, or by the interpreter tests), so the package imports
on machines without Triton.
"""
