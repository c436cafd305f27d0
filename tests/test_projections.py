"""Sibling int4 projections joined into one MatMulNBits and a Split (compiler/passes/
projections.py): same outputs bit for bit, fewer ops, only what can be joined. The SmolLM2
sample bundle (test_smollm2) compiles its int4 draft through the pass and is verified and
generated with."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto, helper, numpy_helper

from dspark.compiler.passes.projections import fuse_projections
from dspark.runtime.model.sessions import make_session

K, BLOCK = 64, 16


def _nbits(rng, name: str, x: str, n: int, level: int, block: int = BLOCK, bias: bool = False,
           zero_points: str | None = None):
    """zero_points: None, "uint8" (packed two a byte, as B) or "float" (one a block)."""
    blocks = K // block
    inits = [numpy_helper.from_array(rng.integers(0, 256, (n, blocks, block // 2), np.uint8),
                                     f"{name}_B"),
             numpy_helper.from_array(rng.uniform(0.01, 0.1, n * blocks).astype(np.float32),
                                     f"{name}_s")]
    inputs = [x, f"{name}_B", f"{name}_s"]
    if zero_points == "uint8":
        packed = rng.integers(0, 256, (n, (blocks + 1) // 2), np.uint8)
        inits.append(numpy_helper.from_array(packed.reshape(-1), f"{name}_zp"))
        inputs.append(f"{name}_zp")
    elif zero_points == "float":
        mins = rng.uniform(0.0, 15.0, n * blocks).astype(np.float32)
        inits.append(numpy_helper.from_array(mins, f"{name}_zp"))
        inputs.append(f"{name}_zp")
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(n).astype(np.float32),
                                             f"{name}_bias"))
        inputs += ["", "", f"{name}_bias"]
    node = helper.make_node("MatMulNBits", inputs, [name], domain="com.microsoft", K=K, N=n,
                            bits=4, block_size=block, accuracy_level=level)
    return node, inits


def _model(level: int, extra: list[tuple[str, dict]], zero_points: str | None = None
           ) -> onnx.ModelProto:
    rng = np.random.default_rng(level)
    nodes, inits, outs = [], [], []
    for name, n in (("q", 32), ("k", 16), ("v", 16)):
        node, i = _nbits(rng, name, "x", n, level, zero_points=zero_points)
        nodes.append(node)
        inits += i
        outs.append(name)
    for name, kw in extra:
        node, i = _nbits(rng, name, "x", 16, level, **kw)
        nodes.append(node)
        inits += i
        outs.append(name)
    # a consumer of a projection, as attention would be
    nodes.append(helper.make_node("Add", ["q", "q"], ["q2"]))
    f = TensorProto.FLOAT
    graph = helper.make_graph(
        nodes, "projections", [helper.make_tensor_value_info("x", f, ["M", K])],
        [helper.make_tensor_value_info(o, f, None) for o in outs + ["q2"]], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                   helper.make_opsetid("com.microsoft", 1)])


def _run(model: onnx.ModelProto, x: np.ndarray) -> dict[str, np.ndarray]:
    sess = make_session(model.SerializeToString())
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {"x": x})))


@pytest.mark.parametrize("level", [0, 4])
def test_joined_projections_compute_the_same_values(level):
    """q, k, v join; a sibling with a bias and one with another block size stay apart."""
    model = _model(level, [("biased", {"bias": True}), ("coarse", {"block": 32})])
    graph = gs.import_onnx(model)
    assert fuse_projections(graph) == 2
    fused = gs.export_onnx(graph)
    ops = Counter(n.op_type for n in fused.graph.node)
    assert ops["MatMulNBits"] == 3 and ops["Split"] == 1  # q|k|v, biased, coarse
    x = np.random.default_rng(7).standard_normal((5, K)).astype(np.float32)
    want, got = _run(model, x), _run(fused, x)
    assert want.keys() == got.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.parametrize("zero_points", ["uint8", "float"])
def test_projections_with_zero_points_join(zero_points):
    """A GGUF Q4_1 model's projections carry mins (float zero points); packed uint8 ones
    join too. Siblings with zero points of another kind, or none, stay apart."""
    other = "float" if zero_points == "uint8" else "uint8"
    model = _model(4, [("plain", {}), ("other", {"zero_points": other})], zero_points)
    graph = gs.import_onnx(model)
    assert fuse_projections(graph) == 2
    fused = gs.export_onnx(graph)
    assert Counter(n.op_type for n in fused.graph.node)["MatMulNBits"] == 3
    x = np.random.default_rng(3).standard_normal((4, K)).astype(np.float32)
    want, got = _run(model, x), _run(fused, x)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_a_lone_projection_is_left_alone():
    rng = np.random.default_rng(1)
    node, inits = _nbits(rng, "q", "x", 32, 4)
    f = TensorProto.FLOAT
    graph = gs.import_onnx(helper.make_model(helper.make_graph(
        [node], "one", [helper.make_tensor_value_info("x", f, ["M", K])],
        [helper.make_tensor_value_info("q", f, None)], inits),
        opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]))
    assert fuse_projections(graph) == 0
    assert [n.op for n in graph.nodes] == ["MatMulNBits"]
