"""The FX graph backend="nvfp4" rewrites, before and after its pass (expecttest: on a change, run
with EXPECTTEST_ACCEPT=1 and review the diff). A bf16 MLP: up (bias) and down become
quantize -> tile_weight -> linear_tiled on the frozen weights; the output head stays addmm."""

import expecttest
import torch
from test_backend import _block  # the same bf16 MLP: up (bias), ReLU, down, lm_head
from torch import fx

import nvfp4_inductor as nv
from nvfp4_inductor.lowerings.passes import linear as rewrite


def _graph_text(graph: fx.Graph) -> str:
    """One line per node: placeholders, calls with their arguments, tuple items, the output."""
    lines = []
    for node in graph.nodes:
        if node.op == "placeholder":
            lines.append(f"{node.name} = input")
        elif node.op == "call_function" and getattr(node.target, "__name__", "") == "getitem":
            lines.append(f"{node.name} = {node.args[0].name}[{node.args[1]}]")
        elif node.op == "call_function":
            args = ", ".join(a.name if isinstance(a, fx.Node) else repr(a) for a in node.args)
            lines.append(f"{node.name} = {node.target}({args})")
        elif node.op == "output":
            lines.append(f"return {node.args[0]}")
    return "\n".join(lines)


class TestRewriteGraphs(expecttest.TestCase):
    def setUp(self):
        torch._dynamo.reset()

    def tearDown(self):
        torch._dynamo.reset()

    def _graphs(self, config):
        seen = []
        original = rewrite.LinearToNVFP4.__call__

        def recording(pass_, graph):
            before = _graph_text(graph)
            original(pass_, graph)
            seen.append((before, _graph_text(graph)))

        rewrite.LinearToNVFP4.__call__ = recording
        try:
            model = _block()
            nv.compile(model, config)(torch.randn(4, 64, dtype=torch.bfloat16))
        finally:
            rewrite.LinearToNVFP4.__call__ = original
        self.assertEqual(len(seen), 1)
        return seen[0]

    def test_bf16_linears_become_nvfp4_ops(self):
        before, after = self._graphs(nv.Config(activations="bf16"))
        self.assertExpectedInline(before, """\
arg0_1 = input
arg1_1 = input
arg2_1 = input
arg3_1 = input
arg4_1 = input
arg5_1 = input
permute = aten.permute.default(arg0_1, [1, 0])
addmm = aten.addmm.default(arg1_1, arg5_1, permute)
relu = aten.relu.default(addmm)
permute_1 = aten.permute.default(arg2_1, [1, 0])
mm = aten.mm.default(relu, permute_1)
permute_2 = aten.permute.default(arg3_1, [1, 0])
addmm_1 = aten.addmm.default(arg4_1, mm, permute_2)
return (addmm_1,)""")
        self.assertExpectedInline(after, """\
arg0_1 = input
arg1_1 = input
arg2_1 = input
arg3_1 = input
arg4_1 = input
arg5_1 = input
quantize_default = nvfp4.quantize.default(arg0_1, None, False, False)
getitem = quantize_default[0]
getitem_1 = quantize_default[1]
getitem_2 = quantize_default[2]
tile_weight_default = nvfp4.tile_weight.default(getitem, getitem_1)
getitem_3 = tile_weight_default[0]
getitem_4 = tile_weight_default[1]
linear_tiled_default = nvfp4.linear_tiled.default(arg5_1, getitem_3, getitem_4, getitem_2, arg1_1, 128, 'bf16')
relu = aten.relu.default(linear_tiled_default)
quantize_default_1 = nvfp4.quantize.default(arg2_1, None, False, False)
getitem_5 = quantize_default_1[0]
getitem_6 = quantize_default_1[1]
getitem_7 = quantize_default_1[2]
tile_weight_default_1 = nvfp4.tile_weight.default(getitem_5, getitem_6)
getitem_8 = tile_weight_default_1[0]
getitem_9 = tile_weight_default_1[1]
linear_tiled_default_1 = nvfp4.linear_tiled.default(relu, getitem_8, getitem_9, getitem_7, None, 64, 'bf16')
permute_2 = aten.permute.default(arg3_1, [1, 0])
addmm_1 = aten.addmm.default(arg4_1, linear_tiled_default_1, permute_2)
return (addmm_1,)""")

    def test_mse_weights_use_quantize_weight(self):
        _, after_rtn = self._graphs(nv.Config(activations="nvfp4"))
        torch._dynamo.reset()
        _, after_mse = self._graphs(nv.Config(activations="nvfp4", weight_method="mse"))
        expected = after_rtn.replace("quantize_default", "quantize_weight_default")
        for weight in ("arg0_1", "arg2_1"):
            expected = expected.replace(f"nvfp4.quantize.default({weight}, None, False, False)",
                                        f"nvfp4.quantize_weight.default({weight}, None, 'mse', None, False)")
        self.assertIn("nvfp4.quantize_weight.default(arg0_1, None, 'mse', None, False)", after_mse)
        self.assertEqual(after_mse, expected)


def test_training_graphs_are_left_alone():
    """A joint graph (it has tangents) keeps its bf16 linears: the pass only rewrites inference."""
    graph = fx.Graph()
    weight, x, tangents = (graph.placeholder(n) for n in ("primals_1", "primals_2", "tangents_1"))
    weight_t = graph.call_function(torch.ops.aten.permute.default, (weight, [1, 0]))
    y = graph.call_function(torch.ops.aten.mm.default, (x, weight_t))
    graph.output((y, tangents))
    before = _graph_text(graph)
    rewrite.LinearToNVFP4("bf16", ["weight"])(graph)
    assert _graph_text(graph) == before
