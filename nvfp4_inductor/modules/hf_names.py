"""A transformers model's original checkpoint names, the one place that reads transformers'
conversion mapping (`transformers.conversion_mapping`, `transformers.core_model_loading`).

transformers 5 loads some models' checkpoints under other module names than the files hold
(Mixtral's, PhiMoE's and MiniMax's `block_sparse_moe` is `mlp` in the model) and merges the
per-expert linears of the files into 3-D experts (Mixtral's `experts.{e}.w1` / `w3` / `w2` into
`gate_up_proj` and `down_proj`), following that mapping. NVFP4 checkpoints (ModelOpt exports,
llmcompressor's) keep the original names: load_checkpoint renames their keys to the model's and
save_checkpoint renames back, as transformers' own loading and `save_pretrained` do.
"""

import re

from torch import nn

# an experts module's per-expert (gate, up, down) names where the mapping names none
DEFAULT_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


def _transforms(model: nn.Module, legacy: bool) -> tuple[list, list]:
    """-> (key renamings, weight converters) transformers applies to model's checkpoints ([] and []
    for a model that is not a transformers PreTrainedModel). legacy: also the old renamings
    (LayerNorm.gamma -> .weight, ...) it applies when loading but not when saving."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange, WeightConverter, WeightRenaming
    except ImportError:  # (transformers 4 renames nothing of the models whose experts are 3-D)
        return [], []
    if not isinstance(model, PreTrainedModel):
        return [], []
    transforms = get_model_conversion_mapping(model, add_legacy=legacy)
    # prefix changes (a base model's prefix added or dropped) depend on the file: transformers
    # drops them too when saving a model it did not load
    renamings = [t for t in transforms if isinstance(t, WeightRenaming) and not isinstance(t, PrefixChange)]
    return renamings, [t for t in transforms if isinstance(t, WeightConverter)]


def key_renamer(model: nn.Module, to_checkpoint: bool):
    """-> rename(key): a checkpoint's key to model's state-dict key, or (to_checkpoint) back."""
    renamings, _ = _transforms(model, legacy=not to_checkpoint)
    if not renamings:
        return lambda key: key
    from transformers.core_model_loading import rename_source_key

    if to_checkpoint:
        reverse = [t.reverse_transform() for t in renamings[::-1]]
        return lambda key: rename_source_key(key, reverse, [], reverse=True)[0]
    return lambda key: rename_source_key(key, renamings, [])[0]


def module_renamer(model: nn.Module, to_checkpoint: bool):
    """-> rename(module name), as key_renamer renames the module's ".weight"."""
    rename = key_renamer(model, to_checkpoint)
    return lambda name: rename(f"{name}.weight").removesuffix(".weight")


def either_name(model: nn.Module, matches):
    """-> matches(name) or matches(the files' name of model's module `name`): a checkpoint config's
    module names (exclude lists) are the files' own, or the model's in older exports."""
    original = module_renamer(model, to_checkpoint=True)
    return lambda name: matches(name) or matches(original(name))


def _unescaped(pattern: str) -> str:
    return pattern.replace("\\", "")


def expert_namer(model: nn.Module):
    """-> names(experts): (gate, up, down), the per-expert linears' names under which the
    checkpoints of model hold the experts module at path `experts` (model's name), read from the
    converter transformers merges them with (experts.*.<gate>.weight and experts.*.<up>.weight
    concatenated into gate_up_proj, experts.*.<down>.weight stacked into down_proj);
    DEFAULT_EXPERT_NAMES where it has none."""
    candidates = []  # (the target's module path, the projection, the per-expert names)
    for converter in _transforms(model, legacy=False)[1]:
        # (the patterns as written in the mapping: the compiled ones differ between versions)
        targets = [_unescaped(t) for t in getattr(converter, "_original_target_patterns", [])]
        sources = [re.search(r"experts\.\*\.(\w+)\.weight$", _unescaped(s))
                   for s in getattr(converter, "_original_source_patterns", [])]
        operations = [type(op).__name__ for op in getattr(converter, "operations", [])]
        if len(targets) != 1 or not all(sources):
            continue
        for proj, ops, count in (("gate_up_proj", ["MergeModulelist", "Concatenate"], 2),
                                 ("down_proj", ["MergeModulelist"], 1)):
            target = targets[0].lstrip(".")
            if target.endswith(f"experts.{proj}") and operations == ops and len(sources) == count:
                candidates.append((target, proj, [s.group(1) for s in sources]))

    def names(experts: str) -> tuple[str, str, str]:
        found = {proj: per_expert for target, proj, per_expert in candidates if f"{experts}.{proj}".endswith(target)}
        if set(found) != {"gate_up_proj", "down_proj"}:
            return DEFAULT_EXPERT_NAMES
        return (*found["gate_up_proj"], *found["down_proj"])

    return names
