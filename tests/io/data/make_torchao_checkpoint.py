"""Regenerate tests/data/torchao/: NVFP4 checkpoints written by torchao itself, and what torchao
held in memory for them (the reference tests/test_checkpoint_torchao.py compares the loader to).

Needs torchao, which the package's tests do not install: a separate venv with torch 2.13.0 (CPU),
torchao 0.18.0, safetensors 0.8 and numpy (torchao's mx_formats imports it):

    python3 -m venv /tmp/venv-torchao
    /tmp/venv-torchao/bin/pip install torch==2.13.0 torchao==0.18.0 safetensors numpy
    /tmp/venv-torchao/bin/python tests/data/make_torchao_checkpoint.py

Each checkpoint is the model below quantized with torchao's quantize_, flattened with torchao's
flatten_tensor_state_dict and written with safetensors.torch.save_file(tensors, path, metadata),
as torchao documents saving without transformers. The shapes are chosen so that the swizzled
scales are padded: up is 80 x 48 (N < 128, K/16 = 3 columns padded to 4), down is 32 x 80
(K/16 = 5 padded to 8).

    w4a16.safetensors                    NVFP4WeightOnlyConfig()
    w4a16_no_per_tensor_scale.safetensors NVFP4WeightOnlyConfig(use_dynamic_per_tensor_scale=False)
    w4a4_static.safetensors              NVFP4DynamicActivationNVFP4WeightConfig, step "prepare",
                                         calibration on CALIBRATION, step "convert"
    w4a4_dynamic.safetensors             NVFP4DynamicActivationNVFP4WeightConfig()
    w4a4_single_level.safetensors        NVFP4DynamicActivationNVFP4WeightConfig(use_dynamic_per_tensor_scale=False)
    mxfp4.safetensors                    MXDynamicActivationMXWeightConfig with fp4 weights and
                                         activations, of a one-layer 32 x 64 model (MX blocks are 32)
    expected.safetensors                 per NVFP4 checkpoint and layer: "<file>.<layer>.codes"
                                         (torchao's qdata), ".scale" (its scale unswizzled with
                                         torchao's from_blocked), ".per_tensor_scale",
                                         ".act_per_tensor_scale" where held, and, for w4a16,
                                         ".dequantized" (torchao's dequantize, fp32); "x" with
                                         "w4a16.output" (torchao's weight-only model on x, bf16)

A rerun writes the same tensors and metadata (safetensors may order the JSON header differently).

The dynamic-activation configs assert an sm_100 GPU in quantize_ because their forward runs
torch._scaled_mm there; quantizing the weights does not need it (torchao builds them with its
pure-torch nvfp4_quantize), so the check is bypassed on the CPU for them and nothing else.
"""

from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from torchao.prototype.mx_formats import (
    MXDynamicActivationMXWeightConfig,
    NVFP4DynamicActivationNVFP4WeightConfig,
    NVFP4WeightOnlyConfig,
)
from torchao.prototype.mx_formats import inference_workflow
from torchao.prototype.mx_formats.utils import from_blocked
from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict
from torchao.quantization import quantize_

OUT = Path(__file__).parent / "torchao"
SEED = 0


class Tiny(nn.Module):
    """The model of tests/test_checkpoint_torchao.py: norm -> up (80 x 48, bias) -> relu -> down (32 x 80)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(48)
        self.up = nn.Linear(48, 80)
        self.down = nn.Linear(80, 32, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(self.norm(x))))


def model():
    torch.manual_seed(SEED)
    return Tiny().to(torch.bfloat16).eval()


def calibration():
    return torch.randn(8, 48, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)


def quantized(name):
    m = model()
    if name == "w4a16":
        quantize_(m, NVFP4WeightOnlyConfig())
    elif name == "w4a16_no_per_tensor_scale":
        quantize_(m, NVFP4WeightOnlyConfig(use_dynamic_per_tensor_scale=False))
    elif name == "w4a4_static":
        quantize_(m, NVFP4DynamicActivationNVFP4WeightConfig(step="prepare"))
        with torch.no_grad():
            m(calibration())
        quantize_(m, NVFP4DynamicActivationNVFP4WeightConfig(step="convert"))
    else:
        dynamic = name == "w4a4_dynamic"
        inference_workflow.is_sm_at_least_100 = lambda: True  # see the docstring
        quantize_(m, NVFP4DynamicActivationNVFP4WeightConfig(use_dynamic_per_tensor_scale=dynamic))
    return m


def save(m, path):
    tensors, metadata = flatten_tensor_state_dict(m.state_dict())
    save_file(tensors, str(path), metadata=metadata)


def main():
    OUT.mkdir(exist_ok=True)
    expected = {}
    x = torch.randn(3, 48, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    expected["x"] = x
    for name in ("w4a16", "w4a16_no_per_tensor_scale", "w4a4_static", "w4a4_dynamic", "w4a4_single_level"):
        m = quantized(name)
        save(m, OUT / f"{name}.safetensors")
        for layer in ("up", "down"):
            w = getattr(m, layer).weight
            n, k = w.shape
            scale = from_blocked(w.scale, n, k // 16) if w.is_swizzled_scales else w.scale
            expected[f"{name}.{layer}.codes"] = w.qdata
            expected[f"{name}.{layer}.scale"] = scale.contiguous()
            for attr in ("per_tensor_scale", "act_per_tensor_scale"):
                if getattr(w, attr) is not None:
                    expected[f"{name}.{layer}.{attr}"] = getattr(w, attr)
            if name == "w4a16":
                expected[f"{name}.{layer}.dequantized"] = w.dequantize(torch.float32)
        if name == "w4a16":
            with torch.no_grad():
                expected["w4a16.output"] = m(x)
    torch.manual_seed(SEED)
    mx = nn.Sequential(nn.Linear(64, 32)).to(torch.bfloat16)
    quantize_(mx, MXDynamicActivationMXWeightConfig(activation_dtype=torch.float4_e2m1fn_x2,
                                                    weight_dtype=torch.float4_e2m1fn_x2))
    save(mx, OUT / "mxfp4.safetensors")
    save_file({k: v.detach().contiguous() for k, v in expected.items()}, str(OUT / "expected.safetensors"),
              metadata={"torch": torch.__version__, "torchao": __import__("torchao").__version__})


if __name__ == "__main__":
    main()
