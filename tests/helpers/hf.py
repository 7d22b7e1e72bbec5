"""Shared by the Hugging Face transformers tests of the backend."""

import re

import torch
from torch._inductor.utils import run_and_get_code


def nvfp4_ops(code: list[str]) -> list[str]:
    """The nvfp4:: ops the compiled code calls (sorted; comments and asserts left out)."""
    return sorted(re.findall(r"torch\.ops\.nvfp4\.(\w+)\.default\(", "\n".join(
        line for line in "\n".join(code).splitlines() if not line.strip().startswith(("#", "assert")))))


def compiled_generate(model, ids, new_tokens: int, mode: str | None = None):
    """Greedy generate with a static cache and CompileConfig(backend="nvfp4", mode) on a fresh
    Dynamo -> (tokens, the compiled code, CUDA-graph skips it added)."""
    import transformers
    from torch._dynamo.utils import counters

    config = transformers.CompileConfig(backend="nvfp4", mode=mode)
    config._compile_all_devices = True  # transformers compiles on accelerators only unless told
    torch._dynamo.reset()
    skips = counters["inductor"]["cudagraph_skips"]
    out, code = run_and_get_code(lambda: model.generate(
        ids, max_new_tokens=new_tokens, do_sample=False, cache_implementation="static", compile_config=config))
    return out, code, counters["inductor"]["cudagraph_skips"] - skips
