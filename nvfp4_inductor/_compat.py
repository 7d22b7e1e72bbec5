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
