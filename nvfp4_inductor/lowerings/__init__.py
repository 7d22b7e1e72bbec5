"""The Inductor side of the package: `backend="nvfp4"` (backend.py) rewrites BF16 linears to
NVFP4 ops (passes/: linear.py, experts.py, norms.py, on the FX matchers of fx.py) and lowers them
to a Triton template with a fused epilogue (linear.py, nvfp4_inductor/templates/).
Version-specific Inductor and Dynamo APIs live in compat.py alone.

Importing this sub-package imports nothing of Inductor's lowering machinery: backend.py does that
when it compiles."""
