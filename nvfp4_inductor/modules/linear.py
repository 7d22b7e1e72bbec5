"""`NVFP4Linear`, the layer `convert(model, config)` puts in place of an `nn.Linear`: it keeps
only the NVFP4 weight (the bf16 copy is freed), in the tiled layout, and runs
`nvfp4::linear_tiled`.

Its state dict holds the weight under the ModelOpt checkpoint names: `weight` uint8 (N, K/2),
`weight_scale` float8_e4m3fn (N, K/16), `weight_scale_2` fp32 (the decode global scale).
"""

import sys

import torch
from torch import nn

from nvfp4_inductor import api, checks
from nvfp4_inductor.config import check_activations, resolve_activation
from nvfp4_inductor.format import BLOCK_SIZE
from nvfp4_inductor.kernels import gemm  # (no Triton import: gemm.py imports its kernels when they launch)
from nvfp4_inductor.modules.common import (
    apply_keeping_buffer_dtypes, checked_bits, checked_global_scale, checked_input_scale,
)
from nvfp4_inductor.reference.tiled import tile, tiled_shapes, untile

__all__ = ["NVFP4Linear"]


# An NVFP4Linear's buffers: codes, block scales, global scale (ModelOpt's state-dict name, which
# transformers' loading fills directly), static input scale.
NVFP4_BUFFERS = ("weight", "weight_scale", "weight_scale_2", "input_scale")


class NVFP4Linear(nn.Module):
    """y = x @ W^T + b with W held as NVFP4 (ModelOpt names: weight, weight_scale, weight_scale_2;
    input_scale, where set, the static global scale W4A4 quantizes x with: see
    collect_input_scales. None: computed from each x on the device).

    The module holds W's codes and block scales in the tiled layout (nvfp4_inductor.reference.tiled: the
    layout the decode GEMM reads fastest, and the one backend="nvfp4" compiles to), so that it
    runs the same kernels eagerly, under torch.compile with any backend and under
    backend="nvfp4". Its state dict holds the interchange layout whatever the module holds:
    `weight` uint8 (N, K/2), `weight_scale` float8_e4m3fn (N, K/16) (tiled on load, untiled on
    save). Module casts (`.half()`, `.to(torch.bfloat16)`, ...) change the bias, never the NVFP4
    buffers (only their device)."""

    def __init__(self, weight: api.NVFP4, bias: torch.Tensor | None, activations: str = "auto",
                 input_scale: torch.Tensor | None = None):
        super().__init__()
        if not isinstance(weight, api.NVFP4):
            raise TypeError(f"weight must be an nvfp4_inductor.NVFP4; got {type(weight).__name__}")
        if len(weight.shape) != 2:
            raise ValueError(f"weight must be a 2-D (out_features, in_features) NVFP4; got shape "
                             f"{tuple(weight.shape)}")
        check_activations(activations)
        out_features, in_features = weight.shape
        self.in_features, self.out_features = in_features, out_features
        self.activations = activations
        scale = weight.scale
        if weight.swizzled:
            scale = api.unswizzle_scales(scale, out_features, in_features // BLOCK_SIZE)
        self.register_buffer("weight", None)
        self.register_buffer("weight_scale", None)
        self.set_plain(weight.data, scale.view(torch.uint8))
        self.register_buffer("weight_scale_2", weight.global_scale)
        self.register_buffer("input_scale", None)
        if input_scale is not None:
            self.set_input_scale(input_scale)
        # the bias trains as nn.Linear's would (W4A16 passes it a gradient); the weight is data
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=bias.requires_grad)

    def set_plain(self, data: torch.Tensor, scale_bits: torch.Tensor) -> None:
        """uint8 (N, K/2) codes and (N, K/16) scale bits -> the module's tiled buffers (on a meta
        device: empty ones of the tiled shapes)."""
        if data.device.type == "meta":
            shapes = tiled_shapes(self.out_features, self.in_features)
            self.weight, self.weight_scale = (torch.empty(shape, dtype=torch.uint8, device="meta") for shape in shapes)
        else:
            self.weight, self.weight_scale = tile(data, scale_bits)

    def set_input_scale(self, input_scale: torch.Tensor | None) -> None:
        """Set (an fp32 tensor with one element, finite and > 0; it is moved to the weight's
        device) or clear (None) the static global scale of x for W4A4."""
        if input_scale is not None:
            input_scale = checked_input_scale("input_scale", input_scale).to(self.weight.device, copy=True)
        self.input_scale = input_scale

    def _apply(self, fn, recurse=True):
        """Module casts move the NVFP4 buffers to fn's device but keep their dtypes: `.half()`
        would otherwise round the fp32 global scale."""
        self._bound = {}
        return apply_keeping_buffer_dtypes(self, super()._apply, fn, recurse, NVFP4_BUFFERS)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        data, scale = self.plain_weight()
        destination[prefix + "weight"] = data
        destination[prefix + "weight_scale"] = scale

    def plain_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """-> W's codes uint8 (N, K/2) and block scales float8_e4m3fn (N, K/16) (new tensors)."""
        if self.weight.dim() == 2:  # still in the files' layout (while transformers loads them)
            return self.weight, self.weight_scale.view(torch.float8_e4m3fn)
        data, scale = untile(self.weight, self.weight_scale, self.out_features, self.in_features)
        return data, scale.view(torch.float8_e4m3fn)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # Each NVFP4 tensor is checked before it is loaded; a refused one is not loaded (and
        # load_state_dict raises). Codes and scale bytes are bits, which torch's copy would convert
        # as numbers (a uint8 scale byte 0x76 would load as e4m3 118.0); a global scale that is
        # zero, negative or not finite would zero, flip or NaN every output. Codes and scales
        # arrive in the interchange layout and are tiled here, the two together.
        plain = {"weight": (self.out_features, self.in_features // 2),
                 "weight_scale": (self.out_features, self.in_features // BLOCK_SIZE)}
        checks = {"weight": lambda k, v: checked_bits(k, v, (torch.uint8, torch.int8), torch.uint8),
                  "weight_scale": lambda k, v: checked_bits(k, v, (torch.float8_e4m3fn, torch.uint8), torch.uint8),
                  "weight_scale_2": checked_global_scale,
                  "input_scale": checked_input_scale}  # as set_input_scale checks it
        refused, bits = [], {}
        for name, check in checks.items():
            key = prefix + name
            if key not in state_dict:
                continue
            value = state_dict[key]
            try:
                value = check(key, value)
                if name in plain and tuple(value.shape) != plain[name]:
                    raise ValueError(f"{key} has shape {tuple(value.shape)}; this layer "
                                     f"({self.out_features} x {self.in_features}) needs {plain[name]}")
            except (TypeError, ValueError) as error:
                if name == "weight" and isinstance(value, torch.Tensor) and value.is_floating_point():
                    error = TypeError(f"{key} is a {value.dtype} tensor (an unquantized checkpoint), but this "
                                      "layer is NVFP4 already; load it into the model before nv.convert, or load "
                                      "an NVFP4 checkpoint (uint8 codes)")
                error_msgs.append(str(error))
                refused.append(key)
                del state_dict[key]
                continue
            if name in plain:
                bits[name] = value
                del state_dict[key]
            else:
                state_dict[key] = value
                if name == "input_scale" and self.input_scale is None:  # a calibrated checkpoint
                    self.input_scale = torch.empty((), dtype=torch.float32, device=self.weight.device)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        # a refused tensor was there: its error says why, "missing" would not be true
        loaded = {prefix + name for name in bits}  # (present: loaded, or held back with its pair's error)
        missing_keys[:] = [key for key in missing_keys if key not in refused and key not in loaded]
        if len(bits) == 1 and not refused:
            (name,) = bits
            error_msgs.append(f"{prefix}{name} was given without {prefix}"
                              f"{'weight_scale' if name == 'weight' else 'weight'}: an NVFP4 layer's codes and "
                              "block scales load together")
        elif len(bits) == 2:
            device = self.weight.device if self.weight.device.type != "meta" else bits["weight"].device
            with torch.no_grad():
                data, scale = tile(bits["weight"].to(device), bits["weight_scale"].to(device))
            if local_metadata.get("assign_to_params_buffers", False) or self.weight.device.type == "meta":
                self.weight, self.weight_scale = data, scale
            else:
                self.weight.copy_(data)
                self.weight_scale.copy_(scale)

    @classmethod
    def from_linear(cls, linear: nn.Linear, activations: str = "auto", method: str = "rtn",
                    hessian: torch.Tensor | None = None, global_scale=None) -> "NVFP4Linear":
        """Quantize an nn.Linear's weight (its global scale computed from it, or the one given;
        block scales by method, see nvfp4_inductor.quantize)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be a torch.nn.Linear; got {type(linear).__name__}")
        check_activations(activations)
        dtensor = sys.modules.get("torch.distributed.tensor")
        if dtensor is not None and isinstance(linear.weight, dtensor.DTensor):
            raise TypeError("linear's weight is a DTensor (sharded by a tensor-parallel plan): "
                            "nvfp4_inductor.parallel.shard_from_linear quantizes this rank's share with the whole "
                            "weight's global scale (nv.convert calls it for such layers)")
        weight = api.quantize(linear.weight.detach(), global_scale, method=method, hessian=hessian)
        return cls(weight, linear.bias, activations)

    def nvfp4_weight(self) -> api.NVFP4:
        """W as an nvfp4_inductor.NVFP4 in the interchange layout (a copy of the codes and scales)."""
        data, scale = self.plain_weight()
        return api.NVFP4(data, scale, self.weight_scale_2, torch.Size((self.out_features, self.in_features)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eager = (type(x) is torch.Tensor and x.is_cuda and not torch.compiler.is_compiling()
                 and not torch.is_autocast_enabled("cuda")
                 and not (torch.is_grad_enabled() and (x.requires_grad or self.bias is not None and self.bias.requires_grad)))
        if eager:
            # Eager inference: a launch bound to this layer for this form of x (gemm.bind_linear_tiled),
            # as the launcher's per-call checks and set-up cost more host time than the GEMM takes at
            # decode sizes (docs/gemm.md); assignments and .to() drop them (in-place loads keep them valid).
            key = (x.shape, x.stride(), x.dtype, x.device, x.data_ptr() % 16)
            bound = self._bound.get(key)
            if bound is not None:
                y = bound(x)
                if y is not None:
                    return y
        if x.shape[-1] != self.in_features:
            # (the tiled weight's padding would take a K short of or past in_features by less than a tile)
            raise ValueError(f"x has {x.shape[-1]} features in its last dimension; this layer reads "
                             f"in_features = {self.in_features}")
        activation = resolve_activation(self.activations, x.device)
        g = self.weight_scale_2
        if activation == "nvfp4" and self.input_scale is not None:
            # W4A4 with a static scale for x: x's quantized values multiplied as W4A16, the two
            # global scales applied together in the epilogue (as nvfp4_inductor.linear does)
            x_values, x_global_scale = torch.ops.nvfp4.quantize_values(x, self.input_scale)
            x, g, activation = x_values.to(x.dtype), g * x_global_scale, "bf16"
            eager = False  # (x is no longer the caller's: no launch is bound to its form)
        if eager and x.device == self.weight.device and x.dtype in checks.FLOAT_DTYPES:
            # the op's CUDA kernel launched directly, without the dispatcher's and the op's
            # per-call checks (this module's tensors are checked when set; x just now)
            with torch.cuda.device(x.device):
                y = gemm.linear_tiled(x, self.weight, self.weight_scale, g, self.bias, self.out_features, activation)
                if key not in self._bound:  # (None where the plan takes no direct split-K launch: not retried)
                    if len(self._bound) >= 64:  # (a bound on the forms of x kept)
                        self._bound.clear()
                    self._bound[key] = gemm.bind_linear_tiled(x, self.weight, self.weight_scale, g, self.bias,
                                                              self.out_features, activation)
            return y
        return torch.ops.nvfp4.linear_tiled(x, self.weight, self.weight_scale, g, self.bias,
                                            self.out_features, activation)

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        self.__dict__["_bound"] = {}  # launches bound to this module's tensors (forward)

    def __getstate__(self):
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__.copy()
        return {**state, "_bound": {}}  # (compiled kernels are not copied)

    def extra_repr(self) -> str:
        static = ", static input_scale" if self.input_scale is not None else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, activations={self.activations}{static}")
