"""The version-specific Inductor / Dynamo APIs this package uses, in one place (torch 2.11 - 2.13;
each checked on both: see ../shared/INDUCTOR_NOTES.md)."""

import torch

from torch._inductor import list_mode_options  # noqa: F401  ("reduce-overhead" -> cudagraphs)
from torch._inductor.compile_fx import compile_fx  # noqa: F401
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files  # noqa: F401


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


def compile_callback_handler():
    """Dynamo's compilation callback handler (start callbacks run before Dynamo traces a frame,
    end callbacks after its backend compiled), or None where this torch lacks that API."""
    handler = getattr(torch._dynamo, "callback_handler", None)
    if handler is None or not all(hasattr(handler, a) for a in (
            "register_start_callback", "register_end_callback", "start_callbacks")):
        return None
    return handler


def scratch_workspace(device, count: int, dtype: torch.dtype):
    """A workspace of `count` uninitialized elements for one kernel (a template reads it as ws_ptr)."""
    from torch._inductor.codegen.common import WorkspaceArg, WorkspaceZeroMode

    if not hasattr(WorkspaceArg, "name"):
        # The wrapper's memory planning reads `.name` of the last line's buffer; when a graph ends
        # with a template kernel, that is the kernel's workspace, which has get_name() only, and
        # Inductor failed ("'WorkspaceArg' object has no attribute 'name'", 2.13; the graph's
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
