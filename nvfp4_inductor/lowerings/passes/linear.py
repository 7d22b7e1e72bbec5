"""The graph rewrite behind backend="nvfp4": BF16 linears -> nvfp4:: ops.

Runs as Inductor's joint_custom_post_pass, on the graph AOT autograd made, where (with freezing)
the parameters are the first placeholders. `aten.mm(x, permute(W, [1, 0]))` and
`aten.addmm(b, x, permute(W, [1, 0]))` with W such a parameter become

    data, scale, g = nvfp4.quantize(W, None, False, False)
    data, scale = nvfp4.tile_weight(data, scale)
    y = nvfp4.linear_tiled(x, data, scale, g, b, N, activation)

and freezing's constant folding then runs the quantize and the tiling on the real weights once, at
compile time: the compiled code holds the NVFP4 weights as frozen constants, in the layout the
skinny decode GEMM reads fastest (nvfp4_inductor/reference/tiled.py), and calls only nvfp4.linear_tiled.
A model converted by nv.convert arrives with `nvfp4.linear_tiled(x, W_data, W_scale, ...)` on
constant tiled NVFP4 buffers (and `nv.linear` in a model with `nvfp4.linear` on plain ones, which
get the same tile_weight + linear_tiled); those merge and fuse as below like bf16 weights (with
their own global scales and activation format), a tiled weight through untile_weight, folded too.
With a weight method other than "rtn" (Config.weight_method "mse") the quantize is
`nvfp4.quantize_weight(W, None, method, None, False)`, folded the same way.

Linears that read the same x (a decoder's q / k / v projections, an MLP's gate and up) become one
GEMM when x has at most MERGE_MAX_M rows (decode; Config.merge_linears): each weight is quantized
on its own (its own global scale), the codes and scales are concatenated along N before tiling
(every N a multiple of TILE_N, so the tiles simply follow each other), the global scales become
one per output row, and each original output is a slice of the merged one (a contiguous copy of
it where the graph returns it, as eager returns a tensor of its own):

    y = nvfp4.linear_tiled(x, cat(data_i), cat(scale_i), cat(expand(g_i, N_i)), cat(b_i), sum N_i, a)
    y_i = y[..., offset_i : offset_i + N_i]

The numbers per output row are those of the unmerged linear; one launch streams all the weights
(separately, the small GEMMs are latency-bound: docs/backend.md).

A gated MLP's F.silu(gate) * up on a merged bias-less gate / up pair becomes
nvfp4.linear_tiled_silu_mul: the same weights, rows interleaved by 32 (tiled.interleave_halves,
folded at compile time like the merge), SiLU * mul in the GEMM's epilogue.

With W4A4 activations, an RMSNorm feeding only such linears is then quantized in the same kernel
that normalizes; with W4A16 the GEMMs apply it (decode-sized inputs; passes/norms.py).
"""

import logging
import operator
from typing import NamedTuple
from pathlib import Path

import torch
from torch import fx

from nvfp4_inductor import checks
from nvfp4_inductor.format import BLOCK_SIZE
from nvfp4_inductor.kernels import plan
from nvfp4_inductor.lowerings import compat as _compat
from nvfp4_inductor.lowerings.passes import experts as experts_pass, norms as norms_pass
from nvfp4_inductor.lowerings.passes.fx import CONVERT as _CONVERT
from nvfp4_inductor.lowerings.passes.fx import (
    call as _call, LINEAR, tensor_val as _tensor_val, val as _val, VIEWS as _VIEWS,
)
from nvfp4_inductor.lowerings.passes.fx import silu_mul_operands, view_root as _view_root
from nvfp4_inductor.reference.tiled import GATED_GROUP, TILE_N

log = logging.getLogger("nvfp4_inductor")
NVFP4_LINEAR = torch.ops.nvfp4.linear.default
aten = torch.ops.aten
# the sources that make the generated code: the package's Python and its Inductor templates
_PACKAGE_FILES = tuple(sorted(str(p) for pattern in ("*.py", "*.jinja")
                              for p in Path(__file__).parents[2].rglob(pattern)))
# Linears sharing an input merge up to this many rows of x: the decode range of the split-K GEMM.
# Above it the prefill path applies a scalar global scale as cuBLASLt's alpha (scaled_mm_tiled),
# which a merged weight's per-row scales would rule out.
MERGE_MAX_M = plan.SPLITK_MAX_M_TILED


def _mm_operands(node: fx.Node):
    """mm(x, W^T) or addmm(bias, x, W^T) -> (bias or None, x, W^T) as the node has them now;
    nvfp4.linear / linear_tiled(x, W_data, ...) -> (bias or None, x, W_data)."""
    if node.target in (NVFP4_LINEAR, LINEAR):
        return node.args[4], node.args[0], node.args[1]
    return (None, *node.args) if node.target == aten.mm.default else node.args


def _is_transpose(node: fx.Node) -> bool:
    return node.target == aten.permute.default and list(node.args[1]) == [1, 0]


def _weight_of(node: fx.Node, params) -> fx.Node | None:
    """permute(W, [1, 0]) with W a lifted parameter or buffer placeholder -> W; permute(cast(W))
    (torch.autocast's copy of an fp32 W in bf16) -> the cast, quantized as the GEMM would read it
    (freezing folds it); else None. What else reads W decides whether it converts (_skip_reason)."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and _is_transpose(node)):
        return None
    weight = node.args[0]
    if _call(weight, _CONVERT) and weight.args[0] in params:
        return weight
    return weight if weight in params else None


def _as_weight(w_t: fx.Node, user: fx.Node) -> bool:
    """user reads W^T (w_t) as the weight operand of mm / addmm (a linear) and nowhere else."""
    return user.op == "call_function" and not user.kwargs and (
        (user.target == aten.mm.default and user.args[1] is w_t and user.args[0] is not w_t)
        or (user.target == aten.addmm.default and user.args[2] is w_t and w_t not in user.args[:2]))


def _linear_read(node: fx.Node) -> bool:
    """node is W^T read only by linears."""
    return _is_transpose(node) and all(_as_weight(node, u) for u in node.users)


def _other_reads(weight: fx.Node) -> set:
    """What reads W besides linears: an embedding tied to an output head, W @ y, a sum of W^T
    (a transpose the linear shares after common-subexpression elimination); for an autocast cast
    of a parameter, also the parameter's other readers, except further casts to the same dtype
    read only by linears (a weight shared by two linears under autocast)."""
    others = set()
    for u in weight.users:
        if _is_transpose(u):
            others |= {f"{v.target} (of W^T)" for v in u.users if not _as_weight(u, v)}
        else:
            others.add(str(u.target))
    if _call(weight, _CONVERT):
        for u in weight.args[0].users:
            if u is not weight and not (_call(u, _CONVERT) and u.args[1:] == weight.args[1:]
                                        and u.kwargs == weight.kwargs and all(map(_linear_read, u.users))):
                others.add(str(u.target))
    return others


def _defined_here(graph: fx.Graph, weight: fx.Node) -> fx.Node:
    """A constant's node at the graph's insertion point: a parameter is (placeholders come first);
    an autocast cast of it, or a dtype view of NVFP4 scale bytes, is made again there (the same
    op, folded by freezing)."""
    if not (_call(weight, _CONVERT) or _call(weight, aten.view.dtype)):
        return weight
    cast = graph.call_function(weight.target, weight.args, weight.kwargs)
    cast.meta.update(weight.meta)
    return cast


def _param_of(weight: fx.Node) -> fx.Node:
    """_weight_of's result -> the lifted parameter it reads (itself, or what the cast casts)."""
    return weight.args[0] if _call(weight, _CONVERT) else weight


TILE_WEIGHT = torch.ops.nvfp4.tile_weight.default
UNTILE_WEIGHT = torch.ops.nvfp4.untile_weight.default


def _aliases_its_input(node: fx.Node) -> bool:
    """node's output may share its input's storage: a view op (its schema's return aliases an
    argument: view, reshape, permute, unsqueeze, slice, select, t, expand, ...; _unsafe_view, whose
    schema says nothing, shares it too) or an item of one."""
    if node.op != "call_function":
        return False
    if _call(node, *_VIEWS):
        return True
    if node.target is operator.getitem:
        return _aliases_its_input(node.args[0]) if isinstance(node.args[0], fx.Node) else False
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(r.alias_info is not None and not r.alias_info.is_write
                                      for r in schema.returns)


def _reaches_output(node: fx.Node) -> bool:
    """node, or a tensor sharing its storage, is an output of the graph."""
    return any(user.op == "output" or (_aliases_its_input(user) and _reaches_output(user))
               for user in node.users)


def _skip_reason(weight: fx.Node, bias) -> str | None:
    value = weight.meta.get("val")
    if value is None or value.dim() != 2:
        return "not a 2-D weight"
    if value.dtype not in checks.FLOAT_DTYPES:
        return f"weight dtype {value.dtype}"
    n, k = value.shape
    if n % BLOCK_SIZE or k % BLOCK_SIZE:
        return f"shape ({n}, {k}) is not a multiple of {BLOCK_SIZE}"
    # Read by more than linears (an embedding tied to an output head, W @ y): converting would
    # free nothing, and a head judged by the embedding's name would escape skip_output_head.
    others = sorted(_other_reads(weight))
    if others:
        return f"weight also read by {', '.join(others)} (tied)"
    bias_value = _val(bias) if isinstance(bias, fx.Node) else None
    if bias is not None and (bias_value is None or tuple(bias_value.shape) != (n,)):
        shape = "unknown" if bias_value is None else tuple(bias_value.shape)
        return f"addmm's added term has shape {shape}, not ({n},)"
    return None


def _with_2d_input(graph: fx.Graph, node: fx.Node) -> fx.Node:
    """A converted layer's nvfp4.linear / linear_tiled on an x of more than 2 dims -> the same op
    on x viewed as (rows, K), its result viewed back: the form a bf16 linear reaches the graph in
    (view, mm, view), which the merge, the norm fusion and the template lowering expect."""
    x_val, y_val = _tensor_val(node.args[0]), _tensor_val(node)
    if x_val is None or y_val is None or x_val.dim() <= 2 or node.kwargs:
        return node
    with graph.inserting_before(node):
        x2 = graph.call_function(aten.view.default, (node.args[0], [-1, x_val.shape[-1]]))
        y2 = graph.call_function(node.target, (x2, *node.args[1:]))
    with graph.inserting_after(y2):
        y = graph.call_function(aten.view.default, (y2, list(y_val.shape)))
    with x_val.fake_mode:
        x2.meta["val"] = x_val.reshape(-1, x_val.shape[-1])
        y2.meta["val"] = y_val.reshape(-1, y_val.shape[-1])
    y.meta.update(node.meta)
    node.replace_all_uses_with(y)
    graph.erase_node(node)
    return y2


class LinearToConvert(NamedTuple):
    """A linear the pass converts: its node, bias, input and weight nodes, the weight's name."""
    node: fx.Node
    bias: fx.Node | None
    x: fx.Node
    weight: fx.Node
    name: str


class ConvertedParts(NamedTuple):
    """An already-NVFP4 linear's parts in the graph (nv.linear, or an NVFP4Linear's tiled op)."""
    data: fx.Node
    scale: fx.Node
    global_scale: fx.Node
    activation: str
    n: int | None  # the tiled weight's rows; None for the plain (interchange) layout


class LinearToNVFP4(_compat.CustomGraphPass):
    """Rewrites the linears of a frozen inference graph to nvfp4:: ops; counts what it did.

    param_names: the names of the graph's lifted parameters, in order. keep: parameter name ->
    the reason it stays bf16, or None to convert (names it lacks are converted). weight_method:
    "rtn" or "mse" (block scale search; "hessian" needs calibration data the graph lacks).
    merge, fuse_norms: Config's merge_linears and fuse_norms."""

    def __init__(self, activation: str, param_names: list[str], keep: dict | None = None,
                 weight_method: str = "rtn", merge: bool = True, fuse_norms: bool = True):
        if weight_method not in ("rtn", "mse"):
            raise ValueError(f'backend="nvfp4" supports weight_method "rtn" and "mse"; got '
                             f"{weight_method!r}")
        self.activation = activation
        self.weight_method = weight_method
        self.param_names = param_names
        self.keep = keep or {}
        self.merge = merge
        self.fuse_norms = fuse_norms
        self.converted: list[str] = []
        self.merged: list[list[str]] = []  # groups of weights multiplied as one GEMM
        self.retiled: list[str] = []  # weights already NVFP4 (nv.convert), moved to the tiled layout
        # nvfp4.linear / linear_tiled node of such a weight -> (data, scale, g, activation, tiled n or None)
        self._nvfp4: dict = {}
        self.gated = 0  # merged gate / up GEMMs whose epilogue takes silu(gate) * up
        self.skipped: dict[str, str] = {}
        self.norms_fused = 0  # RMSNorm -> W4A4 linears given rms_norm_quantize_values (passes/norms.py)
        self.norms_deferred = 0  # RMSNorm -> W4A16 linears applying it in the GEMM (passes/norms.py)

    def __call__(self, graph: fx.Graph) -> None:
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        if any(n.name.startswith("tangents") for n in placeholders):
            return  # a training graph: left alone
        self._nvfp4 = {}
        lifted = placeholders[:len(_compat.params_flat())]
        names = {node: (self.param_names[i] if i < len(self.param_names) else node.name)
                 for i, node in enumerate(lifted)}
        linears = []  # a LinearToConvert for every linear to convert, in graph order
        for node in list(graph.nodes):
            if node.op == "call_function" and node.target in (NVFP4_LINEAR, LINEAR):
                node = _with_2d_input(graph, node)
                linear = self._nvfp4_linear(node, names)
                if linear is not None:
                    linears.append(linear)
                continue
            if node.op != "call_function" or node.target not in (aten.mm.default, aten.addmm.default):
                continue
            if node.kwargs:  # addmm with beta / alpha: not a plain linear
                continue
            bias, x, weight_t = _mm_operands(node)
            weight = _weight_of(weight_t, names)
            if weight is None:
                continue
            name = names[_param_of(weight)]
            reason = _skip_reason(weight, bias) or self.keep.get(name)
            if reason is not None:
                self.skipped[name] = reason
                continue
            linears.append(LinearToConvert(node, bias, x, weight, name))
        for group in self._groups(linears):
            self._convert(graph, group)
        # mixture-of-experts GEMMs on 3-D expert weights -> the grouped NVFP4 ops (passes/experts.py)
        self.experts = experts_pass.rewrite_experts(graph, names, self)
        for node in list(graph.nodes):
            self._gate(graph, node)
        if self.fuse_norms and self.activation == "nvfp4":
            self.norms_fused = norms_pass.fuse_rms_norms(graph)
        if self.fuse_norms:
            self.norms_deferred = norms_pass.defer_rms_norms(graph)
        graph.eliminate_dead_code()
        log.info("nvfp4: converted %d linear weights, skipped %d %s", len(self.converted),
                 len(self.skipped), self.skipped)
        if self.norms_fused:
            log.info("nvfp4: %d RMSNorms quantized in one kernel with their W4A4 activations",
                     self.norms_fused)
        if self.norms_deferred:
            log.info("nvfp4: %d RMSNorms applied by the W4A16 GEMMs they feed", self.norms_deferred)
        if self.merged:
            log.info("nvfp4: merged into one GEMM each: %s", self.merged)
        if self.gated:
            log.info("nvfp4: %d gate / up GEMMs apply SiLU * mul in their epilogue", self.gated)
        if self.retiled:
            log.info("nvfp4: %d NVFP4 weights moved to the tiled layout", len(self.retiled))

    def _groups(self, linears):
        """The linears to convert, grouped: those reading the same x (at most MERGE_MAX_M static
        rows, N a multiple of TILE_N, all with or all without a bias) together, the rest alone.
        "The same x" looks through views: nn.Linear on a 3-D input reaches the graph as its own
        view of the input per linear."""
        groups: dict = {}
        for linear in linears:
            node, bias, x, weight, _ = linear
            value = x.meta.get("val")
            static = value is not None and all(isinstance(d, int) for d in value.shape)
            # (the merged GEMM runs where the first linear was: a bias computed in the graph may
            # be defined after it, or from its output)
            nvfp4 = self._nvfp4.get(node)  # a converted layer's ConvertedParts
            mergeable = (self.merge and static and value.shape[:-1].numel() <= MERGE_MAX_M
                         and self._width(linear) % TILE_N == 0
                         and (bias is None or bias.op in ("placeholder", "get_attr"))
                         and (nvfp4 is None or nvfp4.global_scale.op in ("placeholder", "get_attr")))
            activation = self.activation if nvfp4 is None else nvfp4.activation
            key = (_view_root(x), tuple(value.shape), bias is None, activation) if mergeable else node
            groups.setdefault(key, []).append(linear)
        return list(groups.values())

    def _quantized(self, graph: fx.Graph, weight: fx.Node):
        """-> (data, scale, g) nodes: the weight's NVFP4 codes, plain scale bits, global scale."""
        if self.weight_method == "rtn":
            quantized = graph.call_function(torch.ops.nvfp4.quantize.default, (weight, None, False, False))
        else:
            quantized = graph.call_function(torch.ops.nvfp4.quantize_weight.default,
                                            (weight, None, self.weight_method, None, False))
        return tuple(graph.call_function(operator.getitem, (quantized, i)) for i in range(3))

    def _convert(self, graph: fx.Graph, group) -> None:
        """One linear, or a group reading the same x as one GEMM (module docstring)."""
        first, bias, _, _, _ = group[0]
        # x as the graph has it now: where x is an earlier linear's output (two linears in a
        # row), that linear was converted and its node replaced since the list was made.
        x = _mm_operands(first)[1]
        x_val = x.meta.get("val")
        # a linear called twice on the same x is one weight in the GEMM, not two copies
        slot: dict = {}  # (weight, bias) -> its place among the GEMM's weights
        places = [slot.setdefault((weight, b), len(slot)) for _, b, _, weight, _ in group]
        members = [group[places.index(i)] for i in range(len(slot))]
        if len(members) == 1 and first.target == LINEAR:
            return  # a converted layer's tiled weight on its own: already what the lowering takes
        with graph.inserting_before(first):
            # an autocast cast of a later member's weight may sit after the first linear: cast again here
            parts = [self._plain_parts(graph, node) if node in self._nvfp4
                     else self._quantized(graph, _defined_here(graph, weight)) for node, _, _, weight, _ in members]
            activation = self._nvfp4[first].activation if first in self._nvfp4 else self.activation
            widths = [self._width(member) for member in members]
            if len(members) == 1:
                data, scale, g = parts[0]
            else:
                data = graph.call_function(aten.cat.default, ([p[0] for p in parts], 0))
                scale = graph.call_function(aten.cat.default, ([p[1] for p in parts], 0))
                g = graph.call_function(aten.cat.default, ([
                    graph.call_function(aten.expand.default, (p[2], [n])) for p, n in zip(parts, widths)], 0))
                if bias is not None:
                    bias = graph.call_function(aten.cat.default, ([b for _, b, _, _, _ in members], 0))
            tiled = graph.call_function(TILE_WEIGHT, (data, scale))
            data, scale = (graph.call_function(operator.getitem, (tiled, i)) for i in range(2))
            y = graph.call_function(torch.ops.nvfp4.linear_tiled.default,
                                    (x, data, scale, g, bias, sum(widths), activation))
            if len(members) == 1:
                y.meta.update(first.meta)
                # the old call's recorded input values would constrain the new call's arguments
                y.meta.pop("eager_input_vals", None)
                outputs = [y]
            else:
                with x_val.fake_mode:
                    y.meta["val"] = x_val.new_empty((*x_val.shape[:-1], sum(widths)))
                outputs, start = [], 0
                for n in widths:
                    out = graph.call_function(aten.slice.Tensor, (y, -1, start, start + n))
                    with x_val.fake_mode:
                        out.meta["val"] = y.meta["val"][..., start:start + n]
                    outputs.append(out)
                    start += n
                self.merged.append([name for *_, name in members])
        for (node, *_), place in zip(group, places):
            out = outputs[place]
            if len(group) > 1 and _reaches_output(node):
                # eager returns each linear's own contiguous tensor, not a slice of a wider one
                with graph.inserting_after(out):
                    own = graph.call_function(aten.clone.default, (out,),
                                              {"memory_format": torch.contiguous_format})
                with x_val.fake_mode:
                    own.meta["val"] = out.meta["val"].clone(memory_format=torch.contiguous_format)
                out = own
            node.replace_all_uses_with(out)
            graph.erase_node(node)
        for node, *_, name in members:
            (self.retiled if node in self._nvfp4 else self.converted).append(name)

    def _gate(self, graph: fx.Graph, node: fx.Node) -> None:
        """F.silu(gate) * up with gate and up the two halves of one merged bias-less GEMM (a
        gated MLP at decode) -> nvfp4.linear_tiled_silu_mul on the same weights, rows interleaved
        (tiled.interleave_halves), folded at compile time like the merge."""
        match = silu_mul_operands(node)
        if match is None:
            return
        # (a 3-D x: each half viewed back from the GEMM's 2-D rows)
        viewed = all(_call(t, *_VIEWS) and len(t.users) == 1 for t in match)
        if viewed:
            match = tuple(t.args[0] for t in match)
        if not all(_call(t, aten.slice.Tensor) and len(t.users) == 1 for t in match):
            return
        if plan.x_format(self.activation, match[0].meta["val"].device) == "nvfp4":
            return  # (W4A4 on FP4 tensor cores: the block-scaled template has no such epilogue)
        gate, up = match
        sliced = gate.args[0]  # the GEMM, or (one weight's halves, a 3-D x) one view of its rows
        y = sliced.args[0] if not viewed and _call(sliced, *_VIEWS) and len(sliced.users) == 2 else sliced
        if not (up.args[0] is sliced and _call(y, LINEAR) and y.args[4] is None
                and len(y.users) == (1 if sliced is not y else 2)):
            return
        n = y.args[5] // 2
        tiled = y.args[1].args[0] if _call(y.args[1], operator.getitem) else None
        if ("val" not in y.meta or "val" not in sliced.meta or n % GATED_GROUP
                or sliced.meta["val"].shape[-1] != 2 * n or not _call(tiled, TILE_WEIGHT)):
            return
        dims = sliced.meta["val"].dim()
        ranges = [tuple(t.args[2:4]) for t in match]
        if (any(t.args[1] % dims != dims - 1 or t.args[4:] not in ((), (1,)) for t in match)
                or sorted(ranges) != [(0, n), (n, 2 * n)]):
            return
        gate_first = ranges[0] == (0, n)
        data, scale = tiled.args
        k = y.args[0].meta["val"].shape[-1]

        def interleaved(t, rest):  # (2n, *rest) with gate and up halves -> interleave_halves'
            halves = [graph.call_function(aten.slice.Tensor, (t, 0, 0, n)),
                      graph.call_function(aten.slice.Tensor, (t, 0, n, 2 * n))]
            if not gate_first:
                halves.reverse()
            groups = [graph.call_function(aten.view.default, (h, [n // GATED_GROUP, GATED_GROUP, *rest]))
                      for h in halves]
            stacked = graph.call_function(aten.stack.default, (groups, 1))
            return graph.call_function(aten.view.default, (stacked, [2 * n, *rest]))

        with graph.inserting_before(node):
            retiled = graph.call_function(TILE_WEIGHT, (
                interleaved(data, [k // 2]), interleaved(scale, [k // BLOCK_SIZE])))
            parts = [graph.call_function(operator.getitem, (retiled, i)) for i in range(2)]
            # per row (2n,), or one fused gate_up weight's per-tensor scale (): one a row either way
            g = graph.call_function(aten.expand.default, (y.args[3], [2 * n]))
            out = graph.call_function(torch.ops.nvfp4.linear_tiled_silu_mul.default, (
                y.args[0], *parts, interleaved(g, []), None, n, y.args[6]))
            if viewed or sliced is not y:
                y_val = y.meta["val"]
                with y_val.fake_mode:
                    out.meta["val"] = y_val.new_empty((*y_val.shape[:-1], n))
                out = graph.call_function(aten.view.default, (out, list(node.meta["val"].shape)))
        out.meta.update(node.meta)
        node.replace_all_uses_with(out)
        self.gated += 1

    def _nvfp4_linear(self, node: fx.Node, names):
        """nvfp4.linear on constant NVFP4 weights with plain scales (nv.linear in a model), or
        nvfp4.linear_tiled on constant tiled weights without a deferred norm (an NVFP4Linear from
        nv.convert) -> its entry among the linears to convert, its NVFP4 parts kept in
        self._nvfp4: it merges like a bf16 weight (its codes and scales untiled, concatenated and
        tiled again, folded at compile time); a plain one alone gets the tiled layout, a tiled one
        alone stays as it is."""
        if node.target == LINEAR:
            x, data, scale, g, bias, n, activation, *norm = node.args
            if any(a is not None for a in norm[:1]) or node.kwargs or data not in names or scale not in names:
                return None
            self._nvfp4[node] = ConvertedParts(data, scale, g, activation, n)
            return LinearToConvert(node, bias, x, data, names[data])
        x, data, scale, g, bias, swizzled, activation = node.args
        if (swizzled or data not in names
                or not (scale in names or (isinstance(scale, fx.Node) and scale.target == aten.view.dtype
                                           and scale.args[0] in names))):
            return None
        self._nvfp4[node] = ConvertedParts(data, scale, g, activation, None)
        return LinearToConvert(node, bias, x, data, names[data])

    def _width(self, linear) -> int:
        """A linear's N (a tiled weight's from the op's n: its codes are 1-D)."""
        node, _, _, weight, _ = linear
        nvfp4 = self._nvfp4.get(node)
        return nvfp4.n if nvfp4 is not None and nvfp4.n is not None else weight.meta["val"].shape[0]

    def _plain_parts(self, graph: fx.Graph, node: fx.Node):
        """A converted linear's (codes, plain scale bits, global scale) nodes at the insertion point."""
        data, scale, g, _, n = self._nvfp4[node]
        if n is None:
            return tuple(_defined_here(graph, t) for t in (data, scale, g))
        k = node.args[0].meta["val"].shape[-1]
        plain = graph.call_function(UNTILE_WEIGHT, (data, scale, n, k))
        return (*(graph.call_function(operator.getitem, (plain, i)) for i in range(2)), g)

    def uuid(self) -> bytes:
        """Keys the FX graph cache: the package sources (the planner's thresholds and tables as
        written) and the options that change the rewrite."""
        return _compat.get_hash_for_files(_PACKAGE_FILES) + repr(
            (self.activation, self.param_names, sorted(self.keep.items()), self.weight_method, self.merge,
             self.fuse_norms)
        ).encode()
