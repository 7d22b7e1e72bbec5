"""The version-specific Inductor / Dynamo APIs this package uses, in one place (torch 2.11 - 2.13;
each checked on both)."""

import contextlib
import importlib
from unittest import mock

import torch
from torch._inductor import list_mode_options  # noqa: F401  ("reduce-overhead" -> cudagraphs)
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files  # noqa: F401

_compile_fx_module = importlib.import_module("torch._inductor.compile_fx")


# What Dynamo leaves on its graph module for AOTAutograd (which inputs are the module's
# parameters and buffers, the compile id; each placeholder's source): AOTAutograd marks those
# inputs static for CUDA graphs.
_DYNAMO_MODULE_ATTRS = ("_param_name_to_source",)


def _keeping_dynamo_metadata(passes):
    """passes (Inductor's pre-grad passes) -> the same, with Dynamo's metadata copied onto the
    graph module they return when that is a new one with the same placeholders."""

    def run(gm, example_inputs):
        out = passes(gm, example_inputs)
        if out is gm or not isinstance(out, torch.fx.GraphModule):
            return out
        old, new = (list(m.graph.find_nodes(op="placeholder")) for m in (gm, out))
        if [n.name for n in old] != [n.name for n in new]:
            return out
        for key, value in gm.meta.items():
            out.meta.setdefault(key, value)
        for name in _DYNAMO_MODULE_ATTRS:
            if hasattr(gm, name) and not hasattr(out, name):
                setattr(out, name, getattr(gm, name))
        for before, after in zip(old, new):
            if hasattr(before, "_dynamo_source") and not hasattr(after, "_dynamo_source"):
                after._dynamo_source = before._dynamo_source
        return out

    return run


def compile_fx(gm, example_inputs, **kwargs):
    """Inductor's compile_fx. On torch 2.11 its pre-grad passes judge a graph with no tensor
    inputs (every input a module buffer, as in a decode step that keeps its token and position in
    buffers) a CPU graph, and with freezing on rebuild it as a new module without Dynamo's
    metadata: AOTAutograd then sees no static inputs, and CUDA graphs are skipped for every
    mutated buffer ("mutated inputs"; torch.compile without freezing, and torch 2.13, which reads
    the metadata before those passes, keep them). For such a graph the rebuilt module gets the
    metadata back; other graphs compile as they did."""
    name = "_recursive_pre_grad_passes"
    passes = getattr(_compile_fx_module, name, None)
    no_tensor_inputs = not any(isinstance(t, torch.Tensor) for t in example_inputs)
    patch = (mock.patch.object(_compile_fx_module, name, _keeping_dynamo_metadata(passes))
             if passes is not None and no_tensor_inputs else contextlib.nullcontext())
    if (kwargs.get("config_patches") or {}).get("freezing"):
        kwargs["inner_compile"] = _with_static_graph_inputs(
            kwargs.get("inner_compile", _compile_fx_module.compile_fx_inner), gm, example_inputs)
    with patch:
        return _compile_fx_module.compile_fx(gm, example_inputs, **kwargs)


def _with_static_graph_inputs(inner_compile, gm, example_inputs):
    """inner_compile, told which of the graph's own inputs are static. Freezing (torch 2.11 - 2.13,
    torch/_inductor/freezing.py: replace_params_with_constants) renumbers the static input
    indices of the parameters it keeps and drops those of every other input, so an input Dynamo
    marked static (mark_static_address: a Hugging Face static KV cache) that the graph writes
    counts as a mutated, non-static input, and CUDA graphs are skipped for the whole graph.
    Freezing keeps every graph input, in order, as the last inputs of the frozen graph: their
    static positions are added back there."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    static = [i for i, node in enumerate(placeholders)
              if node.meta.get("tensor_dict", {}).get("_dynamo_static_input_type")]
    if not static or len(placeholders) != len(example_inputs):
        return inner_compile

    def compile_inner(graph, inputs, **kwargs):
        first = len(inputs) - len(example_inputs)
        tail = inputs[first:] if first >= 0 else ()
        # the graph's inputs where expected (no effect tokens or unwrapped subclasses in between)
        if len(tail) == len(example_inputs) and all(
                not isinstance(a, torch.Tensor) or (isinstance(b, torch.Tensor) and a.shape == b.shape)
                for a, b in zip(tail, example_inputs)):
            given = list(kwargs.get("static_input_idxs") or ())
            kwargs["static_input_idxs"] = sorted({*given, *(first + i for i in static)})
        return inner_compile(graph, inputs, **kwargs)

    return compile_inner


def params_flat():
    """The parameters AOT autograd lifted as the graph's first inputs (with freezing), or ()."""
    context = torch._guards.TracingContext.try_get()
    if context is None or context.params_flat is None:
        return ()
    return context.params_flat


def max_autotune() -> bool:
    """Whether Inductor autotunes GEMM choices (mode="max-autotune")."""
    from torch._inductor import config

    return bool(config.max_autotune or config.max_autotune_gemm)


def selected_node(result):
    """autotune_select_algorithm's result -> the chosen node (a TensorBox on 2.11; 2.13 returns
    (node, choice))."""
    return result[0] if isinstance(result, tuple) else result


def scratch_workspace(device, count: int, dtype: torch.dtype):
    """A workspace of `count` uninitialized elements for one kernel (a template reads it as ws_ptr)."""
    from torch._inductor.codegen.common import WorkspaceArg, WorkspaceZeroMode

    if not hasattr(WorkspaceArg, "name"):
        # The wrapper's memory planning reads `.name` of the last line's buffer; when a graph ends
        # with a template kernel, that is the kernel's workspace, which has get_name() only, and
        # Inductor fails ("'WorkspaceArg' object has no attribute 'name'", 2.13; the graph's
        # output straight from the template). The same name, under the attribute it reads.
        WorkspaceArg.name = property(WorkspaceArg.get_name)

    return WorkspaceArg(count=count, zero_mode=WorkspaceZeroMode.UNINITIALIZED, device=device,
                        outer_name=WorkspaceArg.unique_name(), dtype=dtype)


def pdl_option() -> str | None:
    """Inductor's option for programmatic dependent launch, or None where this torch lacks it."""
    from torch._inductor import config

    return "triton.enable_pdl" if hasattr(config.triton, "enable_pdl") else None


def pdl_enabled() -> bool:
    """Whether Inductor emits programmatic dependent launch (its kernels wait for the kernel
    before them where they read its outputs, and let the next one launch after their loads)."""
    from torch._inductor import config

    return bool(getattr(config.triton, "enable_pdl", False))


def template_launch_options() -> bool:
    """Whether TritonTemplate.generate takes triton_meta (launch options such as launch_pdl)."""
    import inspect

    from torch._inductor.select_algorithm import TritonTemplate

    return "triton_meta" in inspect.signature(TritonTemplate.generate).parameters


def is_module_tensor_input(placeholder, example) -> bool:
    """Whether a graph input is one of the module's parameters or buffers that Dynamo lifted (as it
    does while freezing is off): Parameters arrive as such; buffers as plain tensors, whose
    placeholder Dynamo marks a static input ("_dynamo_static_input_type" in its tensor_dict,
    torch 2.11 and 2.13; so are inputs a user marks with mark_static_address)."""
    if isinstance(example, torch.nn.Parameter):
        return True
    return (isinstance(example, torch.Tensor)
            and "_dynamo_static_input_type" in placeholder.meta.get("tensor_dict", {}))


def inductor_config_defaults() -> dict:
    """Inductor's config options and their current values (what options= may set; torch.compile's
    Inductor wrapper checks its options against the same copy)."""
    from torch._inductor import config

    return config.get_config_copy()
