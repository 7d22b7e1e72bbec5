"""backend="nvfp4" on an unconverted mixture-of-experts model: the expert GEMMs of transformers'
experts modules (3-D weights gate_up_proj (E, 2I, H) and down_proj (E, H, I), made constants of
the graph by the backend) become the grouped NVFP4 ops of ops/grouped.py, their weights quantized once, at
compile time, by `nvfp4.quantize_experts_tiled` (each expert with its own global scale, as
NVFP4Experts.from_experts does), which freezing folds like the dense path's quantize.

How each experts_implementation reaches the joint graph, and what it becomes:

    "grouped_mm"  y = _grouped_mm(x_sorted (S, K), permute(W, [0, 2, 1]), offsets)     (or W (E, K, N)
                  stored transposed; transformers' grouped_mm_fallback op the same way)
              ->  y = nvfp4.grouped_linear_tiled(x_sorted, offsets, codes, scale bits, g, None, N, activation)
    "batched_mm"  y = squeeze(bmm(index(W, [ids]), unsqueeze(x (S, K), -1)), -1)    one expert per row
              ->  ids_sorted, perm = sort(ids, stable); offsets = searchsorted(ids_sorted, arange(E))
                  y = empty_like(y_sorted).index_put([perm], y_sorted),
                  y_sorted = nvfp4.grouped_linear_tiled(x[perm], offsets, ...)
                  (the sort is made once per ids; a product whose x is the unsorted output of an
                  earlier one with the same ids reads its sorted rows directly)
    "eager"       a Python loop over the experts hit, with data-dependent shapes: Dynamo breaks the
                  graph there and runs the loop outside any compiled graph, where no backend sees
                  it. Those experts stay bf16; the graph compiled from the experts' forward names
                  them in the pass's skipped log.

Either product followed by transformers' gate, silu(y[:, :I]) * y[:, I:] (split along N), becomes
one `nvfp4.grouped_linear_tiled_silu_mul` (SiLU * up in the kernel's epilogue; its weights tiled
with gate and up rows interleaved). The routing (top-k,
sort, offsets, gather) and the weighted sum stay in the graph for Inductor.
"""

import logging
import operator
import weakref
from dataclasses import dataclass

import torch
from torch import fx
from torch.utils._pytree import tree_map

from nvfp4_inductor import checks
from nvfp4_inductor.format import BLOCK_SIZE
from nvfp4_inductor.lowerings.passes.fx import call as _call, silu_mul_operands, val as _val
from nvfp4_inductor.modules.experts import is_experts

log = logging.getLogger("nvfp4_inductor")
aten = torch.ops.aten
# the last name component of an experts module's 3-D weights (transformers 5.x)
EXPERT_WEIGHTS = ("gate_up_proj", "up_proj", "down_proj")
_TRANSPOSES = ([0, 2, 1], [0, -1, -2])


def _grouped_mm_targets() -> tuple:
    targets = [aten._grouped_mm.default]
    fallback = getattr(getattr(torch.ops, "transformers", None), "grouped_mm_fallback", None)
    if fallback is not None:
        targets.append(fallback.default)
    return tuple(targets)


@dataclass(eq=False)
class _Product:
    """One expert GEMM: node's value is (S, N), rows of x (S, K) times their experts' weights."""
    node: fx.Node          # the _grouped_mm, or the squeeze of the bmm
    x_of: fx.Node          # the node whose args[0] is x (read when rewriting: x may have been replaced)
    weight: fx.Node        # the constant W
    operand: fx.Node       # the node reading W for this product (permute, index, or the GEMM)
    gemm: fx.Node          # the _grouped_mm or bmm
    transposed: bool       # W stored (E, K, N)
    offsets: fx.Node | None = None  # grouped_mm: the offsets; batched_mm: None
    ids: fx.Node | None = None      # batched_mm: each row's expert id


def _is_transpose(node) -> bool:
    if _call(node, aten.permute.default):
        return list(node.args[1]) in _TRANSPOSES
    return _call(node, aten.transpose.int) and sorted(d % 3 for d in node.args[1:3]) == [1, 2]


def _match_grouped(node: fx.Node, params) -> _Product | None:
    if not _call(node, *_grouped_mm_targets()) or len(node.args) < 3:
        return None
    extra = [a for a in (*node.args[3:], *node.kwargs.values()) if a is not None]
    x, w, offsets = node.args[:3]
    if extra or not isinstance(x, fx.Node) or _val(x) is None or _val(x).dim() != 2:
        return None
    if _is_transpose(w) and w.args[0] in params:
        return _Product(node, node, w.args[0], w, node, False, offsets=offsets)
    if w in params:
        return _Product(node, node, w, node, node, True, offsets=offsets)
    return None


def _match_batched(node: fx.Node, params) -> _Product | None:
    """squeeze(bmm(index(W, [ids]), unsqueeze(x, -1)), -1), or (W stored (E, K, N))
    squeeze(bmm(unsqueeze(x, 1), index(W, [ids])), 1)."""
    if not (_call(node, aten.bmm.default) and len(node.users) == 1):
        return None
    squeeze = next(iter(node.users))
    a, b = node.args
    for gathered, vector, transposed, dim in ((a, b, False, 2), (b, a, True, 1)):
        if not (_call(gathered, aten.index.Tensor) and len(gathered.args[1]) == 1
                and gathered.args[0] in params and _call(vector, aten.unsqueeze.default)
                and vector.args[1] % 3 == dim and _val(vector.args[0]) is not None
                and _val(vector.args[0]).dim() == 2):
            continue
        if not (_call(squeeze, aten.squeeze.dim) and squeeze.args[1] % 3 == dim
                or _call(squeeze, aten.squeeze.dims) and [d % 3 for d in squeeze.args[1]] == [dim]):
            return None
        return _Product(squeeze, vector, gathered.args[0], gathered, node, transposed, ids=gathered.args[1][0])
    return None


def _shape_reason(weight: fx.Node, transposed: bool) -> str | None:
    value = _val(weight)
    if value.dtype not in checks.FLOAT_DTYPES:
        return f"expert weights of dtype {value.dtype}"
    e, n, k = value.shape if not transposed else (value.shape[0], value.shape[2], value.shape[1])
    if not e or n % BLOCK_SIZE or k % BLOCK_SIZE or not n or not k:
        return (f"expert weights (E, N, K) = {(e, n, k)}: N and K must be positive multiples of "
                f"{BLOCK_SIZE}")
    return None


def _gate_of(product: fx.Node):
    """The node computing transformers' gate silu(y[:, :I]) * y[:, I:] of product's y (S, 2I)
    and nothing else reading y -> that node, or None."""
    if len(product.users) != 1:
        return None
    split = next(iter(product.users))
    n = _val(product).shape[-1]
    if not (_call(split, aten.split.Tensor) and split.args[1] == n // 2
            or _call(split, aten.split_with_sizes.default) and list(split.args[1]) == [n // 2] * 2):
        return None
    if (split.args[2] if len(split.args) > 2 else 0) % 2 != 1 or n % 2 or len(split.users) != 2:
        return None
    halves = {u.args[1]: u for u in split.users if u.target is operator.getitem}
    if sorted(halves) != [0, 1] or any(len(h.users) != 1 for h in halves.values()):
        return None
    up = halves[1]
    mul = next(iter(up.users))
    if silu_mul_operands(mul) != (halves[0], up):
        return None
    return mul


def _fake_mode(graph: fx.Graph):
    for node in graph.nodes:
        value = _val(node)
        if isinstance(value, torch.Tensor) and hasattr(value, "fake_mode"):
            return value.fake_mode
    return None


class _Builder:
    """Adds call nodes with their fake values (meta["val"], which later passes read)."""

    def __init__(self, graph: fx.Graph, fake_mode):
        self.graph, self.fake_mode = graph, fake_mode

    def __call__(self, target, *args, **kwargs) -> fx.Node:
        node = self.graph.call_function(target, args, kwargs)
        fake_args, fake_kwargs = tree_map(lambda a: _val(a) if isinstance(a, fx.Node) else a, (args, kwargs))
        with self.fake_mode:
            node.meta["val"] = target(*fake_args, **fake_kwargs)
        return node


def _frame_module():
    """The module whose forward Dynamo is compiling (its frame's `self`), or None."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        return InstructionTranslator.current_tx().f_locals.get("self")
    except Exception:  # not under Dynamo (a graph compiled directly), or another Dynamo version
        return None


# experts modules already reported as run outside the compiled graphs (once each, not per graph)
_REPORTED = weakref.WeakSet()


def rewrite_experts(graph: fx.Graph, names: dict, pass_) -> list[str]:
    """Rewrite graph's expert GEMMs on lifted 3-D weights (names: placeholder -> parameter path)
    as the module docstring says, with pass_'s activation, weight method and keep decisions;
    record in pass_.skipped the expert weights left bf16, with why -> the names converted."""
    products = [p for node in list(graph.nodes)
                for p in (_match_grouped(node, names), _match_batched(node, names)) if p is not None]
    by_weight: dict = {}
    for p in products:
        by_weight.setdefault(p.weight, []).append(p)
    converted, quantized = [], {}
    fake_mode = _fake_mode(graph)
    for weight, uses in by_weight.items():
        name = names[weight]
        operands, gemms = {p.operand for p in uses}, {p.gemm for p in uses}
        others = sorted({str(u.target) for u in weight.users if u not in operands}
                        | {str(u.target) for o in operands - gemms for u in o.users if u not in gemms})
        reason = (_shape_reason(weight, uses[0].transposed) or (f"expert weights also read by {', '.join(others)}"
                  if others else None) or pass_.keep.get(name))
        if len({p.transposed for p in uses}) > 1:
            reason = "expert weights read both as (E, N, K) and as (E, K, N)"
        if reason is not None or fake_mode is None:
            pass_.skipped[name] = reason or "no fake values in the graph"
            continue
        converted.append(name)
        for p in uses:
            quantized[p] = name
    build = _Builder(graph, fake_mode)
    sorts: dict = {}  # ids node -> (perm, offsets)
    parts: dict = {}  # W -> its NVFP4 (codes, scale bits, global scales) nodes
    sorted_rows: dict = {}  # an unsorted output made here -> (its sorted rows, ids)
    gated = 0
    for p in products:
        if p not in quantized:
            continue
        gate = _gate_of(p.node)
        with graph.inserting_before(p.gemm):
            nvfp4, n = _quantized(build, p, pass_.weight_method, parts, gate is not None)
            x = p.x_of.args[0]
            if p.ids is None:
                offsets = p.offsets
                if _val(offsets).dtype != torch.int32:
                    offsets = build(torch.ops.prims.convert_element_type.default, offsets, torch.int32)
                rows = x
            else:
                if p.ids not in sorts:
                    ids_sorted, perm = (build(operator.getitem, s, i) for s in
                                        [build(aten.sort.stable, p.ids, stable=True, dim=0)] for i in range(2))
                    experts = build(torch.ops.prims.iota.default, _val(p.weight).shape[0], start=0, step=1,
                                    dtype=_val(p.ids).dtype, device=_val(p.ids).device, requires_grad=False)
                    sorts[p.ids] = perm, build(aten.searchsorted.Tensor, ids_sorted, experts,
                                               out_int32=True, right=True)
                perm, offsets = sorts[p.ids]
                known = sorted_rows.get(x)
                rows = known[0] if known is not None and known[1] is p.ids else build(aten.index.Tensor, x, [perm])
            op = (torch.ops.nvfp4.grouped_linear_tiled_silu_mul if gate is not None
                  else torch.ops.nvfp4.grouped_linear_tiled)
            y = build(op.default, rows, offsets, *nvfp4, None, n, pass_.activation)
            if p.ids is not None:
                y_sorted = y
                y = build(aten.index_put.default, build(aten.empty_like.default, y_sorted), [perm], y_sorted)
                sorted_rows[y] = (y_sorted, p.ids)
        (gate if gate is not None else p.node).replace_all_uses_with(y)
        gated += gate is not None
    _report_outside(names, converted, pass_)
    if converted:
        log.info("nvfp4: converted %d expert weights to grouped NVFP4 GEMMs (%d with SiLU * up in the "
                 "epilogue): %s", len(converted), gated, converted)
    return converted


def _quantized(build: _Builder, p: _Product, method: str, memo: dict, gated: bool):
    """-> the product's (tiled codes, scale bits, global scales) nodes, W quantized per expert (once
    per W and layout), and N, the rows an expert."""
    key = (p.weight, gated)
    if key not in memo:
        w = build(aten.permute.default, p.weight, [0, 2, 1]) if p.transposed else p.weight
        q = build(torch.ops.nvfp4.quantize_experts_tiled.default, w, method, gated)
        memo[key] = tuple(build(operator.getitem, q, i) for i in range(3))
    shape = _val(p.weight).shape
    return memo[key], shape[2] if p.transposed else shape[1]


def _report_outside(names: dict, converted: list, pass_) -> None:
    """Expert weights this graph leaves bf16 without a product the rewrite knows: 3-D weights named
    as transformers names experts' read some other way, and an experts module whose forward is
    compiled here without its weights (experts_implementation "eager": the loop runs outside)."""
    for node, name in names.items():
        value = _val(node)
        if (name in converted or name in pass_.skipped or not isinstance(value, torch.Tensor) or value.dim() != 3
                or name.rpartition(".")[2] not in EXPERT_WEIGHTS or not node.users):
            continue
        readers = ", ".join(sorted({str(u.target) for u in node.users}))
        pass_.skipped[name] = (f"expert weights read by {readers}: not a form the rewrite knows "
                               "(experts_implementation 'grouped_mm' or 'batched_mm')")
    module = _frame_module()
    if (module is None or not isinstance(module, torch.nn.Module) or not is_experts(module)
            or converted or module in _REPORTED):
        return
    _REPORTED.add(module)
    impl = getattr(getattr(module, "config", None), "_experts_implementation", None)
    why = ("loops over the experts in Python with data-dependent shapes, which Dynamo runs outside the "
           "compiled graphs" if impl in (None, "eager") else "does not reach this graph as a form the rewrite knows")
    pass_.skipped[f"{type(module).__name__} (experts_implementation={impl!r})"] = (
        f"{why}: its experts stay bf16; use experts_implementation 'grouped_mm' or 'batched_mm', or "
        "nvfp4_inductor.convert the model first")


def experts_keep(config, names: list[str], constants) -> dict:
    """{path: why it stays bf16} for the graph's 3-D expert weights that Config.include rejects
    (called with the experts module's path and module None, as convert_experts calls it)."""
    keep = {}
    for path, (_, t) in zip(names, constants):
        module, _, leaf = path.rpartition(".")
        if (t.dim() == 3 and leaf in EXPERT_WEIGHTS and config.include is not None
                and not config.include(module, None)):
            keep[path] = "excluded by Config.include"
    return keep
