"""Fold run-time shape arithmetic to constants, read off the probes.

Exporters compute reshape targets and slice bounds from `Shape` of live tensors every step:

    x --Shape--> Gather(1) --Unsqueeze--+
                 Gather(0) --Unsqueeze--+--Concat--> Reshape(q, [1, T, 9, 64])
                 Constant [9, 64] ------+
Once the runtime owns the cache and always runs one flattened row, such a tensor is either
a constant (head_dim // 2 for rotary's Slice) or a reshape target in which only the token
count moves. The probes say which: a constant becomes an initializer; a Reshape whose
output shape moves in one dim only gets the constant target with -1 there (onnxruntime
infers the same number), and the Shape/Gather/Concat chains go dead. Only tensors computed
from shapes are considered, never from data, so a value that merely repeats across the
probes is not mistaken for a constant. A tensor the probes cannot explain stays computed.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from dspark.compiler.passes.graph_util import replace_uses

_INT_TYPES = (np.dtype(np.int64), np.dtype(np.int32))
_SOURCES = ("Shape", "Size")


def shape_derived(graph: gs.Graph) -> dict[str, int]:
    """Integer tensors computed only from tensor shapes and constants: name -> onnx type."""
    graph.toposort()
    derived: set[str] = set()
    out = {}
    for node in graph.nodes:
        live = [t for t in node.inputs if isinstance(t, gs.Variable) and t.name]
        if node.op not in _SOURCES and not (live and all(t.name in derived for t in live)):
            continue
        for t in node.outputs:
            derived.add(t.name)
            if t.dtype is not None and np.dtype(t.dtype) in _INT_TYPES:
                out[t.name] = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(t.dtype))
    return out


def reshaped(graph: gs.Graph) -> dict[str, int]:
    """Outputs of Reshapes whose target is computed: name -> onnx type (probe their shapes)."""
    return {n.outputs[0].name: onnx.helper.np_dtype_to_tensor_dtype(np.dtype(n.outputs[0].dtype))
            for n in graph.nodes if n.op == "Reshape" and isinstance(n.inputs[1], gs.Variable)
            and n.outputs[0].dtype is not None}


def reshape_target(shapes: list[tuple[int, ...]]) -> np.ndarray | None:
    """The constant target giving these output shapes: -1 at the one entry that moves
    (onnxruntime infers the same number); None if none or several move, or a dim is 0."""
    first = shapes[0]
    if any(len(s) != len(first) or 0 in s for s in shapes):
        return None
    moving = [i for i in range(len(first)) if any(s[i] != first[i] for s in shapes)]
    if len(moving) != 1:
        return None
    target = np.array(first, np.int64)
    target[moving[0]] = -1
    return target


def fold_shapes(graph: gs.Graph, samples: dict[str, list[np.ndarray]], role: str) -> int:
    """Constant reshape targets and constant shape arithmetic, from the probes' `samples` of
    `shape_derived` and `reshaped` tensors; returns how many tensors were replaced."""
    folded = 0
    for node in list(graph.nodes):
        out = node.outputs[0] if node.outputs else None
        if node.op == "Reshape" and isinstance(node.inputs[1], gs.Variable) and out.name in samples:
            target = reshape_target([s.shape for s in samples[out.name]])
            if target is not None:
                node.inputs[1] = gs.Constant(f"/{role}/fold/{out.name.strip('/')}/shape", target)
                folded += 1
    derived = shape_derived(graph)
    for node in list(graph.nodes):
        for t in node.outputs:
            values = samples.get(t.name) if t.name in derived and t.outputs else None
            if values is None or any(v.shape != values[0].shape or not np.array_equal(
                    v, values[0]) for v in values):
                continue
            name = f"/{role}/fold/{t.name.strip('/')}"
            value = np.asarray(values[0], dtype=np.dtype(t.dtype))
            replace_uses(graph, t, gs.Constant(name, value))
            folded += 1
    graph.cleanup()
    return folded
