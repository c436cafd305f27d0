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
# Ops whose output shape follows their input values, not their input shapes (a mixture of
# experts' routing: NonZero picks each expert's tokens), and the inputs by which the
# shape-taking ops set their output's shape.
_DATA_SHAPED = ("NonZero", "Unique", "Compress", "NonMaxSuppression", "Loop", "Scan", "If")
_SHAPE_ARGS = {"Reshape": (1,), "Expand": (1,), "Slice": (1, 2, 3, 4), "Range": (0, 1, 2),
               "ConstantOfShape": (0,), "Tile": (1,), "Pad": (1,), "TopK": (1,),
               "OneHot": (1,), "Resize": (3,), "Split": (1,)}


def _live(node: gs.Node) -> list[gs.Variable]:
    return [t for t in node.inputs if isinstance(t, gs.Variable) and t.name]


def _shapes(graph: gs.Graph) -> tuple[set[str], set[str]]:
    """(tensors computed only from shapes of tensors whose shapes follow the inputs' shapes,
    and constants; tensors whose shapes follow values)."""
    graph.toposort()
    derived: set[str] = set()
    by_data: set[str] = set()
    for node in graph.nodes:
        live = _live(node)
        args = [node.inputs[i] for i in _SHAPE_ARGS.get(node.op, ()) if i < len(node.inputs)]
        if (node.op in _DATA_SHAPED or any(t.name in by_data for t in live)
                or any(isinstance(t, gs.Variable) and t.name and t.name not in derived
                       for t in args)):
            by_data.update(t.name for t in node.outputs)
        if node.op in _SOURCES:
            if live and live[0].name not in by_data:
                derived.update(t.name for t in node.outputs)
        elif live and all(t.name in derived for t in live):
            derived.update(t.name for t in node.outputs)
    return derived, by_data


def shape_derived(graph: gs.Graph) -> dict[str, int]:
    """Integer tensors computed only from tensor shapes and constants: name -> onnx type.
    Shapes that follow values (a NonZero's, and everything computed from one) are left out:
    the probes would see whatever their data happened to route."""
    derived, _ = _shapes(graph)
    return {t.name: onnx.helper.np_dtype_to_tensor_dtype(np.dtype(t.dtype))
            for n in graph.nodes for t in n.outputs
            if t.name in derived and t.dtype is not None and np.dtype(t.dtype) in _INT_TYPES}


def reshaped(graph: gs.Graph) -> dict[str, int]:
    """Outputs of Reshapes whose target is computed from shapes that follow the inputs'
    shapes: name -> onnx type (probe their shapes)."""
    _, by_data = _shapes(graph)
    return {n.outputs[0].name: onnx.helper.np_dtype_to_tensor_dtype(np.dtype(n.outputs[0].dtype))
            for n in graph.nodes if n.op == "Reshape" and isinstance(n.inputs[1], gs.Variable)
            and n.outputs[0].dtype is not None and n.outputs[0].name not in by_data}


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
