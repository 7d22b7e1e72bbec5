"""FX helpers shared by the graph passes (passes/linear.py, passes/norms.py)."""

import torch
from torch import fx

aten = torch.ops.aten
CONVERT = torch.ops.prims.convert_element_type.default
VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
LINEAR = torch.ops.nvfp4.linear_tiled.default


def call(node, *targets) -> bool:
    """node is a call of one of targets."""
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def val(node):
    """node's fake value (meta["val"]), or None."""
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def tensor_val(node):
    """node's fake tensor, or None: under dynamic shapes a node may hold a SymInt or SymFloat (a
    size, a scalar), which the matchers must not take for a tensor."""
    value = val(node)
    return value if isinstance(value, torch.Tensor) else None


def pairs(node):
    """The two orders of a commutative call's operands."""
    a, b = node.args[:2]
    return (a, b), (b, a)


def view_root(node: fx.Node) -> fx.Node:
    """The node a chain of views starts from (the views of one tensor read the same values)."""
    while call(node, *VIEWS):
        node = node.args[0]
    return node


def silu_mul_operands(y: fx.Node):
    """y = F.silu(gate) * up as traced (af = convert(gate, float32); af / (exp(-af) + 1), or
    af * sigmoid(af), or silu(af); converted back to gate's dtype; times up) -> (gate, up)."""
    if not (call(y, aten.mul.Tensor) and not y.kwargs):
        return None
    for c, up in pairs(y):
        if not (call(c, CONVERT) and call(c.args[0], aten.div.Tensor, aten.mul.Tensor, aten.silu.default)):
            continue
        s, af = c.args[0], c.args[0].args[0]
        if not (call(af, CONVERT) and af.args[1] == torch.float32):
            continue
        if s.target == aten.div.Tensor:
            add = s.args[1]
            ok = (call(add, aten.add.Tensor) and add.args[1] == 1 and call(add.args[0], aten.exp.default)
                  and call(add.args[0].args[0], aten.neg.default) and add.args[0].args[0].args[0] is af)
        elif s.target == aten.mul.Tensor:
            ok = any(a is af and call(b, aten.sigmoid.default) and b.args[0] is af for a, b in pairs(s))
        else:
            ok = len(s.args) == 1
        gate = af.args[0]
        vals = [tensor_val(gate), tensor_val(up)]  # up may be a size (a SymInt) under dynamic shapes
        if (ok and None not in vals and c.args[1] == vals[0].dtype and vals[1].dtype == vals[0].dtype
                and vals[1].shape == vals[0].shape):
            return gate, up
    return None
