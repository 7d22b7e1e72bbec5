"""The Inductor side of the package: `backend="nvfp4"` (backend.py) rewrites BF16 linears to
NVFP4 ops (rewrite.py, norm_fusion.py) and lowers them to a Triton template with a fused epilogue
(lowering.py, templates/). Version-specific Inductor and Dynamo APIs live in _compat.py alone.

Importing this sub-package imports nothing of Inductor's lowering machinery: backend.py does that
when it compiles."""
