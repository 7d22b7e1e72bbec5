"""NVFP4 mixture-of-experts layers: `NVFP4Experts` replaces a transformers 5.x experts module
(gate_up_proj (E, 2I, H), down_proj (E, H, I), forward(hidden_states, top_k_index,
top_k_weights)), running the grouped ops of ops/grouped.py; `convert_experts` swaps every such
module of a model.
"""

import torch
from torch import Tensor, nn

from nvfp4_inductor import checks
from nvfp4_inductor.config import check_activations, Config, resolve_activation
from nvfp4_inductor.format import BLOCK_SIZE
from nvfp4_inductor.modules import hf_names
from nvfp4_inductor.modules.common import (
    apply_keeping_buffer_dtypes, checked_bits, checked_global_scale, replace_module,
)
from nvfp4_inductor.ops.grouped import quantize_experts
from nvfp4_inductor.reference import tiled

__all__ = ["NVFP4Experts", "convert_experts", "experts_to_convert", "is_experts", "cannot_convert",
           "convert_experts_for_report"]

_E4M3 = torch.float8_e4m3fn

# (buffer attribute prefix, NVFP4 parts) of the two weights
_WEIGHTS = ("gate_up", "down")
_PARTS = ("weight", "weight_scale", "weight_scale_2")


class NVFP4Experts(nn.Module):
    """A transformers experts module with its weights in NVFP4: forward(hidden_states (T, H),
    top_k_index (T, k), top_k_weights (T, k)) -> (T, H), as the module it replaces, whatever its
    experts_implementation. gate_up (E, 2I, H) runs as nvfp4::grouped_linear_tiled_silu_mul, down
    (E, H, I) as nvfp4::grouped_linear_tiled; each expert's gate and up share one global scale.

    The constructor takes each weight's codes (E, N, K/2) uint8, e4m3 scales (E, N, K/16) and
    global scales (E,) fp32. Buffers: gate_up_weight uint8 and gate_up_weight_scale e4m3, the
    codes and scales laid out by tiled.tile_experts (gated), gate_up_weight_scale_2 fp32 (E,), and
    down_* likewise (not gated). The state dict holds them per expert
    under ModelOpt's names: "{e}.{gate}.weight" (I, H/2), ".weight_scale" (I, H/16),
    ".weight_scale_2" () (the same value for gate and up), "{e}.{up}.*", "{e}.{down}.*", with
    (gate, up, down) = checkpoint_names ("gate_proj", "up_proj", "down_proj", or the model's
    original names: Mixtral's "w1", "w3", "w2"). Expert ids outside [0, E) in top_k_index
    contribute nothing (ids >= E are transformers' expert-parallel sentinels; a negative id would
    otherwise be counted in expert 0's group, and checking the ids would read them back).
    """

    def __init__(self, gate_up: tuple[Tensor, Tensor, Tensor], down: tuple[Tensor, Tensor, Tensor],
                 activations: str = "auto", checkpoint_names: tuple[str, str, str] = hf_names.DEFAULT_EXPERT_NAMES):
        super().__init__()
        check_activations(activations)
        for name, (data, scale, g) in zip(_WEIGHTS, (gate_up, down)):
            checks.check_tensor(f"{name} codes", data, (torch.uint8,))
            checks.check_tensor(f"{name} scales", scale, (_E4M3,))
            checks.check_tensor(f"{name} global scales", g, (torch.float32,))
            if data.dim() != 3 or tuple(scale.shape) != (*data.shape[:2], data.shape[2] * 2 // BLOCK_SIZE) \
                    or tuple(g.shape) != (data.shape[0],):
                raise ValueError(f"{name}: codes (E, N, K/2), scales (E, N, K/16) and global scales (E,) "
                                 f"expected; got {tuple(data.shape)}, {tuple(scale.shape)}, {tuple(g.shape)}")
        e, two_i, h_half = gate_up[0].shape
        if tuple(down[0].shape) != (e, h_half * 2, two_i // 4) or two_i % 2:
            raise ValueError(f"down codes must be (E, H, I/2) = {(e, h_half * 2, two_i // 4)} for gate_up "
                             f"codes {tuple(gate_up[0].shape)} (E, 2I, H/2); got {tuple(down[0].shape)}")
        self.num_experts, self.hidden_dim, self.intermediate_dim = e, h_half * 2, two_i // 2
        self.activations = activations
        self.checkpoint_names = tuple(checkpoint_names)
        for name, (data, scale, g) in zip(_WEIGHTS, (gate_up, down)):
            codes, scales = tiled.tile_experts(data, scale.view(torch.uint8), name == "gate_up")
            # not persistent: the state dict holds them per expert (_save_to_state_dict)
            for part, t in zip(_PARTS, (codes, scales.view(_E4M3), g.contiguous())):
                self.register_buffer(f"{name}_{part}", t, persistent=False)

    @classmethod
    def from_experts(cls, experts: nn.Module, activations: str = "auto", method: str = "rtn",
                     checkpoint_names: tuple[str, str, str] = hf_names.DEFAULT_EXPERT_NAMES) -> "NVFP4Experts":
        """Quantize a transformers experts module's gate_up_proj (E, 2I, H) and down_proj
        (E, H, I), each expert as one tensor; checkpoint_names as NVFP4Experts takes them
        (convert_experts passes the model's original ones). Raises ValueError for a module
        NVFP4Experts cannot stand for (its forward is silu(gate) * up without biases: another
        activation or a bias would be dropped silently)."""
        check_activations(activations)
        reason = cannot_convert(experts) if is_experts(experts) else "it holds no 3-D gate_up_proj and down_proj"
        if reason is not None:
            raise ValueError(f"NVFP4Experts.from_experts: cannot convert {type(experts).__name__}: {reason}")
        with torch.no_grad():
            gate_up = quantize_experts(experts.gate_up_proj.detach(), method)
            down = quantize_experts(experts.down_proj.detach(), method)
        return cls(gate_up, down, activations, checkpoint_names)

    def _nvfp4(self, name: str) -> tuple[Tensor, Tensor, Tensor]:
        return (getattr(self, f"{name}_weight"), getattr(self, f"{name}_weight_scale").view(torch.uint8),
                getattr(self, f"{name}_weight_scale_2"))

    def _shape(self, name: str) -> tuple[int, int]:
        """(N, K) of the gate_up or down weight of an expert."""
        h, i = self.hidden_dim, self.intermediate_dim
        return (2 * i, h) if name == "gate_up" else (h, i)

    def _row_major(self, name: str) -> tuple[Tensor, Tensor]:
        """A weight's codes (E, N, K/2) uint8 and e4m3 scales (E, N, K/16) in the logical order."""
        data, scale, _ = self._nvfp4(name)
        data, scale = tiled.untile_experts(data, scale, *self._shape(name), name == "gate_up")
        return data, scale.view(_E4M3)

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        """hidden_states (T, H), top_k_index (T, k) expert ids, top_k_weights (T, k) -> (T, H) in
        hidden_states' dtype: sum over k of weight * expert(x). Sorting and offsets stay on the
        device (no host sync)."""
        if hidden_states.dim() != 2 or hidden_states.shape[1] != self.hidden_dim:
            raise ValueError(f"hidden_states must be (tokens, hidden_dim = {self.hidden_dim}); got shape "
                             f"{tuple(hidden_states.shape)}")
        t, h = hidden_states.shape
        if top_k_index.dim() != 2 or top_k_index.shape[0] != t or top_k_weights.shape != top_k_index.shape:
            raise ValueError(f"top_k_index and top_k_weights must be (tokens = {t}, top-k) alike; got shapes "
                             f"{tuple(top_k_index.shape)} and {tuple(top_k_weights.shape)}")
        k = top_k_index.shape[-1]
        # negative ids sorted past the experts' groups, with the sentinels
        expert_ids = top_k_index.reshape(-1)
        expert_ids = expert_ids.masked_fill(expert_ids < 0, self.num_experts)
        ids_sorted, perm = torch.sort(expert_ids, stable=True)
        x = hidden_states[perm // k]
        experts = torch.arange(self.num_experts, dtype=ids_sorted.dtype, device=ids_sorted.device)
        offsets = torch.searchsorted(ids_sorted, experts, right=True, out_int32=True)
        activation = resolve_activation(self.activations, hidden_states.device)
        gated = torch.ops.nvfp4.grouped_linear_tiled_silu_mul(x, offsets, *self._nvfp4("gate_up"), None,
                                                              2 * self.intermediate_dim, activation)
        y = torch.ops.nvfp4.grouped_linear_tiled(gated, offsets, *self._nvfp4("down"), None, self.hidden_dim,
                                                 activation)
        weighted = y * top_k_weights.reshape(-1)[perm].unsqueeze(-1)
        unsorted = torch.empty_like(weighted)
        unsorted[perm] = weighted
        # as transformers' grouped_mm form: weighted rows in the product's dtype, summed over k
        # (deterministic; index_add_ with repeated indices is not, on CUDA)
        return unsorted.view(t, k, h).sum(dim=1).to(hidden_states.dtype)

    def _apply(self, fn, recurse=True):
        """Module casts move the NVFP4 buffers to fn's device but keep their dtypes (`.half()`
        would otherwise turn the e4m3 scales into fp16 and round the fp32 global scales)."""
        return apply_keeping_buffer_dtypes(self, super()._apply, fn, recurse, list(self._buffers))

    def _checkpoint_keys(self):
        """-> [(checkpoint key suffix, buffer name, expert, row slice)] in state dict order."""
        gate, up, down = self.checkpoint_names
        i = self.intermediate_dim
        keys = []
        for e in range(self.num_experts):
            for proj, name, rows in ((gate, "gate_up", slice(0, i)), (up, "gate_up", slice(i, 2 * i)),
                                     (down, "down", slice(None))):
                for part in _PARTS:
                    keys.append((f"{e}.{proj}.{part}", f"{name}_{part}", e, rows))
        return keys

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        parts = self._logical_parts()
        for key, buffer, e, rows in self._checkpoint_keys():
            t = parts[buffer][e]
            # copies, not views of the fused buffers: safetensors refuses tensors sharing storage
            destination[prefix + key] = (t if buffer.endswith("scale_2") else t[rows]).clone()

    def _logical_parts(self) -> dict:
        """buffer name -> the buffer in the logical row order (the codes and scales untiled)."""
        parts = {}
        for name in _WEIGHTS:
            data, scale = self._row_major(name)
            parts.update({f"{name}_weight": data, f"{name}_weight_scale": scale,
                          f"{name}_weight_scale_2": getattr(self, f"{name}_weight_scale_2")})
        return parts

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        expected = self._checkpoint_keys()
        parts = self._logical_parts()
        loaded = {}
        for key, buffer, e, rows in expected:
            full = prefix + key
            if full not in state_dict:
                missing_keys.append(full)
                continue
            value = state_dict[full]
            target = parts[buffer][e]
            try:
                if buffer.endswith("scale_2"):
                    value = checked_global_scale(full, value).reshape(())
                elif buffer.endswith("weight_scale"):
                    value = checked_bits(full, value, (_E4M3, torch.uint8), _E4M3)
                else:
                    value = checked_bits(full, value, (torch.uint8, torch.int8), torch.uint8)
                shape = tuple(target.shape) if buffer.endswith("scale_2") else tuple(target[rows].shape)
                if tuple(value.shape) != shape:
                    raise ValueError(f"{full} must have shape {shape}; got {tuple(value.shape)}")
            except (TypeError, ValueError) as error:
                error_msgs.append(str(error))
                continue
            loaded[(buffer, e, key.split(".")[1] if buffer.endswith("scale_2") else rows.start)] = value
        gate, up, _ = self.checkpoint_names
        for e in range(self.num_experts):  # one global scale per expert's gate_up
            g_gate, g_up = (loaded.get(("gate_up_weight_scale_2", e, proj)) for proj in (gate, up))
            if g_gate is not None and g_up is not None and not torch.equal(g_gate.cpu(), g_up.cpu()):
                error_msgs.append(f"{prefix}{e}.{gate}.weight_scale_2 ({g_gate.item()}) and {prefix}{e}.{up}"
                                  f".weight_scale_2 ({g_up.item()}) differ: NVFP4Experts holds one global "
                                  "scale per expert for gate and up (as ModelOpt exports a fused group)")
        if error_msgs:
            return
        with torch.no_grad():
            for key, buffer, e, rows in expected:
                tag = key.split(".")[1] if buffer.endswith("scale_2") else rows.start
                value = loaded.get((buffer, e, tag))
                if value is None:
                    continue
                target = parts[buffer][e]
                (target if buffer.endswith("scale_2") else target[rows]).copy_(value)
            for name in _WEIGHTS:  # the codes and scales laid out again
                codes, scales = tiled.tile_experts(parts[f"{name}_weight"],
                                                   parts[f"{name}_weight_scale"].view(torch.uint8), name == "gate_up")
                getattr(self, f"{name}_weight").copy_(codes)
                getattr(self, f"{name}_weight_scale").view(torch.uint8).copy_(scales)
        if strict:
            known = {prefix + key for key, *_ in expected}
            unexpected_keys += [key for key in state_dict if key.startswith(prefix) and key not in known]

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, "
                f"intermediate_dim={self.intermediate_dim}, activations={self.activations}")


# --- conversion ---------------------------------------------------------------------------------

def is_experts(module: nn.Module) -> bool:
    """A module that holds experts as 3-D gate_up_proj / up_proj and down_proj tensors."""
    down = getattr(module, "down_proj", None)
    up = getattr(module, "gate_up_proj", getattr(module, "up_proj", None))
    return (not isinstance(module, NVFP4Experts) and isinstance(down, Tensor) and isinstance(up, Tensor)
            and down.dim() == 3 and up.dim() == 3)


def _is_silu(act) -> bool:
    return (isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"
            or act is torch.nn.functional.silu)


def cannot_convert(module: nn.Module) -> str | None:
    """Why an experts module (is_experts) cannot become an NVFP4Experts, or None."""
    if not hasattr(module, "is_transposed"):
        return (f"{type(module).__name__} is not a transformers experts class "
                "(@use_experts_implementation): its layout and forward are unknown")
    flags = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
             "has_post_expert_norm": False, "_is_expert_parallel": False}
    for flag, supported in flags.items():
        if getattr(module, flag, supported) != supported:
            return f"{flag}={getattr(module, flag)} is not supported (NVFP4Experts needs {flag}={supported})"
    try:
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:
        _default_apply_gate = None
    apply_gate = getattr(type(module), "_apply_gate", _default_apply_gate)
    if apply_gate is not _default_apply_gate:
        return f"{type(module).__name__} has its own _apply_gate (not silu(gate) * up)"
    if not _is_silu(getattr(module, "act_fn", None)):
        act = getattr(module, "act_fn", None)
        return f"its activation {getattr(act, '__name__', type(act).__name__)} is not SiLU"
    gate_up, down = module.gate_up_proj, module.down_proj
    for name, w in (("gate_up_proj", gate_up), ("down_proj", down)):
        if w.dtype not in checks.FLOAT_DTYPES:
            return f"{name} has dtype {w.dtype}, not a float format NVFP4 converts"
    e, two_i, h = gate_up.shape
    if tuple(down.shape) != (e, h, two_i // 2) or two_i % 2:
        return (f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} are not "
                "(E, 2I, H) and (E, H, I)")
    if h % BLOCK_SIZE or (two_i // 2) % BLOCK_SIZE or not h or not two_i:
        return (f"hidden size {h} and expert intermediate size {two_i // 2} must be positive multiples of "
                f"{BLOCK_SIZE} (one e4m3 scale per {BLOCK_SIZE} elements along K)")
    return None


def convert_experts(model: nn.Module, config: Config | None = None) -> list[str]:
    """Replace, in place, every transformers experts module of model (3-D gate_up_proj (E, 2I, H)
    and down_proj (E, H, I), silu(gate) * up) by an NVFP4Experts; returns the names replaced.

    Raises ValueError, before anything is replaced, for an experts module it cannot convert
    (non-gated or biased experts, another activation, a transposed layout, dims not multiples of
    16, ...). Config.include (name, module) selects modules as for linears; weight_method "rtn"
    and "mse" apply per expert ("hessian" has no calibration for experts: refused). W4A4 experts
    quantize x per expert group with a dynamic global scale (Config.input_scales are for linears).
    nvfp4_inductor.convert converts experts too, reporting those it cannot convert as skipped.
    """
    config = _checked_config(model, config)
    targets, refused = experts_to_convert(model, config)
    if refused:
        lines = "\n".join(f"  {name}: {reason}" for name, reason in refused.items())
        raise ValueError(f"convert_experts cannot convert {len(refused)} experts module(s):\n{lines}")
    return _convert_targets(model, config, targets)


def _checked_config(model, config) -> Config:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    config = config or Config()
    if not isinstance(config, Config):
        raise TypeError(f"config must be an nvfp4_inductor.Config; got {type(config).__name__}")
    return config


def experts_to_convert(model: nn.Module, config: Config):
    """-> ([(names, module)] to convert, {name: why not} for those that cannot be)."""
    paths: dict[int, list[str]] = {}
    modules: dict[int, nn.Module] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if is_experts(module):
            paths.setdefault(id(module), []).append(name)
            modules[id(module)] = module
    targets, refused = [], {}
    for key, module in modules.items():
        names = paths[key]
        if config.include is not None and not all(config.include(n, module) for n in names):
            continue
        reason = cannot_convert(module)
        if reason is None and "" in names:
            reason = "the model itself: use NVFP4Experts.from_experts(model)"
        if reason is None and config.weight_method == "hessian":
            reason = ('weight_method="hessian" has no calibration Hessians for expert weights; use "rtn" '
                      'or "mse" for models with experts')
        if reason is not None:
            refused[names[0]] = reason
        else:
            targets.append((names, module))
    return targets, refused


def _convert_targets(model: nn.Module, config: Config, targets) -> list[str]:
    converted = []
    checkpoint_names = hf_names.expert_namer(model)  # (ModelOpt exports the original per-expert names)
    for names, module in targets:
        replacement = NVFP4Experts.from_experts(module, config.activations, config.weight_method,
                                                checkpoint_names(names[0]))
        for name in names:
            replace_module(model, name, module, replacement)
        converted += names
    return converted


def convert_experts_for_report(model: nn.Module, config: Config) -> tuple[list[str], int, dict[str, str]]:
    """nvfp4_inductor.convert's part: -> (names converted, modules converted, {name: why not})."""
    targets, refused = experts_to_convert(model, config)
    return _convert_targets(model, config, targets), len(targets), refused
