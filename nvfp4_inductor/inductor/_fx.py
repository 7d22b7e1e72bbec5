"""FX helpers shared by the graph passes (rewrite.py, norm_fusion.py)."""

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
