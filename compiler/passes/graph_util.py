"""Small graphsurgeon helpers shared by the rewrite passes."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs


def replace_uses(graph: gs.Graph, old: gs.Tensor, new: gs.Tensor) -> None:
    """Every consumer of `old` (and the graph outputs) reads `new` instead."""
    for consumer in list(old.outputs):
        for i, t in enumerate(consumer.inputs):
            if t is old:
                consumer.inputs[i] = new
    graph.outputs = [new if t is old else t for t in graph.outputs]


def producer(t: gs.Tensor, op: str) -> gs.Node | None:
    """The node of type `op` that makes `t`, if one does."""
    if isinstance(t, gs.Variable) and len(t.inputs) == 1 and t.inputs[0].op == op:
        return t.inputs[0]
    return None


def cast_to(graph: gs.Graph, t: gs.Variable, dtype, name: str, shape=None) -> gs.Variable:
    """`t` as `dtype`: itself when it has that type, else a new Cast's output (of `shape`)."""
    if np.dtype(t.dtype) == np.dtype(dtype):
        return t
    out = gs.Variable(f"{name}/cast", dtype=np.dtype(dtype), shape=shape)
    graph.nodes.append(gs.Node("Cast", f"{name}/Cast", {"to": onnx.helper.np_dtype_to_tensor_dtype(
        np.dtype(dtype))}, inputs=[t], outputs=[out]))
    return out
