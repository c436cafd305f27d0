"""Float zero points in the form onnxruntime runs fast: a MatMulNBits with a float zero point
per block becomes one with the zero points rounded to uint8 plus what the rounding moved,
the same function (runtime/model/zero_points.py)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from dspark.runtime.model.sessions import make_session
from dspark.runtime.model.zero_points import split_float_zero_points

K, N, BLOCK = 96, 40, 32


def _model(bits: int, accuracy: int, zp_dtype=np.float32, share_input: bool = True
           ) -> onnx.ModelProto:
    rng = np.random.default_rng(bits)
    blocks = K // BLOCK
    inits, nodes, outputs = [], [], []
    for j in range(2):
        codes = rng.integers(0, 256, (N, blocks, BLOCK * bits // 8), dtype=np.uint8)
        scales = (rng.random(N * blocks) * 0.02 + 0.001).astype(np.float32)
        # some beyond the codes' range (a block all above or all below zero)
        zp = (rng.random(N * blocks) * (2 ** bits + 3) - 2).astype(zp_dtype)
        inits += [numpy_helper.from_array(codes, f"B{j}"), numpy_helper.from_array(scales, f"S{j}"),
                  numpy_helper.from_array(zp, f"Z{j}")]
        x = "x" if share_input or j == 0 else "x2"
        nodes.append(helper.make_node("MatMulNBits", [x, f"B{j}", f"S{j}", f"Z{j}"], [f"y{j}"],
                                      name=f"proj{j}", domain="com.microsoft", K=K, N=N,
                                      bits=bits, block_size=BLOCK, accuracy_level=accuracy))
        outputs.append(helper.make_tensor_value_info(f"y{j}", TensorProto.FLOAT, None))
    if not share_input:
        nodes.insert(0, helper.make_node("Neg", ["x"], ["x2"]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [1, "T", K])], outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                   helper.make_opsetid("com.microsoft", 1)])


def _run(model: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    return make_session(model.SerializeToString()).run(None, {"x": x})


@pytest.mark.parametrize("share_input", [True, False])
def test_the_split_computes_the_same_function(share_input):
    # accuracy level 0: every term in float32, so only the summation order differs
    model = _model(4, 0, share_input=share_input)
    x = np.random.default_rng(1).standard_normal((1, 5, K)).astype(np.float32)
    before = _run(model, x)
    assert split_float_zero_points(model, ".") == 2
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("MatMulNBits") == 2
    inits = {t.name: t for t in model.graph.initializer}
    zps = [inits[n.input[3]] for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert all(t.data_type == TensorProto.UINT8 for t in zps)  # no float zero points left
    assert not {t.name for t in model.graph.initializer} & {"Z0", "Z1"}
    assert ops.count("MatMul") == (3 if share_input else 4)  # block sums shared per input
    for a, b in zip(before, _run(model, x)):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4 * np.abs(a).max())


def test_at_accuracy_level_4_it_differs_by_int8_inputs_only():
    model = _model(4, 4)
    x = np.random.default_rng(2).standard_normal((1, 3, K)).astype(np.float32)
    exact = _run(_model(4, 0), x)
    split_float_zero_points(model, ".")
    for a, b in zip(exact, _run(model, x)):
        assert np.abs(b - a).max() < 0.02 * np.abs(a).max()


def test_float16_zero_points_and_other_nodes_are_left_as_they_were():
    model = _model(4, 0, zp_dtype=np.float16)
    x = np.random.default_rng(3).standard_normal((1, 2, K)).astype(np.float32)
    before = _run(model, x)
    assert split_float_zero_points(model, ".") == 2
    for a, b in zip(before, _run(model, x)):
        np.testing.assert_allclose(b, a, rtol=1e-3, atol=1e-3 * np.abs(a).max())
    plain = _model(4, 0)
    for node in plain.graph.node:
        del node.input[3:]
    assert split_float_zero_points(plain, ".") == 0
