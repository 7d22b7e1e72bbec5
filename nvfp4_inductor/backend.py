"""torch.compile(model, backend="nvfp4"): BF16 linears become NVFP4, quantized once per compile.

Found through the `torch_dynamo_backends` entry point (never registered at import: a second
registration makes the lookup fail). What a user must do: run inference under torch.no_grad() (or
inference_mode) and let Dynamo hand the parameters over as constants, which needs freezing while
it traces; `nvfp4_inductor.compile(model, ...)` does both. Where the parameters still arrive as
graph inputs, the backend warns and compiles the graph unchanged (bf16), rather than quantizing
the weights on every call.
"""

import warnings

import torch
from torch import nn

from . import _compat
from .convert import OUTPUT_HEAD_NAMES, Config, _resolve_activation
from .rewrite import LinearToNVFP4, log

__all__ = ["nvfp4_backend", "compile"]

CONFIG_KEY = "nvfp4"  # options={"nvfp4": Config(...)} carries the package's options


class _Keep:
    """Config's layer rules on (parameter name, weight shape) -> reason to stay bf16, or None."""

    def __init__(self, config: Config):
        self.config = config
        self.cache_key = (config.activations, config.skip_output_head, config.min_weight_numel,
                          config.include is not None)

    def __call__(self, name: str, shape: tuple) -> str | None:
        # Dynamo names parameters "L__self___lm_head.weight" or "L__s___lm_head_weight".
        stem = name.replace(".", "_").removesuffix("_weight")
        if self.config.skip_output_head and any(
                stem == head or stem.endswith("_" + head) for head in OUTPUT_HEAD_NAMES):
            return "output head (Config.skip_output_head)"
        if shape[0] * shape[1] < self.config.min_weight_numel:
            return f"{shape[0] * shape[1]} weights < Config.min_weight_numel"
        if self.config.include is not None and not self.config.include(name, None):
            return "excluded by Config.include"
        return None


def _inductor_patches(mode, options: dict) -> dict:
    patches = dict(_compat.list_mode_options(mode)) if mode not in (None, "default") else {}
    patches.update(options)
    return patches


def nvfp4_backend(gm: torch.fx.GraphModule, example_inputs, mode=None, options=None):
    """The Dynamo backend: Inductor with freezing and the NVFP4 linear rewrite."""
    options = dict(options or {})
    config = options.pop(CONFIG_KEY, None) or Config()
    if not isinstance(config, Config):
        raise TypeError(f"options['{CONFIG_KEY}'] must be an nvfp4_inductor.Config; got {config!r}")
    patches = _inductor_patches(mode, options)
    lifted = sum(isinstance(t, nn.Parameter) for t in example_inputs)
    if torch.is_grad_enabled() or lifted:
        why = ("gradients are enabled: run inference under torch.no_grad()" if torch.is_grad_enabled()
               else f"{lifted} parameters arrived as graph inputs (Dynamo lifts them as constants "
                    "only while freezing is on)")
        warnings.warn(f"backend='nvfp4' compiled this graph without NVFP4: {why}. Use "
                      "nvfp4_inductor.compile(model), which sets both up, or "
                      "nvfp4_inductor.convert(model) first.", stacklevel=2)
        return _compat.compile_fx(gm, example_inputs, config_patches=patches)
    devices = {t.device.type for t in example_inputs if isinstance(t, torch.Tensor)}
    sample = next((t for t in example_inputs if isinstance(t, torch.Tensor)), torch.empty(0))
    names = [name for name, _ in gm.named_parameters()] + [name for name, _ in gm.named_buffers()]
    rewrite = LinearToNVFP4(_resolve_activation(config.activations, sample), names, _Keep(config))
    patches.update({"freezing": True, "joint_custom_post_pass": rewrite})
    if devices <= {"cpu"}:
        patches["cpp.weight_prepack"] = False  # else freezing turns linears into mkldnn ops first
    compiled = _compat.compile_fx(gm, example_inputs, config_patches=patches)
    log.info("nvfp4: %s", {"converted": rewrite.converted, "skipped": rewrite.skipped})
    return compiled


def compile(model, config: Config | None = None, *, mode=None, options=None, **compile_kwargs):
    """torch.compile(model, backend="nvfp4") for inference: every call runs under torch.no_grad()
    with Dynamo preparing freezing, so the weights are quantized once, at compile time."""
    # torch.compile takes mode or options, not both: the mode travels as the options it stands for.
    options = {**_inductor_patches(mode, options or {}), CONFIG_KEY: config or Config()}
    compiled = torch.compile(model, backend="nvfp4", options=options, **compile_kwargs)

    def run(*args, **kwargs):
        with torch.no_grad(), torch._dynamo.config.patch(prepare_freezing=True):
            return compiled(*args, **kwargs)

    run.compiled = compiled
    return run
