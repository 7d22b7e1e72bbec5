"""The graph rewrite behind backend="nvfp4": BF16 linears -> nvfp4:: ops.

Runs as Inductor's joint_custom_post_pass, on the graph AOT autograd made, where (with freezing)
the parameters are the first placeholders. `aten.mm(x, permute(W, [1, 0]))` and
`aten.addmm(b, x, permute(W, [1, 0]))` with W such a parameter become

    data, scale, g = nvfp4.quantize(W, None, False, False)
    data, scale = nvfp4.tile_weight(data, scale)
    y = nvfp4.linear_tiled(x, data, scale, g, b, N, activation)

and freezing's constant folding then runs the quantize and the tiling on the real weights once, at
compile time: the compiled code holds the NVFP4 weights as frozen constants, in the layout the
skinny decode GEMM reads fastest (nvfp4_inductor/tiled.py), and calls only nvfp4.linear_tiled.
A model converted by nv.convert arrives with `nvfp4.linear(x, W_data, W_scale, ...)` on constant
NVFP4 buffers; those calls get the same tile_weight + linear_tiled (plain scale layout only).
With a weight method other than "rtn" (Config.weight_method "mse") the quantize is
`nvfp4.quantize_weight(W, None, method, None, False)`, folded the same way.
"""

import logging
import operator
from pathlib import Path

import torch
from torch import fx

from . import _checks, _compat
from .format import BLOCK_SIZE

log = logging.getLogger("nvfp4_inductor")
aten = torch.ops.aten
_PACKAGE_FILES = tuple(sorted(str(p) for p in Path(__file__).parent.rglob("*.py")))


def _weight_of(node: fx.Node, params) -> fx.Node | None:
    """permute(W, [1, 0]) with W a parameter placeholder -> W, else None."""
    if not (isinstance(node, fx.Node) and node.op == "call_function"
            and node.target == aten.permute.default and list(node.args[1]) == [1, 0]):
        return None
    weight = node.args[0]
    return weight if weight in params else None


def _skip_reason(weight: fx.Node) -> str | None:
    value = weight.meta.get("val")
    if value is None or value.dim() != 2:
        return "not a 2-D weight"
    if value.dtype not in _checks.FLOAT_DTYPES:
        return f"weight dtype {value.dtype}"
    n, k = value.shape
    if n % BLOCK_SIZE or k % BLOCK_SIZE:
        return f"shape ({n}, {k}) is not a multiple of {BLOCK_SIZE}"
    return None


class LinearToNVFP4(_compat.CustomGraphPass):
    """Rewrites the linears of a frozen inference graph to nvfp4:: ops; counts what it did.

    param_names: the names of the graph's lifted parameters, in order. keep: parameter name ->
    the reason it stays bf16, or None to convert (names it lacks are converted). weight_method:
    "rtn" or "mse" (block scale search; "hessian" needs calibration data the graph lacks)."""

    def __init__(self, activation: str, param_names: list[str], keep: dict | None = None,
                 weight_method: str = "rtn"):
        if weight_method not in ("rtn", "mse"):
            raise ValueError(f'backend="nvfp4" supports weight_method "rtn" and "mse"; got '
                             f"{weight_method!r}")
        self.activation = activation
        self.weight_method = weight_method
        self.param_names = param_names
        self.keep = keep or {}
        self.converted: list[str] = []
        self.retiled: list[str] = []  # weights already NVFP4 (nv.convert), moved to the tiled layout
        self.skipped: dict[str, str] = {}

    def __call__(self, graph: fx.Graph) -> None:
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        if any(n.name.startswith("tangents") for n in placeholders):
            return  # a training graph: left alone
        lifted = placeholders[:len(_compat.params_flat())]
        names = {node: (self.param_names[i] if i < len(self.param_names) else node.name)
                 for i, node in enumerate(lifted)}
        for node in list(graph.nodes):
            if node.op == "call_function" and node.target == torch.ops.nvfp4.linear.default:
                self._retile(graph, node, names)
                continue
            if node.op != "call_function" or node.target not in (aten.mm.default, aten.addmm.default):
                continue
            if node.kwargs:  # addmm with beta / alpha: not a plain linear
                continue
            bias, x, weight_t = (None, *node.args) if node.target == aten.mm.default else node.args
            weight = _weight_of(weight_t, names)
            if weight is None:
                continue
            name = names[weight]
            reason = _skip_reason(weight) or self.keep.get(name)
            if reason is not None:
                self.skipped[name] = reason
                continue
            with graph.inserting_before(node):
                if self.weight_method == "rtn":
                    quantized = graph.call_function(torch.ops.nvfp4.quantize.default,
                                                    (weight, None, False, False))
                else:
                    quantized = graph.call_function(torch.ops.nvfp4.quantize_weight.default,
                                                    (weight, None, self.weight_method, None, False))
                data, scale, g = (graph.call_function(operator.getitem, (quantized, i)) for i in range(3))
                tiled = graph.call_function(torch.ops.nvfp4.tile_weight.default, (data, scale))
                data, scale = (graph.call_function(operator.getitem, (tiled, i)) for i in range(2))
                n = weight.meta["val"].shape[0]
                y = graph.call_function(torch.ops.nvfp4.linear_tiled.default,
                                        (x, data, scale, g, bias, n, self.activation))
            y.meta.update(node.meta)
            node.replace_all_uses_with(y)
            graph.erase_node(node)
            self.converted.append(name)
        graph.eliminate_dead_code()
        log.info("nvfp4: converted %d linear weights, skipped %d %s", len(self.converted),
                 len(self.skipped), self.skipped)
        if self.retiled:
            log.info("nvfp4: %d NVFP4 weights moved to the tiled layout", len(self.retiled))

    def _retile(self, graph: fx.Graph, node: fx.Node, names) -> None:
        """nvfp4.linear on constant NVFP4 weights (a model from nv.convert) -> the same through
        tile_weight + linear_tiled, tiled once by constant folding like the bf16 weights."""
        x, data, scale, g, bias, swizzled, activation = node.args
        if (swizzled or data not in names
                or not (scale in names or (isinstance(scale, fx.Node) and scale.target == aten.view.dtype
                                           and scale.args[0] in names))):
            return
        with graph.inserting_before(node):
            tiled = graph.call_function(torch.ops.nvfp4.tile_weight.default, (data, scale))
            tiled_data, tiled_scale = (graph.call_function(operator.getitem, (tiled, i)) for i in range(2))
            y = graph.call_function(torch.ops.nvfp4.linear_tiled.default,
                                    (x, tiled_data, tiled_scale, g, bias, data.meta["val"].shape[0],
                                     activation))
        y.meta.update(node.meta)
        # the old call's recorded input values would constrain the new call's arguments
        y.meta.pop("eager_input_vals", None)
        node.replace_all_uses_with(y)
        graph.erase_node(node)
        self.retiled.append(names[data])

    def uuid(self) -> bytes:
        """Keys the FX graph cache: the package sources and the options."""
        return _compat.get_hash_for_files(_PACKAGE_FILES) + repr(
            (self.activation, self.param_names, sorted(self.keep.items()), self.weight_method)
        ).encode()
