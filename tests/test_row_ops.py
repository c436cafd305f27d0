"""RmsNorm, SkipRmsNorm and Silu (kernels/cpu_rows.c) and the rewrite that uses them
(runtime/model/row_ops.py).

Each exported pattern, rewritten, against numpy and against onnxruntime running the graph as
it was; every row computed alone gives the bits it gets among other rows, at any offset and
on the pool's path for a prompt's many rows, with the library's solo switch on or off (what
keeps a verify's rows equal to the decodes'); what the ops cannot run stays as it was.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from cpu_builds import library_for, marches
from onnx import TensorProto, helper, numpy_helper

from dspark.kernels.cpu_op import solo_ops
from dspark.runtime.model.row_ops import rewrite_rows
from dspark.runtime.model.sessions import make_session

F = TensorProto.FLOAT
EPS = 1e-5


@pytest.fixture(scope="module", params=marches())
def library(request):
    """This CPU's build, and on x86-64 with AVX-512 the AVX2 one (DSPARK_CPU_MARCH)."""
    return library_for(request.param)


def _model(nodes, inputs, dim: int, inits, opsets=(("", 17),)) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(n, F, ["rows", dim]) for n in inputs],
        [helper.make_tensor_value_info("y", F, None)], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])


def _exported_norm(dim: int, scale: np.ndarray, exponent: float = 2.0, axes=(-1,)):
    """An RMS norm as torch exports it: Pow, ReduceMean, Add, Sqrt, Div, Mul."""
    inits = [numpy_helper.from_array(np.array(exponent, np.float32), "two"),
             numpy_helper.from_array(np.array(EPS, np.float32), "eps"),
             numpy_helper.from_array(scale, "w")]
    nodes = [helper.make_node("Pow", ["x", "two"], ["p"]),
             helper.make_node("ReduceMean", ["p"], ["m"], axes=list(axes), keepdims=1),
             helper.make_node("Add", ["m", "eps"], ["a"]),
             helper.make_node("Sqrt", ["a"], ["s"]),
             helper.make_node("Div", ["x", "s"], ["d"]),
             helper.make_node("Mul", ["w", "d"], ["y"])]
    return _model(nodes, ["x"], dim, inits)


def _silu_model(dim: int, twice: bool = False):
    nodes = [helper.make_node("Sigmoid", ["x"], ["s"]), helper.make_node("Mul", ["x", "s"], ["m"])]
    nodes.append(helper.make_node("Add", ["m", "s"], ["y"]) if twice
                 else helper.make_node("Identity", ["m"], ["y"]))
    return _model(nodes, ["x"], dim, [])


def _norm(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    x64 = x.astype(np.float64)
    return (x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + EPS) * w).astype(np.float32)


def _run(model: onnx.ModelProto, library, feeds: dict) -> np.ndarray:
    return make_session(model.SerializeToString(), custom_ops=library).run(None, feeds)[0]


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


@pytest.mark.parametrize("dim", [16, 37, 576])
def test_exported_norm_and_silu_become_ours_and_agree(library, dim, tmp_path):
    rng = np.random.default_rng(dim)
    x = rng.standard_normal((5, dim)).astype(np.float32) * 3
    w = rng.standard_normal(dim).astype(np.float32)
    norm = _exported_norm(dim, w)
    before = _run(norm, None, {"x": x})
    assert rewrite_rows(norm, tmp_path) == 1 and _ops(norm) == ["RmsNorm"]
    after = _run(norm, library, {"x": x})
    np.testing.assert_allclose(after, _norm(x, w), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(after, before, rtol=2e-5, atol=2e-5)

    silu = _silu_model(dim)
    before = _run(silu, None, {"x": x})
    assert rewrite_rows(silu, tmp_path) == 1 and _ops(silu) == ["Silu", "Identity"]
    after = _run(silu, library, {"x": x})
    np.testing.assert_allclose(after, x / (1 + np.exp(-x.astype(np.float64))), rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-6)


def test_contrib_norms_become_ours_and_agree(library, tmp_path):
    """onnxruntime-genai's builder writes the norms as contrib ops already."""
    rng = np.random.default_rng(1)
    dim = 40
    x, skip = (rng.standard_normal((6, dim)).astype(np.float32) for _ in range(2))
    w = rng.standard_normal(dim).astype(np.float32)
    nodes = [helper.make_node("SkipSimplifiedLayerNormalization", ["x", "skip", "w"],
                              ["n", "", "", "sum"], domain="com.microsoft", epsilon=EPS),
             helper.make_node("SimplifiedLayerNormalization", ["sum", "w"], ["n2"], axis=-1,
                              epsilon=EPS),
             helper.make_node("Add", ["n", "n2"], ["y"])]
    model = _model(nodes, ["x", "skip"], dim, [numpy_helper.from_array(w, "w")],
                   opsets=(("", 17), ("com.microsoft", 1)))
    before = _run(model, None, {"x": x, "skip": skip})
    assert rewrite_rows(model, tmp_path) == 2
    assert _ops(model) == ["SkipRmsNorm", "RmsNorm", "Add"]
    after = _run(model, library, {"x": x, "skip": skip})
    expect = _norm(x + skip, w) * 2
    np.testing.assert_allclose(after, expect, rtol=5e-5, atol=5e-5)
    np.testing.assert_allclose(after, before, rtol=5e-5, atol=5e-5)


@pytest.mark.parametrize("solo", [False, True])
def test_a_row_has_the_same_bits_alone_among_others_and_on_the_pool(library, tmp_path, solo):
    """A verify's rows against the decodes that would have computed them one by one; 200
    rows of 576 take the pool's path (more than 65536 values) unless the switch is on."""
    dim = 576
    rng = np.random.default_rng(7)
    w = rng.standard_normal(dim).astype(np.float32)
    norm, silu = _exported_norm(dim, w), _silu_model(dim)
    for m in (norm, silu):
        rewrite_rows(m, tmp_path)
    sessions = [make_session(m.SerializeToString(), custom_ops=library) for m in (norm, silu)]
    x = (rng.standard_normal((200, dim)) * 4).astype(np.float32)
    switch = solo_ops(library)
    try:
        switch.set(solo)
        for s in sessions:
            many = s.run(None, {"x": x})[0]
            few = s.run(None, {"x": x[3:10]})[0]
            alone = np.concatenate([s.run(None, {"x": x[i:i + 1]})[0] for i in range(12)])
            assert np.array_equal(few, many[3:10])
            assert np.array_equal(alone, many[:12])
    finally:
        switch.set(False)


@pytest.mark.parametrize("case", ["cube", "other axis", "sigmoid used twice", "bias"])
def test_what_the_ops_cannot_run_stays(tmp_path, case):
    dim = 32
    w = np.ones(dim, np.float32)
    if case == "cube":
        model = _exported_norm(dim, w, exponent=3.0)
    elif case == "other axis":
        model = _exported_norm(dim, w, axes=(0,))
    elif case == "sigmoid used twice":
        model = _silu_model(dim, twice=True)
    else:
        model = _model([helper.make_node(
            "SkipSimplifiedLayerNormalization", ["x", "skip", "w", "w"], ["y"],
            domain="com.microsoft", epsilon=EPS)], ["x", "skip"], dim,
            [numpy_helper.from_array(w, "w")], opsets=(("", 17), ("com.microsoft", 1)))
    ops = _ops(model)
    assert rewrite_rows(model, tmp_path) == 0
    assert _ops(model) == ops


def test_a_scale_of_the_wrong_length_is_refused(library):
    model = _model([helper.make_node("RmsNorm", ["x", "w"], ["y"], domain="ai.dspark",
                                     epsilon=EPS)], ["x"], 8,
                   [numpy_helper.from_array(np.ones(5, np.float32), "w")],
                   opsets=(("", 17), ("ai.dspark", 1)))
    session = make_session(model.SerializeToString(), custom_ops=library)
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument,
                       match="scale must hold"):
        session.run(None, {"x": np.ones((2, 8), np.float32)})


def test_no_rows_give_no_rows(library):
    """A mixture of experts' expert that no token of a forward picked: x [0, dim], made inside
    the graph (onnxruntime gives such a tensor no buffer)."""
    dim = 16
    zero = numpy_helper.from_array(np.array([0], np.int64), "zero")
    empty = helper.make_node("Slice", ["rows", "zero", "zero", "zero"], ["x"])
    for op, inputs, outputs in (("RmsNorm", ["x", "w"], ["y"]), ("Silu", ["x"], ["y"]),
                                ("SkipRmsNorm", ["x", "x", "w"], ["y", "sum"])):
        model = _model([empty, helper.make_node(op, inputs, outputs, domain="ai.dspark",
                                                **({} if op == "Silu" else {"epsilon": EPS}))],
                       ["rows"], dim, [numpy_helper.from_array(np.ones(dim, np.float32), "w"),
                                       zero], opsets=(("", 17), ("ai.dspark", 1)))
        assert _run(model, library, {"rows": np.ones((3, dim), np.float32)}).shape == (0, dim)
