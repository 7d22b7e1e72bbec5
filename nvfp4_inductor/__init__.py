"""nvfp4_inductor: NVFP4 (FP4 E2M1 + per-16 E4M3 scales + FP32 global scale) for PyTorch.

Importing the package defines the `nvfp4::` ops (torch.library) and the public API below; the
`backend="nvfp4"` Dynamo backend is found through its entry point (never registered here).
"""

from nvfp4_inductor import ops  # noqa: F401  (defines the nvfp4:: ops)
from nvfp4_inductor.config import Config
from nvfp4_inductor.modules.convert import ConversionReport, convert
from nvfp4_inductor.modules.linear import NVFP4Linear
from nvfp4_inductor.modules.experts import NVFP4Experts, convert_experts
from nvfp4_inductor.api import (
    NVFP4,
    dequantize,
    dequantize_rows,
    linear,
    quantize,
    swizzle_scales,
    unswizzle_scales,
)

from nvfp4_inductor.lowerings.backend import compile  # noqa: A004  (nvfp4_inductor.compile, like torch.compile)
from nvfp4_inductor.calibrate import collect_hessians, collect_input_scales
from nvfp4_inductor.io.checkpoint import init_empty_weights, load_checkpoint, save_checkpoint
from nvfp4_inductor.io.hf_quantizer import register_transformers_quantizer

__all__ = [
    "NVFP4", "quantize", "dequantize", "dequantize_rows", "swizzle_scales", "unswizzle_scales",
    "linear", "Config", "convert", "NVFP4Linear", "NVFP4Experts", "convert_experts", "ConversionReport",
    "compile", "collect_hessians",
    "collect_input_scales", "load_checkpoint", "save_checkpoint", "init_empty_weights", "register_transformers_quantizer",
    "NVFP4Cache",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    """NVFP4Cache is a transformers Cache: imported (with transformers) on first use."""
    if name == "NVFP4Cache":
        from nvfp4_inductor.io.kv_cache import NVFP4Cache

        return NVFP4Cache
    raise AttributeError(f"module 'nvfp4_inductor' has no attribute {name!r}")
