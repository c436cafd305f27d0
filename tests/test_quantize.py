"""dsc quantize (compiler/quantize.py): a draft from a main, its projections in 4-bit blocks
with mins and its head in 8-bit blocks; exact where the weights sit on those grids (the
sample's SmolLM2: llama.cpp Q4_1 projections, a Q8_0 head), each block's range kept
elsewhere; onnxruntime runs the result; bad input gets a one-line error."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from dspark.compiler.quantize import q4_min, q8, quantize_file, quantize_model
from dspark.runtime.model.sessions import make_session

from cli_helpers import run_dsc


def _q4_1_grid(rng, k: int, n: int) -> np.ndarray:
    """[K, N] weights as llama.cpp's Q4_1 dequantizes them: per block of 32 along K,
    float16 scale * q + float16 min, q 0..15 with both ends used."""
    q = rng.integers(0, 16, (n, k // 32, 32)).astype(np.float32)
    q[..., 0], q[..., 1] = 0, 15
    scale = (rng.random((n, k // 32)) * 0.02 + 1e-3).astype(np.float16).astype(np.float32)
    low = (-rng.random((n, k // 32)) * 0.2).astype(np.float16).astype(np.float32)
    return (scale[..., None] * q + low[..., None]).astype(np.float32).reshape(n, k).T.copy()


def _q8_0_grid(rng, k: int, n: int) -> np.ndarray:
    q = rng.integers(-127, 128, (n, k // 32, 32)).astype(np.float32)
    q[..., 0] = 127
    scale = (rng.random((n, k // 32)) * 0.01 + 1e-3).astype(np.float16).astype(np.float32)
    return (scale[..., None] * q).astype(np.float32).reshape(n, k).T.copy()


def _model(w1: np.ndarray, w2: np.ndarray, w_odd: np.ndarray) -> onnx.ModelProto:
    """x -> MatMul(w1) -> MatMul(w_odd, K not a multiple of 32, side output) and
    MatMul(w2) -> logits (the head: it writes a graph output)."""
    k = w1.shape[0]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="proj"),
             helper.make_node("MatMul", ["h", "w2"], ["logits"], name="head"),
             helper.make_node("Slice", ["h", "starts", "ends", "axes"], ["h40"], name="cut"),
             helper.make_node("MatMul", ["h40", "w_odd"], ["side"], name="odd")]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", k])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["rows", w2.shape[1]]),
         helper.make_tensor_value_info("side", TensorProto.FLOAT, ["rows", w_odd.shape[1]])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2"),
         numpy_helper.from_array(w_odd, "w_odd"),
         numpy_helper.from_array(np.array([0], np.int64), "starts"),
         numpy_helper.from_array(np.array([40], np.int64), "ends"),
         numpy_helper.from_array(np.array([1], np.int64), "axes")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def _run(model: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    return make_session(model.SerializeToString()).run(None, {"x": x})


def test_weights_on_the_grids_are_held_exactly():
    rng = np.random.default_rng(0)
    w1, w2 = _q4_1_grid(rng, 64, 96), _q8_0_grid(rng, 96, 50)
    w_odd = rng.standard_normal((40, 8)).astype(np.float32)
    model = _model(w1, w2, w_odd)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    before = _run(model, x)
    report = quantize_model(model)
    assert (report.projections, report.exact, report.head, report.kept) == (2, 2, "head", 1)
    ops = {n.name: (n.op_type, {a.name: helper.get_attribute_value(a) for a in n.attribute})
           for n in model.graph.node}
    assert ops["proj_Q4"][0] == "MatMulNBits" and ops["proj_Q4"][1]["bits"] == 4
    assert ops["head_Q8"][1]["bits"] == 8 and ops["odd"][0] == "MatMul"
    assert not {"w1", "w2"} & {t.name for t in model.graph.initializer}
    after = _run(model, x)
    # the 4-bit projection with float zero points: onnxruntime computes it in float32
    np.testing.assert_allclose(after[1], before[1], rtol=1e-5, atol=1e-5)
    # the head at accuracy level 4 quantizes its input to int8: close, not equal
    assert np.abs(after[0] - before[0]).max() <= 2e-2 * np.abs(before[0]).max()


def test_blocks_round_trip_on_the_grid_and_keep_their_range_off_it():
    rng = np.random.default_rng(1)
    w = _q4_1_grid(rng, 96, 20)
    packed, scales, zero, exact = q4_min(w)
    assert exact and packed.shape == (20, 3, 16) and scales.shape == zero.shape == (60,)
    w = rng.standard_normal((96, 20)).astype(np.float32)
    packed, scales, zero, exact = q4_min(w)
    assert not exact
    q = np.empty((20, 3, 32), np.float32)
    q[..., 0::2], q[..., 1::2] = packed & 15, packed >> 4
    d = scales.reshape(20, 3, 1)
    deq = d * (q - zero.reshape(20, 3, 1))
    blocks = w.T.reshape(20, 3, 32)
    assert np.all(np.abs(deq - blocks) <= 0.5 * d * 1.01 + 1e-3)  # float16 scale and min
    b8, s8, exact8 = q8(_q8_0_grid(rng, 64, 10))
    assert exact8 and b8.shape == (10, 2, 32) and s8.shape == (20,)
    b8, s8, exact8 = q8(w)
    assert not exact8
    deq8 = s8.reshape(20, 3, 1) * (b8.astype(np.float32) - 128)
    assert np.all(np.abs(deq8 - blocks) <= 0.5 * s8.reshape(20, 3, 1) * 1.01 + 1e-4)


def test_cli_writes_the_draft_and_refuses_bad_input(capsys, tmp_path):
    rng = np.random.default_rng(2)
    main = tmp_path / "main.onnx"
    onnx.save(_model(_q4_1_grid(rng, 64, 96), _q8_0_grid(rng, 96, 50),
                     rng.standard_normal((40, 8)).astype(np.float32)), str(main))
    out = tmp_path / "draft.onnx"
    r = run_dsc(capsys, "quantize", str(main), "-o", str(out))
    assert r.code == 0 and "2 projections quantized, 2 of them exactly" in r.out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft.onnx", "main.onnx"]
    assert sum(n.op_type == "MatMulNBits" for n in onnx.load(str(out)).graph.node) == 2
    r = run_dsc(capsys, "quantize", str(main), "-o", str(out))  # exists, no --force
    assert r.code == 2 and "exists" in r.err
    r = run_dsc(capsys, "quantize", str(tmp_path / "none.onnx"), "-o", str(tmp_path / "x"))
    assert r.code == 2 and "none.onnx: no such file" in r.err
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"not a model")
    r = run_dsc(capsys, "quantize", str(junk), "-o", str(tmp_path / "x.onnx"))
    assert r.code == 2 and "junk.onnx: not a readable ONNX model" in r.err
    assert not (tmp_path / "x.onnx").exists() and not list(tmp_path.glob(".x.onnx*"))


def test_a_model_without_projections_is_refused(tmp_path):
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
    path = tmp_path / "relu.onnx"
    onnx.save(helper.make_model(graph), str(path))
    with pytest.raises(Exception, match="no MatMul with a float"):
        quantize_file(path, tmp_path / "out.onnx")
    assert not (tmp_path / "out.onnx").exists()


def test_the_embedding_goes_to_8_bits_exactly_on_its_grid():
    """A Gather of a float table by input_ids becomes GatherBlockQuantized (8 bits, blocks
    of 32 along the hidden axis): a Q8_0 table is held exactly, and onnxruntime gathers the
    same rows."""
    rng = np.random.default_rng(4)
    table = _q8_0_grid(rng, 64, 50).T.copy()  # [V=50, d=64], Q8_0 blocks along d
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "input_ids"], ["e"], name="embed"),
         helper.make_node("MatMul", ["e", "w"], ["logits"], name="head")], "g",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(table, "table"),
         numpy_helper.from_array(_q8_0_grid(rng, 64, 50), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    before = make_session(model.SerializeToString()).run(None, {"input_ids": [[3, 7, 49]]})[0]
    report = quantize_model(model)
    assert report.embedding == "embed" and report.embedding_exact
    assert [n.op_type for n in model.graph.node] == ["GatherBlockQuantized", "MatMulNBits"]
    assert "table" not in {t.name for t in model.graph.initializer}
    after = make_session(model.SerializeToString()).run(None, {"input_ids": [[3, 7, 49]]})[0]
    np.testing.assert_allclose(after, before, rtol=1e-4, atol=1e-4)
