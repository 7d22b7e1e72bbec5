"""Eager model conversion: `convert(model, config)` swaps `nn.Linear` layers for `NVFP4Linear`,
which keeps only the NVFP4 weight (the bf16 copy is freed), in the tiled layout, and runs
`nvfp4::linear_tiled`.

Its state dict holds the weight under the ModelOpt checkpoint names: `weight` uint8 (N, K/2),
`weight_scale` float8_e4m3fn (N, K/16), `weight_scale_2` fp32 (the decode global scale).
"""

import sys
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from . import _checks, _hf_names, api, checkpoint_config
from .format import BLOCK_SIZE
from .kernels import gemm, plan  # (no Triton import: gemm.py imports its kernels when they launch)
from .tiled import tile, tiled_shapes, untile
from .config import Config, check_activations, layer_skip_reason, resolve_activation

__all__ = ["NVFP4Linear", "ConversionReport", "convert", "linear_targets"]

def _checked_global_scale(name: str, scale) -> torch.Tensor:
    """A global scale (a loaded weight_scale_2, whose shape load_state_dict checks against the
    module's; or x's, _checked_input_scale): fp32, every element finite and > 0."""
    _checks.check_tensor(name, scale, (torch.float32,))
    if not bool(torch.isfinite(scale).all() and (scale > 0).all()):  # set once, not per call: a sync is fine
        got = scale.item() if scale.numel() == 1 else scale.detach().flatten()[:4].tolist()
        raise ValueError(f"{name} must be finite and > 0; got {got}")
    return scale


def _checked_bits(name: str, value, dtypes: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A loaded tensor of codes or scale bytes (one of dtypes: bits, as ModelOpt's e4m3 scales
    also travel as uint8 bytes) -> those bits as the module's buffer dtype. A value conversion
    would turn scale byte 0x76 into 118.0: other dtypes are refused."""
    _checks.check_tensor(name, value, dtypes)
    return value.view(dtype)


def _checked_input_scale(name: str, input_scale) -> torch.Tensor:
    """A static global scale of x: an fp32 tensor of one element, finite and > 0 -> its 0-d view."""
    _checks.check_tensor(name, input_scale, (torch.float32,))
    if input_scale.numel() != 1:
        raise ValueError(f"{name} must hold one per-tensor scale; got shape {tuple(input_scale.shape)}")
    return _checked_global_scale(name, input_scale.detach().reshape(()))


def apply_keeping_buffer_dtypes(module: nn.Module, apply, fn, recurse, names) -> nn.Module:
    """nn.Module._apply (`apply`, the caller's super()._apply) with the buffers named in names
    moved to fn's device but kept in their dtypes (NVFP4 codes, e4m3 scales, fp32 global scales:
    a cast such as `.half()` would change their meaning)."""
    before = {name: module._buffers[name] for name in names if module._buffers.get(name) is not None}
    apply(fn, recurse)
    for name, old in before.items():
        new = module._buffers[name]
        if new.dtype != old.dtype:
            module._buffers[name] = old.to(new.device)
    return module


class NVFP4Linear(nn.Module):
    """y = x @ W^T + b with W held as NVFP4 (ModelOpt names: weight, weight_scale, weight_scale_2;
    input_scale, where set, the static global scale W4A4 quantizes x with: see
    collect_input_scales. None: computed from each x on the device).

    The module holds W's codes and block scales in the tiled layout (nvfp4_inductor.tiled: the
    layout the decode GEMM reads fastest, and the one backend="nvfp4" compiles to), so that it
    runs the same kernels eagerly, under torch.compile with any backend and under
    backend="nvfp4". Its state dict holds the interchange layout whatever the module holds:
    `weight` uint8 (N, K/2), `weight_scale` float8_e4m3fn (N, K/16) (tiled on load, untiled on
    save). Module casts (`.half()`, `.to(torch.bfloat16)`, ...) change the bias, never the NVFP4
    buffers (only their device)."""

    _NVFP4_BUFFERS = ("weight", "weight_scale", "weight_scale_2", "input_scale")

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
        self._set_plain(weight.data, scale.view(torch.uint8))
        self.register_buffer("weight_scale_2", weight.global_scale)
        self.register_buffer("input_scale", None)
        if input_scale is not None:
            self.set_input_scale(input_scale)
        # the bias trains as nn.Linear's would (W4A16 passes it a gradient); the weight is data
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=bias.requires_grad)

    def _set_plain(self, data: torch.Tensor, scale_bits: torch.Tensor) -> None:
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
            input_scale = _checked_input_scale("input_scale", input_scale).to(self.weight.device, copy=True)
        self.input_scale = input_scale

    def _apply(self, fn, recurse=True):
        """Module casts move the NVFP4 buffers to fn's device but keep their dtypes: `.half()`
        would otherwise round the fp32 global scale."""
        self._bound = {}
        return apply_keeping_buffer_dtypes(self, super()._apply, fn, recurse, self._NVFP4_BUFFERS)

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
        checks = {"weight": lambda k, v: _checked_bits(k, v, (torch.uint8, torch.int8), torch.uint8),
                  "weight_scale": lambda k, v: _checked_bits(k, v, (torch.float8_e4m3fn, torch.uint8), torch.uint8),
                  "weight_scale_2": _checked_global_scale,
                  "input_scale": _checked_input_scale}  # as set_input_scale checks it
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
        if dtensor is not None and isinstance(linear.weight, dtensor.DTensor):  # tensor-parallel
            from .parallel import shard_from_linear  # this rank's share, the whole weight's global scale

            return shard_from_linear(linear, activations, method, hessian, global_scale)
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
        activation = resolve_activation(self.activations, x)
        g = self.weight_scale_2
        if activation == "nvfp4" and self.input_scale is not None:
            # W4A4 with a static scale for x: x's quantized values multiplied as W4A16, the two
            # global scales applied together in the epilogue (as nvfp4_inductor.linear does)
            x_values, x_global_scale = torch.ops.nvfp4.quantize_values(x, self.input_scale)
            x, g, activation = x_values.to(x.dtype), g * x_global_scale, "bf16"
            eager = False  # (x is no longer the caller's: no launch is bound to its form)
        if eager and x.device == self.weight.device and x.dtype in _checks.FLOAT_DTYPES:
            # the op's CUDA kernel launched directly, without the dispatcher's and the op's
            # per-call checks (this module's tensors are checked when set; x just now)
            with torch.cuda.device(x.device):
                y = gemm.linear_tiled(x, self.weight, self.weight_scale, g, self.bias, self.out_features, activation)
                if key not in self._bound and x.numel() <= plan.SPLITK_MAX_M_TILED * x.shape[-1]:
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


@dataclass
class ConversionReport:
    """Which layers were converted, and which were left in bf16 and why (name -> reason)."""

    converted: list[str] = field(default_factory=list)  # every name of a converted layer
    skipped: dict[str, str] = field(default_factory=dict)
    layers: int = 0  # converted layers and experts modules (one registered under two names counts once)

    def __str__(self) -> str:
        names = f" ({len(self.converted)} names)" if len(self.converted) != self.layers else ""
        lines = [f"NVFP4: converted {self.layers} linear layers{names}, skipped {len(self.skipped)}"]
        lines += [f"  skipped {name}: {reason}" for name, reason in self.skipped.items()]
        return "\n".join(lines)


# Modules whose forward reads a child Linear's .weight itself (nn.TransformerEncoderLayer's fast
# path, under no_grad in eval mode, passes linear1 / linear2 .weight to one fused op): converting
# the child would hand that op packed uint8 codes.
_READS_CHILD_WEIGHTS = (nn.TransformerEncoderLayer,)


def _skip_reason(name: str, module: nn.Linear, config: Config, tied_to: list[str],
                 weight_reader: str | None) -> str | None:
    if type(module) is not nn.Linear:
        return (f"{type(module).__name__} subclasses nn.Linear (its forward or its users may "
                "differ): left alone")
    if module.weight.dtype not in _checks.FLOAT_DTYPES:
        return f"weight dtype {module.weight.dtype} is not a float format NVFP4 converts"
    if tied_to:
        return (f"weight shared with {', '.join(tied_to)} (tied): converting would untie it and "
                "free nothing")
    if weight_reader is not None:
        return f"its parent ({weight_reader}) reads its .weight directly"
    return layer_skip_reason(config, name, tuple(module.weight.shape), module)


def _layer_hessians(config: Config, layers) -> dict:
    """For weight_method "hessian": each converted layer's H, checked and on its weight's device,
    before any layer is replaced (a missing one is an error, not a silent bf16 layer)."""
    if config.weight_method != "hessian":
        return {}
    missing = [name for name, _ in layers if name not in config.hessians]
    if missing:
        raise ValueError(f"Config.hessians has no calibration Hessian for layers {missing} "
                         "(collect_hessians(model, batches) collects one per nn.Linear)")
    found = {}
    for name, module in layers:
        h = config.hessians[name]
        _checks.check_tensor(f"hessians[{name!r}]", h, (torch.float32,))
        expected = (module.in_features // BLOCK_SIZE, BLOCK_SIZE, BLOCK_SIZE)
        if tuple(h.shape) != expected:
            raise ValueError(f"hessians[{name!r}] must have shape {expected}; got {tuple(h.shape)}")
        _checks.check_hessian_values(f"hessians[{name!r}]", h)
        found[name] = h.to(module.weight.device)
    return found


def _layer_input_scales(config: Config, layers) -> dict:
    """Config.input_scales for the layers to convert, checked before any layer is replaced (a
    missing one is an error: that layer would quantize x with a scale of its own instead)."""
    if config.input_scales is None:
        return {}
    missing = [name for name, _ in layers if name not in config.input_scales]
    if missing:
        raise ValueError(f"Config.input_scales has no input scale for layers {missing} "
                         "(collect_input_scales(model, batches) collects one per nn.Linear)")
    return {name: _checked_input_scale(f"input_scales[{name!r}]", config.input_scales[name])
            for name, _ in layers}


def linear_targets(model: nn.Module, config: Config) -> list[tuple[list[str], nn.Linear, dict[str, str]]]:
    """-> [(every name of one nn.Linear of model, the layer, {name: why it stays in bf16}, empty
    where it converts)], in model order, by convert's rules; reads no weight values (a model on
    the meta device gives the same answer)."""
    # Every name of every Linear: a module registered under two names gets one replacement under
    # both (named_modules() would yield it once and leave the other name in bf16).
    paths: dict[int, list[str]] = {}
    linears: dict[int, nn.Linear] = {}
    readers: dict[str, str] = {}  # child path -> the type of a parent that reads its .weight
    for name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, nn.Linear):
            paths.setdefault(id(module), []).append(name)
            linears[id(module)] = module
        if isinstance(module, _READS_CHILD_WEIGHTS):
            for child, _ in module.named_children():
                readers[f"{name}.{child}" if name else child] = type(module).__name__
    holders: dict[int, list[str]] = {}  # parameter -> the modules that hold it
    for pname, param in model.named_parameters(remove_duplicate=False):
        holders.setdefault(id(param), []).append(pname.rpartition(".")[0])
    targets = []
    for key, module in linears.items():
        own = paths[key]
        tied_to = [m or "the model" for m in holders.get(id(module.weight), []) if m not in own]
        reader = next((readers[p] for p in own if p in readers), None)
        # every name the layer is reachable under must pass (an output head also registered under
        # another name stays an output head; Config.include sees each name)
        reasons = {}
        for path in own:
            reason = _skip_reason(path, module, config, tied_to, reader)
            if reason is not None:
                reasons = {p: reason if p == path else f"{reason} (as {path})" for p in own}
                break
        if "" in own:  # convert(nn.Linear(...)): nothing holds it to swap
            reasons = dict.fromkeys(own, "the model itself: use NVFP4Linear.from_linear(model)")
        targets.append((own, module, reasons))
    return targets


def convert(model: nn.Module, config: Config | None = None) -> ConversionReport:
    """Replace, in place, every eligible nn.Linear of model by an NVFP4Linear, and every
    transformers experts module (3-D expert weights) by an NVFP4Experts (nvfp4_inductor.moe);
    returns a report.

    The bf16 weights are released (nothing in the model refers to them any more)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    config = config or Config()
    if not isinstance(config, Config):
        raise TypeError(f"config must be an nvfp4_inductor.Config; got {type(config).__name__}")
    report = ConversionReport()
    targets = linear_targets(model, config)
    converting = [(own[0], m) for own, m, reasons in targets if not reasons]
    shared = _shared_global_scales(converting) if config.share_global_scales else {}
    hessians = _layer_hessians(config, converting)
    input_scales = _layer_input_scales(config, converting)
    for own, module, reasons in targets:
        if reasons:
            report.skipped.update(reasons)
            continue
        with torch.no_grad():
            replacement = NVFP4Linear.from_linear(module, config.activations, config.weight_method,
                                                  hessians.get(own[0]), shared.get(own[0]))
            replacement.set_input_scale(input_scales.get(own[0]))
        for name in own:
            _replace(model, name, module, replacement)
        report.converted += own
        report.layers += 1
    from .moe import convert_experts_for_report

    converted, modules, refused = convert_experts_for_report(model, config)
    report.converted += converted
    report.layers += modules
    report.skipped.update(refused)
    if report.layers:
        _record_quantization(model, report)
    if not report.layers:  # nothing to gain, and nothing changed: say so rather than return quietly
        found = (f"none of its {len(report.skipped)} nn.Linear layers qualified: see the report's "
                 "skipped reasons" if report.skipped else "it has no nn.Linear layers")
        warnings.warn(f"nv.convert converted nothing: {found}", stacklevel=2)
    return report


def _record_quantization(model: nn.Module, report: ConversionReport) -> None:
    """A transformers model's config gets the ModelOpt quantization_config of what the model now
    holds, so that its save_pretrained writes a checkpoint that from_pretrained (after
    register_transformers_quantizer) and ModelOpt readers load; other models are left alone."""
    config = getattr(model, "config", None)
    if not (hasattr(config, "to_dict") and hasattr(model, "save_pretrained")):
        return
    rename = _hf_names.module_renamer(model, to_checkpoint=True)
    excluded = sorted(rename(name) for name, m in model.named_modules()
                      if type(m) is nn.Linear or name in report.skipped)
    w4a4 = any(getattr(m, "activations", None) == "nvfp4" for m in model.modules()
               if isinstance(m, NVFP4Linear) or hasattr(m, "checkpoint_names"))
    config.quantization_config = checkpoint_config.modelopt_configs(w4a4, excluded)[0]


# Linears that engines fuse into one GEMM with one global scale (vLLM, SGLang, TensorRT-LLM read
# the group's max): sibling layers with these names that all read inputs of one width.
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"),
                ("query", "key", "value"), ("wq", "wk", "wv"))


def fused_groups(layers: dict) -> list[list[str]]:
    """The FUSED_GROUPS among {name: linear layer} (two or more siblings of one parent that read
    inputs of one width), as lists of names."""
    groups = []
    for parent in sorted({name.rpartition(".")[0] for name in layers}):
        prefix = f"{parent}." if parent else ""
        for group in FUSED_GROUPS:
            members = [prefix + child for child in group if prefix + child in layers]
            if len(members) > 1 and len({layers[m].in_features for m in members}) == 1:
                groups.append(members)
    return groups


def _shared_global_scales(layers) -> dict:
    """{layer name: the global scale its fused group shares} for the layers to convert: the
    largest of the group's own scales (max(amax) / 2688, as ModelOpt and llmcompressor export)."""
    from .reference import compute_global_scale

    by_name = dict(layers)
    shared = {}
    for members in fused_groups(by_name):
        g = torch.stack([compute_global_scale(by_name[m].weight.detach().float()) for m in members]).max()
        shared.update(dict.fromkeys(members, g))
    return shared


# nn.Module's hook dicts: moved (the same dict objects, so the handles a user holds still remove
# them) from a replaced Linear to its NVFP4Linear
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
               "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_backward_pre_hooks",
               "_backward_hooks", "_state_dict_pre_hooks", "_state_dict_hooks",
               "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


def _replace(model: nn.Module, name: str, old: nn.Module, new: nn.Module) -> None:
    """Put new in old's place at `name` in model, with old's mode and hooks."""
    _carry_module_state(old, new)
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def _carry_module_state(old: nn.Module, new: nn.Module) -> None:
    """The replaced Linear's train / eval mode and its hooks go to its replacement."""
    new.train(old.training)
    for name in _HOOK_DICTS + ("_is_full_backward_hook",):
        if name in old.__dict__:
            setattr(new, name, old.__dict__[name])
