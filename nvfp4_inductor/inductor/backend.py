"""torch.compile(model, backend="nvfp4"): BF16 linears become NVFP4, quantized once per compile.

Found through the `torch_dynamo_backends` entry point (never registered at import: a second
registration makes the lookup fail). What a user must do: run inference under torch.no_grad() (or
inference_mode) and let Dynamo hand the parameters over as constants, which needs freezing while
it traces; `nvfp4_inductor.compile(model, ...)` does both. Where the parameters still arrive as
graph inputs, the backend warns and compiles the graph unchanged (bf16), rather than quantizing
the weights on every call.
"""

import contextlib
import threading
import warnings

import torch
from torch import nn

from . import _compat
from ..config import Config, layer_skip_reason, resolve_activation
from .rewrite import LinearToNVFP4

__all__ = ["nvfp4_backend", "compile"]

CONFIG_KEY = "nvfp4"  # options={"nvfp4": Config(...)} carries the package's options


def _options_dict(options) -> dict:
    """options as given to nv.compile or the backend (None or a dict) -> a copy to pop from."""
    if options is not None and not isinstance(options, dict):
        raise TypeError(f"options must be a dict of Inductor config options; got {type(options).__name__}")
    return dict(options or {})


def _inductor_patches(mode, options: dict) -> dict:
    """mode's Inductor options, then the user's (Inductor config names, "_" or "-" spelled, with
    values of the option's type, checked here as torch.compile's Inductor wrapper checks them)."""
    patches = dict(_compat.list_mode_options(mode)) if mode not in (None, "default") else {}
    defaults = _compat.inductor_config_defaults()
    for key, value in options.items():
        name = key.replace("-", "_") if isinstance(key, str) else key
        if name not in defaults:
            raise ValueError(f"options: {key!r} is not an Inductor config option")
        default = defaults[name]
        if default is not None and not isinstance(value, type(default)) and not (
                isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool)):
            raise TypeError(f"options[{key!r}] must be a {type(default).__name__} (Inductor's "
                            f"default: {default!r}); got {value!r}")
        patches[name] = value
    # The rewrite is a joint-graph pass over decomposed linears (mm / addmm): mode="lite" turns
    # both off, which would compile the model in bf16 without a word.
    off = {name: patches[name] for name, needed in _REWRITE_NEEDS.items()
           if name in patches and patches[name] != needed}
    if off:
        raise ValueError(f"backend='nvfp4' needs {_REWRITE_NEEDS} for its rewrite of the linears; "
                         f"mode={mode!r} / options set {off}")
    return patches


_REWRITE_NEEDS = {"use_joint_graph_passes": True, "selective_decompose": False}


def _check_no_calibration_data(config: Config) -> None:
    if config.weight_method == "hessian":
        raise ValueError(
            'backend="nvfp4" cannot use weight_method="hessian" (the graph has no calibration '
            "data keyed by its parameter names): run nvfp4_inductor.convert(model, "
            'Config(weight_method="hessian", hessians=collect_hessians(model, batches))) first, '
            "then compile the converted model")
    if config.input_scales is not None:
        raise ValueError(
            'backend="nvfp4" cannot use Config.input_scales (the graph has no calibration data keyed '
            'by its parameter names): run nvfp4_inductor.convert(model, Config(activations="nvfp4", '
            'input_scales=collect_input_scales(model, batches))) first, then compile the converted model')


def nvfp4_backend(gm: torch.fx.GraphModule, example_inputs, mode=None, options=None):
    """The Dynamo backend: Inductor with freezing and the NVFP4 linear rewrite."""
    options = _options_dict(options)
    config = options.pop(CONFIG_KEY, None) or Config()
    if not isinstance(config, Config):
        raise TypeError(f"options['{CONFIG_KEY}'] must be an nvfp4_inductor.Config; got {config!r}")
    _check_no_calibration_data(config)
    patches = _inductor_patches(mode, options)
    # the module's tensors as graph inputs (weights only: 2-D floating point): a Linear's parameter,
    # or a weight held in a buffer (such a model has no parameter to count)
    placeholders = gm.graph.find_nodes(op="placeholder")
    lifted = sum(_compat.is_module_tensor_input(node, t) and t.dim() == 2 and t.is_floating_point()
                 for node, t in zip(placeholders, example_inputs))
    if torch.is_grad_enabled() or lifted:
        why = ("gradients are enabled: run inference under torch.no_grad()" if torch.is_grad_enabled()
               else f"{lifted} parameters or buffers arrived as graph inputs (Dynamo lifts them as "
                    "constants only while freezing is on)")
        warnings.warn(f"backend='nvfp4' compiled this graph without NVFP4: {why}. Use "
                      "nvfp4_inductor.compile(model), which sets both up, or "
                      "nvfp4_inductor.convert(model) first.", stacklevel=2)
        return _compat.compile_fx(gm, example_inputs, config_patches=patches)
    constants = [*gm.named_parameters(), *gm.named_buffers()]
    # the inputs', and the module's own tensors' (a graph may have no tensor inputs: a decode step
    # whose token and position are buffers)
    tensors = [t for t in example_inputs if isinstance(t, torch.Tensor)] + [t for _, t in constants]
    devices = {t.device.type for t in tensors}
    sample = next(iter(tensors), torch.empty(0))
    # Each constant by its module path ("layers.0.mlp.lm_head.weight") where Dynamo recorded one
    # (else its flat name, "L__self___lm_head_weight"): Config's decisions, taken here (the pass
    # sees no modules) and part of the pass's cache key, judge that path as convert() does, and
    # the pass's log names the weights by it, as Config.include is given them.
    paths = gm.meta.get("dynamo_flat_name_to_original_fqn", {})
    names = [paths.get(name, name) for name, _ in constants]
    keep = {path: layer_skip_reason(config, path.removesuffix(".weight"), tuple(p.shape))
            for path, (_, p) in zip(names, constants) if p.dim() == 2}
    rewrite = LinearToNVFP4(resolve_activation(config.activations, sample), names, keep,
                            config.weight_method, config.merge_linears, config.fuse_norms)
    from . import lowering  # imports Inductor's lowering machinery: only when compiling

    lowering.register()  # nvfp4.linear_tiled -> the NVFP4 GEMM template + fused epilogue
    patches.update({"freezing": True, "joint_custom_post_pass": rewrite})
    # Inductor's pad_mm (a joint-graph pass, before ours; CUDA only) pads a bf16 mm's unaligned
    # dims when a benchmark of the bf16 GEMM says so: x with 5 rows becomes a copy to 8 rows, the
    # NVFP4 GEMM on those and a slice (two kernels more), decided by timing noise. Off unless asked.
    patches.setdefault("shape_padding", False)
    # Freezing would turn CPU linears into mkldnn ops first. Off for every graph, not only CPU
    # ones: Inductor registers its mkldnn weight-pack patterns once per process, at the first
    # freezing compile with the option on, and applies them from then on whatever the option says
    # (a CUDA graph compiled first would make a later CPU graph's head an mkldnn op, which also
    # bypasses the FX graph cache).
    patches["cpp.weight_prepack"] = False
    # Inductor inlines a frozen 0-d tensor (our per-tensor global scales) as a literal, while its
    # FX graph cache keys frozen tensors by metadata only: a model with other global scales would
    # hit the cache and run the first model's (its codes and block scales, which are bound by
    # name, would be right). Kept as named constants, they are bound like the codes.
    patches["always_keep_tensor_constants"] = True
    pdl = _compat.pdl_option()
    if pdl is not None and "cuda" in devices:
        # Programmatic dependent launch (Inductor emits it on sm_90+ only): each kernel launches
        # while the one before it finishes and waits where it reads that kernel's outputs; the
        # NVFP4 template loads its first weight tile before that wait. It shortens the decode step
        # (docs/backend.md).
        patches.setdefault(pdl, True)
    return _compat.compile_fx(gm, example_inputs, config_patches=patches)  # the pass logs its counts


_calls = threading.local()  # per thread: how many nv.compile calls are running, and what to undo


# Set while Dynamo traces inside an nv.compile call: prepare_freezing lifts the parameters as
# constants; Inductor's freezing flag (with grad off) makes Dynamo guard on their identity, without
# which a second instance of a module class (or a repeated submodule with a graph break inside)
# would run the compiled code of the first, with the first's frozen weights.
def _trace_flags():
    import torch._inductor.config

    return (torch._dynamo.config, "prepare_freezing"), (torch._inductor.config, "freezing")


def _prepare_freezing_while_tracing(_args) -> None:
    """Dynamo start-of-compilation callback: inside an nv.compile call, turn the _trace_flags() on
    for the trace (Dynamo reads them while tracing; a later call may trace a new shape)."""
    if getattr(_calls, "depth", 0) and not getattr(_calls, "undo", None):
        _calls.undo = [(config, name) for config, name in _trace_flags() if not getattr(config, name)]
        for config, name in _calls.undo:
            setattr(config, name, True)


def _restore_prepare_freezing(_args) -> None:
    for config, name in getattr(_calls, "undo", None) or ():
        setattr(config, name, False)
    _calls.undo = None


def _install_compile_callbacks() -> bool:
    """-> whether Dynamo will run the callbacks (False: this torch lacks the API). Idempotent;
    checked on every call, since torch._dynamo.reset() clears the callbacks."""
    handler = _compat.compile_callback_handler()
    if handler is None:
        return False
    if _prepare_freezing_while_tracing not in handler.start_callbacks:
        handler.register_start_callback(_prepare_freezing_while_tracing)
        handler.register_end_callback(_restore_prepare_freezing)
    return True


def compile(model, config: Config | None = None, *, mode=None, options=None, **compile_kwargs):
    """torch.compile(model, backend="nvfp4") for inference: every call runs under torch.no_grad(),
    and whenever Dynamo traces during a call it does so preparing freezing, so the weights are
    quantized once, at compile time. The Config comes as config, or as options["nvfp4"] (what
    torch.compile(backend="nvfp4", options=...) takes), not both."""
    options = _options_dict(options)
    if CONFIG_KEY in options:
        if config is not None:
            raise ValueError(f"a Config given twice: as config and as options['{CONFIG_KEY}']")
        config = options.pop(CONFIG_KEY)
    if config is not None:
        if not isinstance(config, Config):
            raise TypeError(f"config must be an nvfp4_inductor.Config; got {type(config).__name__}")
        _check_no_calibration_data(config)
    # torch.compile takes mode or options, not both: the mode travels as the options it stands for.
    options = {**_inductor_patches(mode, options), CONFIG_KEY: config or Config()}
    compiled = torch.compile(model, backend="nvfp4", options=options, **compile_kwargs)

    def run(*args, **kwargs):
        # The flag is set only while Dynamo compiles (callbacks above): changing Dynamo's config
        # on every call costs host time on every call, more than a small graph's kernels take
        # (docs/backend.md).
        if _install_compile_callbacks():
            freezing = contextlib.nullcontext()
        else:  # no callbacks in this torch: set the flags for the whole call
            freezing = contextlib.ExitStack()
            for config, name in _trace_flags():
                freezing.enter_context(config.patch(**{name: True}))
        _calls.depth = getattr(_calls, "depth", 0) + 1
        try:
            with torch.no_grad(), freezing:
                return compiled(*args, **kwargs)
        finally:
            _calls.depth -= 1

    run.compiled = compiled
    return run
