"""A fused CPU model's RMS norms and SiLUs as our row ops (kernels/cpu_rows.c).

Onnxruntime fuses an exported RMS norm into SimplifiedLayerNormalization and x * sigmoid(x)
into QuickGelu, and both hand a forward of two or more rows to the intra-op pool. While other
processes hold the cores, forwards leave the pool (load_gate.py), and a verify that woke it
left its threads spinning against the decodes after it. Ours stay on the calling thread for a
few rows. Rewritten here, on the graph as the bundle holds it:

    Pow(x, 2) -> ReduceMean(last axis) -> Add(eps) -> Sqrt -> Div(x, .) -> Mul(scale)
                                                        => RmsNorm(x, scale, epsilon=eps)
    SimplifiedLayerNormalization(x, scale)              => RmsNorm (last axis, one output)
    SkipSimplifiedLayerNormalization(x, skip, scale)    => SkipRmsNorm (no bias; the sum
                                                           output kept, mean/inv-std unused)
    Mul(x, Sigmoid(x))                                  => Silu(x)

Anything else (another axis, a bias, a scale that is not a float32 constant of the last
dimension, a value used twice inside the pattern) stays onnxruntime's. The same graph runs
plain decoding and verification, so what the rewrite changes in the last bits is the same in
both: speculation stays exact.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

DOMAIN = "ai.dspark"


class GraphIndex:
    """Producers, consumers and constant values of a graph's tensors."""

    def __init__(self, graph: onnx.GraphProto, folder: Path):
        self.graph, self.folder = graph, folder
        self.producer = {o: n for n in graph.node for o in n.output}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for n in graph.node:
            for i in n.input:
                self.consumers.setdefault(i, []).append(n)
        self.outputs = {o.name for o in graph.output}
        self.inits = {i.name: i for i in graph.initializer}

    def constant(self, name: str) -> np.ndarray | None:
        if name in self.inits:
            return numpy_helper.to_array(self.inits[name], str(self.folder))
        node = self.producer.get(name)
        if node is not None and node.op_type == "Constant" and node.attribute:
            attr = node.attribute[0]
            if attr.name == "value":
                return numpy_helper.to_array(attr.t)
        return None

    def only_use(self, name: str) -> onnx.NodeProto | None:
        """The single node reading `name` (None if several, none, or a graph output)."""
        users = self.consumers.get(name, [])
        return users[0] if len(users) == 1 and name not in self.outputs else None

    def scale(self, name: str) -> bool:
        """A float32 vector held in the graph (its length is checked by the op)."""
        init = self.inits.get(name)
        if init is not None:
            return init.data_type == onnx.TensorProto.FLOAT and len(init.dims) == 1
        value = self.constant(name)
        return value is not None and value.dtype == np.float32 and value.ndim == 1


def attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _norm_from_pow(g: GraphIndex, pow_node: onnx.NodeProto):
    """(nodes to drop, x, scale, eps, output) of the exported RMS norm starting at `pow_node`."""
    x = pow_node.input[0]
    two = g.constant(pow_node.input[1])
    if two is None or two.size != 1 or float(two.reshape(())) != 2.0:
        return None
    mean = g.only_use(pow_node.output[0])
    if mean is None or mean.op_type != "ReduceMean" or attr(mean, "keepdims", 1) != 1:
        return None
    axes = attr(mean, "axes")
    if axes is None and len(mean.input) > 1:
        axes = g.constant(mean.input[1])
        axes = None if axes is None else [int(a) for a in axes.reshape(-1)]
    if axes is None or list(axes) != [-1]:
        return None
    add = g.only_use(mean.output[0])
    if add is None or add.op_type != "Add":
        return None
    eps_name = add.input[1] if add.input[0] == mean.output[0] else add.input[0]
    eps = g.constant(eps_name)
    if eps is None or eps.size != 1:
        return None
    sqrt = g.only_use(add.output[0])
    if sqrt is None or sqrt.op_type != "Sqrt":
        return None
    div = g.only_use(sqrt.output[0])
    if div is None or div.op_type != "Div" or list(div.input) != [x, sqrt.output[0]]:
        return None
    mul = g.only_use(div.output[0])
    if mul is None or mul.op_type != "Mul":
        return None
    scale = mul.input[0] if mul.input[1] == div.output[0] else mul.input[1]
    if not g.scale(scale):
        return None
    return [pow_node, mean, add, sqrt, div, mul], x, scale, float(eps.reshape(())), mul.output[0]


def rewrite_rows(model: onnx.ModelProto, folder: Path) -> int:
    """Rewrite `model` (its external data in `folder`) in place; how many norms and SiLUs
    became ours."""
    graph = model.graph
    g = GraphIndex(graph, folder)
    drop: set[int] = set()
    new: dict[int, onnx.NodeProto] = {}  # placed where the pattern's last node was
    for node in graph.node:
        if id(node) in drop:
            continue
        if node.op_type == "Pow":
            found = _norm_from_pow(g, node)
            if found is None:
                continue
            nodes, x, scale, eps, out = found
            drop.update(id(n) for n in nodes)
            new[id(nodes[-1])] = helper.make_node("RmsNorm", [x, scale], [out], domain=DOMAIN,
                                                  name=f"{nodes[-1].name}/dspark_rows_{len(new)}",
                                                  epsilon=eps)
        elif node.op_type == "SimplifiedLayerNormalization":
            if (attr(node, "axis", -1) != -1 or any(node.output[1:])
                    or not g.scale(node.input[1])):
                continue
            drop.add(id(node))
            new[id(node)] = helper.make_node(
                "RmsNorm", list(node.input[:2]), [node.output[0]], domain=DOMAIN,
                name=f"{node.name}/dspark_rows_{len(new)}",
                epsilon=float(attr(node, "epsilon", 1e-5)))
        elif node.op_type == "SkipSimplifiedLayerNormalization":
            bias = len(node.input) > 3 and node.input[3]
            outs = list(node.output) + [""] * (4 - len(node.output))
            if bias or outs[1] or outs[2] or not g.scale(node.input[2]):
                continue
            drop.add(id(node))
            new[id(node)] = helper.make_node(
                "SkipRmsNorm", list(node.input[:3]),
                [outs[0], outs[3] or f"{node.name}/dspark_sum_{len(new)}"], domain=DOMAIN,
                name=f"{node.name}/dspark_rows_{len(new)}",
                epsilon=float(attr(node, "epsilon", 1e-5)))
        elif node.op_type == "Sigmoid":
            x = node.input[0]
            mul = g.only_use(node.output[0])
            if mul is None or mul.op_type != "Mul" or sorted(mul.input) != sorted(
                    [x, node.output[0]]):
                continue
            drop.update((id(node), id(mul)))
            new[id(mul)] = helper.make_node("Silu", [x], [mul.output[0]], domain=DOMAIN,
                                            name=f"{mul.name}/dspark_rows_{len(new)}")
    return place(model, drop, new)


def place(model: onnx.ModelProto, drop: set[int], new: dict[int, onnx.NodeProto]) -> int:
    """The graph without the nodes in `drop` (ids), each of `new` in its key node's place,
    our domain imported; how many are new."""
    if not new:
        return 0
    graph = model.graph
    nodes = [new.get(id(n), n) for n in graph.node if id(n) not in drop or id(n) in new]
    del graph.node[:]
    graph.node.extend(nodes)
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return len(new)
