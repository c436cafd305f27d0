"""compiler/passes/static_value.py: values computed at run time from constants and static dims
(optimum's GPT-2 scale), and None wherever a run-time dim is needed."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from dspark.compiler.passes.static_value import static_scalar


def _node(op: str, inputs: list, dtype=np.int64, **attrs) -> gs.Variable:
    out = gs.Variable(f"{op}_{id(inputs)}", dtype)
    gs.Node(op, attrs=attrs, inputs=inputs, outputs=[out])
    return out


def _ints(*values: int) -> gs.Constant:
    return gs.Constant(f"c{values}_{np.random.default_rng().integers(1 << 30)}",
                       np.array(values, np.int64))


def _query() -> gs.Variable:
    return gs.Variable("q", np.float32, [1, 4, "sequence", 16])


def test_optimums_gpt2_scale_is_read_off_the_static_head_dim():
    """sqrt(1 / sqrt(Shape(q)[-1:])), as transformers 4's SDPA path traces it."""
    dim = _node("Slice", [_node("Shape", [_query()]), _ints(-1), _ints(2 ** 62)])
    root = _node("Sqrt", [_node("Cast", [dim], np.float32, to=1)], np.float32)
    inverse = _node("Div", [gs.Constant("one", np.array([1.0], np.float32)), root], np.float32)
    assert static_scalar(_node("Sqrt", [inverse], np.float32)) == 0.5


def test_a_value_that_needs_a_run_time_dim_is_none():
    sequence = _node("Gather", [_node("Shape", [_query()]), gs.Constant("i", np.array(2))])
    assert static_scalar(sequence) is None
    heads = _node("Gather", [_node("Shape", [_query()]), gs.Constant("j", np.array(1))])
    assert static_scalar(heads) == 4
    picked_by_a_dim = _node("Gather", [_ints(7, 8, 9), sequence])
    assert static_scalar(picked_by_a_dim) is None
    assert static_scalar(_node("Mul", [heads, sequence])) is None
