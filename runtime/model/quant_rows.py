"""A fused CPU model's per-token int8 quantizations as one op each (QuantizeTokens,
kernels/cpu_quant.c).

compiler/passes/token_quant.py writes each `DynamicQuantizeLinear` of an int8 model
(onnxruntime's quantize_dynamic) per token in 18 ONNX ops, four times a layer: SmolLM2's
decode step ran ~2200 of them, each an onnxruntime dispatch. Where the tokens are the rows
of the last axis, the chain is

    low  = Min(ReduceMin(x, [-1]), 0)        high = Max(ReduceMax(x, [-1]), 0)
    span = Sub(high, low)                    scale = Where(Equal(span, 0), 1, Div(span, 255))
    zp_f = Round(Clip(Sub(0, Div(low, scale)), 0, 255))
    y    = Cast<uint8>(Clip(Add(Round(Div(x, scale)), zp_f), 0, 255))
    zp   = Cast<uint8>(zp_f)

and becomes QuantizeTokens(x) -> (y, scale, zp), the same bits (tests/test_quant_rows.py).
A chain any of whose inner values is read elsewhere, or that differs in any step, stays.
"""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import TensorProto, helper

from dspark.runtime.model.row_ops import DOMAIN, GraphIndex, attr, place


class _Walk:
    """Steps back from a tensor to its producer, each checked; None at the first miss."""

    def __init__(self, g: GraphIndex):
        self.g = g
        self.nodes: list[onnx.NodeProto] = []

    def made_by(self, name: str, op: str, *constants: float | None) -> onnx.NodeProto | None:
        """The `op` node making `name`; `constants`: its inputs from the second on, each a
        scalar of that value (None: any tensor)."""
        node = self.g.producer.get(name)
        if node is None or node.op_type != op:
            return None
        for value, given in zip(constants, node.input[1:]):
            if value is not None and not self.scalar(given, value):
                return None
        self.nodes.append(node)
        return node

    def scalar(self, name: str, value: float) -> bool:
        c = self.g.constant(name)
        return c is not None and c.size == 1 and float(c.reshape(())) == value

    def last_axis(self, node: onnx.NodeProto) -> bool:
        axes = attr(node, "axes")
        if axes is None and len(node.input) > 1:
            c = self.g.constant(node.input[1])
            axes = None if c is None else [int(a) for a in c.reshape(-1)]
        return axes is not None and list(axes) == [-1] and attr(node, "keepdims", 1) == 1


def _chain(g: GraphIndex, cast_y: onnx.NodeProto):
    """(nodes, x, (y, scale, zp)) of the chain ending in `cast_y`, or None."""
    w = _Walk(g)
    w.nodes.append(cast_y)
    clip = w.made_by(cast_y.input[0], "Clip", 0.0, 255.0)
    add = clip and w.made_by(clip.input[0], "Add")
    if add is None:
        return None
    round_x = w.made_by(add.input[0], "Round")
    div_x = round_x and w.made_by(round_x.input[0], "Div")
    round_z = w.made_by(add.input[1], "Round")
    clip_z = round_z and w.made_by(round_z.input[0], "Clip", 0.0, 255.0)
    sub_z = clip_z and w.made_by(clip_z.input[0], "Sub")
    if div_x is None or sub_z is None or not w.scalar(sub_z.input[0], 0.0):
        return None
    x, scale = div_x.input
    div_low = w.made_by(sub_z.input[1], "Div")
    where = w.made_by(scale, "Where", 1.0)
    if div_low is None or where is None or div_low.input[1] != scale:
        return None
    equal = w.made_by(where.input[0], "Equal", 0.0)
    div_span = w.made_by(where.input[2], "Div", 255.0)
    if equal is None or div_span is None or equal.input[0] != div_span.input[0]:
        return None
    span = w.made_by(equal.input[0], "Sub")
    high = span and w.made_by(span.input[0], "Max", 0.0)
    low = span and w.made_by(span.input[1], "Min", 0.0)
    if high is None or low is None or low.output[0] != div_low.input[0]:
        return None
    top = w.made_by(high.input[0], "ReduceMax")
    bottom = w.made_by(low.input[0], "ReduceMin")
    if (top is None or bottom is None or top.input[0] != x or bottom.input[0] != x
            or not (w.last_axis(top) and w.last_axis(bottom))):
        return None
    cast_zp = [n for n in g.consumers.get(round_z.output[0], [])
               if n.op_type == "Cast" and attr(n, "to") == TensorProto.UINT8]
    if len(cast_zp) != 1:
        return None
    nodes = w.nodes + cast_zp
    outputs = (cast_y.output[0], scale, cast_zp[0].output[0])
    inside = {id(n) for n in nodes}
    for n in nodes:  # every inner value read only inside the chain
        for out in n.output:
            if out not in outputs and (out in g.outputs or any(
                    id(c) not in inside for c in g.consumers.get(out, []))):
                return None
    return nodes, x, outputs


def rewrite_quantize(model: onnx.ModelProto, folder: Path) -> int:
    """Rewrite `model` (its external data in `folder`) in place; how many chains became
    QuantizeTokens."""
    graph = model.graph
    g = GraphIndex(graph, folder)
    drop: set[int] = set()
    new: dict[int, onnx.NodeProto] = {}  # placed where the chain's y was cast
    for node in graph.node:
        if node.op_type != "Cast" or attr(node, "to") != TensorProto.UINT8 or id(node) in drop:
            continue
        found = _chain(g, node)
        if found is None:
            continue
        nodes, x, outputs = found
        drop.update(id(n) for n in nodes)
        new[id(node)] = helper.make_node("QuantizeTokens", [x], list(outputs), domain=DOMAIN,
                                         name=f"{node.name}/dspark_quantize_{len(new)}")
    return place(model, drop, new)  # in y's Cast's place, the zero point's Cast after it
