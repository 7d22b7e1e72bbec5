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


# NVFP4's error on tiny random models, relative to the largest bf16 logit (W4A16)
LOGIT_TOL = 0.25


def close(got, want, tol: float = LOGIT_TOL):
    """-> (whether got is within tol * max |want| of want everywhere, the largest error)."""
    err = (got.float() - want.float()).abs().max().item()
    return err <= tol * want.float().abs().max().item(), err


# Tiny random mixture-of-experts configs (top-2): Qwen3-MoE with 8 experts, Mixtral with 4.
MOE_SHAPES = dict(vocab_size=320, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64)
MOE_ARCHITECTURES = ("qwen3_moe", "mixtral")


def moe_model(arch: str, impl: str, layers: int, seed: int = 0, **kw):
    """A tiny random MoE model of MOE_ARCHITECTURES (bf16, eval) with `layers` layers whose experts
    run experts_implementation impl; kw: further config fields."""
    import transformers

    torch.manual_seed(seed)
    fields = {**MOE_SHAPES, "num_hidden_layers": layers, "num_experts_per_tok": 2, "experts_implementation": impl}
    if arch == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**{**fields, "intermediate_size": 128, "moe_intermediate_size": 32,
                                                "num_experts": 8, **kw})
        model = transformers.Qwen3MoeForCausalLM(config)
    elif arch == "mixtral":
        config = transformers.MixtralConfig(**{**fields, "intermediate_size": 48, "num_local_experts": 4, **kw})
        model = transformers.MixtralForCausalLM(config)
    elif arch == "phimoe":  # (checkpoint names: transformers renames its router too)
        config = transformers.PhimoeConfig(**{**fields, "intermediate_size": 48, "num_local_experts": 4, **kw})
        model = transformers.PhimoeForCausalLM(config)
    else:
        raise ValueError(f"arch must be one of {MOE_ARCHITECTURES} or 'phimoe'; got {arch!r}")
    return model.to(torch.bfloat16).eval()
