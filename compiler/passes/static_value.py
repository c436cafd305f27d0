"""The value of a tensor computed from constants and the static dims of shapes.

Exporters sometimes compute a constant at run time. optimum's GPT-2 (transformers 4's SDPA
path) scales q and k each by sqrt(1 / sqrt(head_dim)), with head_dim read as
`Shape(q)[-1:]`:

    q --Shape--> Slice(-1:) --Cast--> Sqrt --> Div(1, .) --> Sqrt --> Mul(k^T, .)

The head dim is static (shape inference knows it) while the batch and sequence dims are not,
so each step is evaluated here with dims unknown as None; a value that needs one is None.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

_UNARY = {"Sqrt": np.sqrt, "Reciprocal": np.reciprocal, "Neg": np.negative,
          "Identity": lambda x: x}
_BINARY = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": np.divide,
           "Pow": np.power}
_DEPTH = 24


def _known(values: np.ndarray | None) -> np.ndarray | None:
    """values as numbers, or None if any entry is an unknown dim."""
    if values is None or (values.dtype == object and any(v is None for v in values.flat)):
        return None
    return values.astype(np.int64) if values.dtype == object else values


def _ints(t: gs.Tensor) -> list[int] | None:
    v = _known(_value(t, 0))
    return None if v is None else [int(x) for x in np.atleast_1d(v)]


def _shape(node: gs.Node) -> np.ndarray | None:
    shape = node.inputs[0].shape
    if shape is None:
        return None
    dims = np.array([d if isinstance(d, int) and d >= 0 else None for d in shape], dtype=object)
    start, end = node.attrs.get("start", 0), node.attrs.get("end", len(dims))
    return dims[start:end]


def _slice(node: gs.Node, data: np.ndarray) -> np.ndarray | None:
    """Slice (opset 10+: bounds as inputs) of a 1-D value along its one axis."""
    if len(node.inputs) < 3 or data.ndim != 1:
        return None
    starts, ends = _ints(node.inputs[1]), _ints(node.inputs[2])
    axes = _ints(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3].name else [0]
    steps = _ints(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4].name else [1]
    if None in (starts, ends, axes, steps) or axes not in ([0], [-1]):
        return None
    return data[starts[0]:ends[0]:steps[0]]


def _value(t: gs.Tensor, depth: int) -> np.ndarray | None:
    if isinstance(t, gs.Constant):
        return np.asarray(t.values)
    if depth > _DEPTH or len(t.inputs) != 1:
        return None
    node = t.inputs[0]
    if node.op == "Shape":
        return _shape(node)
    inputs = [_value(x, depth + 1) if x.name else None for x in node.inputs]
    if not inputs or inputs[0] is None:
        return None
    x = inputs[0]
    if node.op == "Slice":
        return _slice(node, x)
    if node.op == "Gather":
        index = _known(inputs[1])
        if index is None or x.ndim != 1:
            return None
        return np.asarray(np.take(x, index), dtype=x.dtype)
    if node.op in ("Squeeze", "Unsqueeze", "Reshape", "Concat") or node.op in _BINARY:
        if any(v is None for v in inputs):
            return None
        if node.op == "Concat":
            return np.concatenate(inputs, axis=node.attrs.get("axis", 0))
        if node.op not in _BINARY:
            return x.reshape(-1) if x.size == 1 else None  # scalars and [1] only
        a, b = _known(x), _known(inputs[1])
        return None if a is None or b is None else _BINARY[node.op](a, b)
    x = _known(x)
    if x is None:
        return None
    if node.op == "Cast":
        return x.astype(onnx.helper.tensor_dtype_to_np_dtype(node.attrs["to"]))
    return _UNARY[node.op](x) if node.op in _UNARY else None


def static_scalar(t: gs.Tensor) -> float | None:
    """t's value if it is one number that needs no run-time dim, else None."""
    v = _known(_value(t, 0))
    if v is None or v.size != 1 or v.dtype.kind not in "fiu":
        return None
    return float(v.reshape(()))
