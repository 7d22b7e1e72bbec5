"""Eager model conversion: `convert(model, config)` swaps `nn.Linear` layers for `NVFP4Linear`
(and transformers experts modules for `NVFP4Experts`), returning a `ConversionReport`."""

import sys
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from nvfp4_inductor import checkpoint_config, checks
from nvfp4_inductor.config import Config, layer_skip_reason
from nvfp4_inductor.format import BLOCK_SIZE
from nvfp4_inductor.modules import hf_names
from nvfp4_inductor.modules.common import checked_input_scale, replace_module
from nvfp4_inductor.modules.experts import convert_experts_for_report, is_experts, NVFP4Experts
from nvfp4_inductor.modules.linear import NVFP4Linear
from nvfp4_inductor.reference import compute_global_scale

__all__ = ["ConversionReport", "convert", "linear_targets", "FUSED_GROUPS", "fused_groups", "unquantized_modules"]


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
    if module.weight.dtype not in checks.FLOAT_DTYPES:
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
        checks.check_tensor(f"hessians[{name!r}]", h, (torch.float32,))
        expected = (module.in_features // BLOCK_SIZE, BLOCK_SIZE, BLOCK_SIZE)
        if tuple(h.shape) != expected:
            raise ValueError(f"hessians[{name!r}] must have shape {expected}; got {tuple(h.shape)}")
        checks.check_hessian_values(f"hessians[{name!r}]", h)
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
    return {name: checked_input_scale(f"input_scales[{name!r}]", config.input_scales[name])
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
    transformers experts module (3-D expert weights) by an NVFP4Experts (modules/experts.py);
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
            replacement = _from_linear(module, config.activations, config.weight_method, hessians.get(own[0]),
                                       shared.get(own[0]))
            replacement.set_input_scale(input_scales.get(own[0]))
        for name in own:
            replace_module(model, name, module, replacement)
        report.converted += own
        report.layers += 1
    converted, modules, refused = convert_experts_for_report(model, config)
    report.converted += converted
    report.layers += modules
    report.skipped.update(refused)
    if report.layers:
        _record_quantization(model)
    if not report.layers:  # nothing to gain, and nothing changed: say so rather than return quietly
        found = (f"none of its {len(report.skipped)} nn.Linear layers qualified: see the report's "
                 "skipped reasons" if report.skipped else "it has no nn.Linear layers")
        warnings.warn(f"nv.convert converted nothing: {found}", stacklevel=2)
    return report


def _from_linear(linear: nn.Linear, activations: str, method: str, hessian, global_scale) -> NVFP4Linear:
    """NVFP4Linear.from_linear, or for a weight sharded by a tensor-parallel plan (a DTensor) this
    rank's NVFP4LinearShard, quantized with the whole weight's global scale."""
    dtensor = sys.modules.get("torch.distributed.tensor")  # (no DTensor can exist before it is imported)
    if dtensor is not None and isinstance(linear.weight, dtensor.DTensor):
        from nvfp4_inductor.modules.sharded import shard_from_linear  # imports torch.distributed: sharded models only

        return shard_from_linear(linear, activations, method, hessian, global_scale)
    return NVFP4Linear.from_linear(linear, activations, method, hessian, global_scale)


def _record_quantization(model: nn.Module) -> None:
    """A transformers model's config gets the ModelOpt quantization_config of what the model now
    holds, so that its save_pretrained writes a checkpoint that from_pretrained (after
    register_transformers_quantizer) and ModelOpt readers load; other models are left alone."""
    config = getattr(model, "config", None)
    if not (hasattr(config, "to_dict") and hasattr(model, "save_pretrained")):
        return
    w4a4 = any(m.activations == "nvfp4" for m in model.modules() if isinstance(m, (NVFP4Linear, NVFP4Experts)))
    config.quantization_config = checkpoint_config.modelopt_configs(w4a4, unquantized_modules(model))[0]


def unquantized_modules(model: nn.Module) -> list[str]:
    """model's nn.Linear layers and transformers experts modules left unquantized, under the
    names its checkpoint files give them (hf_names), sorted: a quantization config's exclude list."""
    rename = hf_names.module_renamer(model, to_checkpoint=True)
    return sorted(rename(name) for name, m in model.named_modules() if type(m) is nn.Linear or is_experts(m))


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
    by_name = dict(layers)
    shared = {}
    for members in fused_groups(by_name):
        g = torch.stack([compute_global_scale(by_name[m].weight.detach().float()) for m in members]).max()
        shared.update(dict.fromkeys(members, g))
    return shared
