"""torch.compile(model, backend="nvfp4"): BF16 linears become NVFP4, quantized once per compile.

Found through the `torch_dynamo_backends` entry point (never registered at import: a second
registration makes the lookup fail). Run inference under torch.no_grad() (or inference_mode):
with gradients on, the backend warns and compiles in bf16.

The weights must reach Inductor as constants, so that freezing folds their quantization into
the compiled graph once. Dynamo hands a module's parameters over as graph inputs (its default);
the backend then makes the weight inputs, the parameters and 2-D floating-point buffers that
the graph does not mutate, constants of the graph it compiles, and the compiled function checks
on every call that it is given the same tensors, unmodified: another tensor (another module
instance running the same code) or a tensor modified in place (load_state_dict, an optimizer
step) gets a graph compiled for it, never the old weights. With freezing on while Dynamo traces
(torch._dynamo.config.prepare_freezing, set by the user) the weights arrive as constants already.
"""

import operator
import re
import sys
import warnings
import weakref

import torch
from torch import nn

from nvfp4_inductor.config import Config, layer_skip_reason, resolve_activation
from nvfp4_inductor.lowerings import compat as _compat
from nvfp4_inductor.lowerings.passes import experts as experts_pass
from nvfp4_inductor.lowerings.passes.linear import LinearToNVFP4
from nvfp4_inductor.modules.linear import NVFP4_BUFFERS

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
    if torch.is_grad_enabled():
        warnings.warn("backend='nvfp4' compiled this graph without NVFP4: gradients are enabled. Run "
                      "inference under torch.no_grad() (nvfp4_inductor.compile(model) does), or "
                      "nvfp4_inductor.convert(model) first.", stacklevel=2)
        return _compat.compile_fx(gm, example_inputs, config_patches=patches)
    weights = _weight_inputs(gm, example_inputs)
    if weights:
        return _WeightsAsConstants(gm, example_inputs, weights,
                                   lambda g, inputs: _compile_frozen(g, inputs, config, dict(patches)))
    return _compile_frozen(gm, example_inputs, config, patches)


def _compile_frozen(gm: torch.fx.GraphModule, example_inputs, config: Config, patches: dict):
    """Inductor with freezing and the NVFP4 rewrite, on a graph whose weights are its own
    parameters and buffers (constants)."""
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
    keep.update(experts_pass.experts_keep(config, names, constants))  # 3-D expert weights
    rewrite = LinearToNVFP4(resolve_activation(config.activations, sample.device), names, keep,
                            config.weight_method, config.merge_linears, config.fuse_norms)
    from nvfp4_inductor.lowerings import (  # imports Inductor's lowering machinery: only when compiling
        linear as lowering,
    )

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


# Ops through which a graph input's storage is reached by another name (a mutation of the result
# mutates the input).
_VIEW_METHODS = {"view", "view_as", "reshape", "t", "transpose", "permute", "narrow", "select", "unsqueeze",
                 "squeeze", "expand", "expand_as", "as_strided", "flatten", "unflatten", "split", "chunk",
                 "unbind", "__getitem__", "detach", "contiguous", "movedim", "diagonal", "unfold"}


def _mutated(node: torch.fx.Node) -> bool:
    """Whether the graph writes the tensor a node stands for (or a view of it) in place."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        for user in n.users:
            name = user.target if isinstance(user.target, str) else getattr(user.target, "__name__", "")
            if (user.target is operator.setitem or "out" in user.kwargs
                    or (name.endswith("_") and not name.endswith("__"))):
                return True
            if name in _VIEW_METHODS or user.target is operator.getitem:
                todo.append(user)
    return False


def module_path(placeholder: torch.fx.Node) -> str:
    """The module path of a parameter or buffer input ("layers.0.mlp.up_proj.weight"), read from
    Dynamo's source for it; else the placeholder's name."""
    arg = placeholder.meta.get("grapharg")
    source = getattr(getattr(arg, "source", None), "name", "")
    source = source() if callable(source) else source
    parts = re.findall(r"\._(?:modules|parameters|buffers)\['([^']*)'\]", source or "")
    return ".".join(parts) if parts else placeholder.name


def _weight_inputs(gm: torch.fx.GraphModule, example_inputs) -> dict[int, str]:
    """{input index: module path} of the inputs that are the module's weights, which the graph does
    not write (a KV cache is a buffer it writes: it stays an input): its parameters, its 2-D
    floating-point buffers (a weight may be held in a buffer), and converted layers' NVFP4 buffers.
    Other buffers (rotary tables, masks) stay inputs, as they are without the backend."""
    weights = {}
    sharded = set()
    if "torch.distributed.tensor" in sys.modules:  # (no DTensor can exist before it is imported)

        sharded = sharded_graph_inputs(gm, example_inputs)  # tensor-parallel: stay inputs
    for i, (node, t) in enumerate(zip(gm.graph.find_nodes(op="placeholder"), example_inputs)):
        if not (isinstance(t, torch.Tensor) and _compat.is_module_tensor_input(node, t)) or i in sharded:
            continue
        path = module_path(node)
        weight = (isinstance(t, nn.Parameter) or (t.dim() == 2 and t.is_floating_point())
                  or path.rpartition(".")[2] in NVFP4_BUFFERS)
        if weight and not _mutated(node):
            weights[i] = path
    return weights


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # an inference-mode tensor has no version counter (nor in-place writers outside it)
        return 0


class _WeightsAsConstants:
    """The compiled graph with the module's weight inputs made constants (see the module
    docstring): a graph per set of weight tensors (and their in-place versions) it is called with,
    the first compiled as Dynamo hands it over, any other when first called with it."""

    def __init__(self, gm, example_inputs, weights: dict[int, str], compile_fn):
        self.gm, self.weights, self.compile_fn = gm, weights, compile_fn
        self.rest = [i for i in range(len(example_inputs)) if i not in weights]
        self.refs = [weakref.ref(example_inputs[i]) for i in weights]
        self.versions = [_version(example_inputs[i]) for i in weights]
        self.compiled = self._compile(example_inputs)
        self.others: dict = {}

    def _compile(self, args):
        """The graph with args' weights as its parameters and buffers, compiled for args' others."""
        graph, copies = torch.fx.Graph(), {}
        graph.output(graph.graph_copy(self.gm.graph, copies))
        graph._codegen = self.gm.graph._codegen
        # Dynamo's metadata, which AOT autograd reads to find the static inputs (what CUDA graphs
        # may take by address, and mutate: a static KV cache): each input's source, and the
        # source of each of the module's own tensors
        for old, new in copies.items():
            if hasattr(old, "_dynamo_source"):
                new._dynamo_source = old._dynamo_source
        gm = torch.fx.GraphModule(self.gm, graph)
        gm.meta = dict(self.gm.meta)
        sources = dict(getattr(self.gm, "_param_name_to_source", None) or {})
        paths = dict(gm.meta.get("dynamo_flat_name_to_original_fqn", {}))
        for i, node in enumerate(graph.find_nodes(op="placeholder")):
            if i not in self.weights:
                continue
            sources[node.name] = getattr(node, "_dynamo_source", None)
            t = args[i]
            if isinstance(t, nn.Parameter):
                gm.register_parameter(node.name, t)
            else:
                gm.register_buffer(node.name, t)
            with graph.inserting_before(node):
                constant = graph.get_attr(node.name)
            constant.meta = dict(node.meta)
            node.replace_all_uses_with(constant)
            graph.erase_node(node)
            paths[node.name] = self.weights[i]
        gm.meta["dynamo_flat_name_to_original_fqn"] = paths
        if hasattr(self.gm, "_param_name_to_source") and None not in sources.values():
            gm._param_name_to_source = sources
        gm.recompile()
        return self.compile_fn(gm, [args[i] for i in self.rest])

    def __call__(self, *args):
        rest = [args[i] for i in self.rest]
        if self.compiled is not None:
            if all(ref() is args[i] and _version(args[i]) == v
                   for ref, i, v in zip(self.refs, self.weights, self.versions)):
                return self.compiled(*rest)
            if all(ref() is args[i] for ref, i in zip(self.refs, self.weights)):
                self.compiled = None  # its weights were changed in place: its constants are of no use
        # other weights: compiled for them (and for these shapes: outside Dynamo's trace, the graph
        # is specialized to the inputs it is compiled with)
        key = (tuple((id(args[i]), _version(args[i])) for i in self.weights),
               tuple((tuple(a.shape), a.stride(), a.dtype, a.device) if isinstance(a, torch.Tensor) else a
                     for a in rest))
        refs, compiled = self.others.get(key, ((), None))
        if compiled is None or not all(ref() is args[i] for ref, i in zip(refs, self.weights)):
            ids = key[0]
            for k in [k for k in self.others if [w for w, _ in k[0]] == [w for w, _ in ids]]:
                del self.others[k]  # the same tensors modified since (or ids reused): of no use
            refs = [weakref.ref(args[i]) for i in self.weights]
            compiled = self._compile(args)
            self.others[key] = (refs, compiled)
        return compiled(*rest)


def compile(model, config: Config | None = None, *, mode=None, options=None, **compile_kwargs):
    """torch.compile(model, backend="nvfp4") for inference: every call runs under torch.no_grad(),
    so the weights are quantized once, at compile time. The Config comes as config, or as
    options["nvfp4"] (what torch.compile(backend="nvfp4", options=...) takes), not both."""
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
        with torch.no_grad():
            return compiled(*args, **kwargs)

    run.compiled = compiled
    return run


def sharded_graph_inputs(gm: torch.fx.GraphModule, example_inputs) -> set[int]:
    """backend="nvfp4": the indices of a Dynamo graph's DTensor inputs (tensors of a model sharded
    by a tensor-parallel plan), which stay graph inputs, compiled as torch.compile compiles them
    (a vocabulary-parallel embedding, ...). A linear's sharded bf16 weight is refused: the rewrite
    quantizes each constant weight on its own, so a rank's share would get the global scale of its
    share, not the whole weight's (nv.convert of the sharded model quantizes each share with the
    whole weight's global scale, after an all-reduce of the amax)."""
    from torch.distributed.tensor import DTensor  # (imported already: the caller checks sys.modules)

    linear_ops = {torch._C._nn.linear, torch.nn.functional.linear}
    found = set()
    for i, (node, t) in enumerate(zip(gm.graph.find_nodes(op="placeholder"), example_inputs)):
        if not isinstance(t, DTensor):
            continue
        found.add(i)
        if any(p.is_shard() for p in t.placements) and any(
                user.op == "call_function" and user.target in linear_ops
                and (user.args[1:2] == (node,) or user.kwargs.get("weight") is node) for user in node.users):
            raise ValueError(
                f"backend='nvfp4': the linear weight {module_path(node)!r} is sharded by a tensor-parallel plan "
                f"(a DTensor, {tuple(t.placements)}); compiled as it is, each rank would quantize its share with a "
                "global scale of its own. Convert the sharded model first (nvfp4_inductor.convert: each share "
                "quantized with the whole weight's global scale), then compile it (docs/parallel.md)")
    return found
