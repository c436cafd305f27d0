"""Each compiler stage on its own: optimize, attention matching, binding, segments, weights."""

from __future__ import annotations

import io

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest

from dspark.compiler.contract import check_contract, load_header
from dspark.compiler.lazy_weights import import_lazy
from dspark.compiler.passes.attention import find_attentions
from dspark.compiler.passes.bind import Meaning, classify
from dspark.compiler.passes.optimize import optimize
from dspark.compiler.passes.probe import PROBE_SHAPES
from dspark.compiler.passes.segments import cut_segments
from dspark.compiler.weights import ALIGN, WeightStore
from dspark.runtime.bundle.spec import VERIFY_DOMAIN, VERIFY_OP


@pytest.fixture(scope="module")
def optimized(fixture_pairs, tmp_path_factory):
    """{(arch, form): (contract, graph of the optimized main)}"""
    out = {}
    for key, (main, _) in fixture_pairs.items():
        contract = check_contract(main, load_header(main))
        path = optimize(contract, tmp_path_factory.mktemp("opt"), "main")
        out[key] = (contract, import_lazy(path))
    return out


def test_optimize_folds_constants_and_types_every_tensor(optimized):
    for key, (_, graph) in optimized.items():
        assert not [n for n in graph.nodes if n.op == "Constant"], key
        untyped = [t.name for t in graph.tensors().values()
                   if isinstance(t, gs.Variable) and t.dtype is None]
        assert not untyped, (key, untyped[:5])


@pytest.mark.parametrize("form,terminal", [("classic", "MatMul"), ("dynamo", "Attention"),
                                           ("sdpa", "MatMul")])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_attention_found_in_every_layer(optimized, arch, form, terminal):
    """sdpa (optimum's form): q and k each scaled by sqrt(scale), a NaN guard after the
    Softmax; the match takes q before its scaling and folds it into the scale."""
    contract, graph = optimized[(arch, form)]
    matches = find_attentions(graph, contract)
    assert [m.layer for m in matches] == [0, 1, 2]
    for m in matches:
        assert m.terminal.op == terminal
        assert m.scale == pytest.approx(0.25)  # 1/sqrt(head_dim 16)
        assert not (m.q.inputs and m.q.inputs[0].op == "Mul" and len(m.q.outputs) == 1)
        # k_new and v_new feed present.i (concatenated after the past), q does not
        concat_inputs = {t.name for n in graph.nodes if n.op == "Concat" for t in n.inputs}
        assert m.k_new.name in concat_inputs and m.v_new.name in concat_inputs
        assert m.q.name not in concat_inputs


def test_classify_positions_constants_and_unknowns():
    pos1 = [s.past + np.arange(s.new) for s in PROBE_SHAPES]
    assert classify(pos1, PROBE_SHAPES) == Meaning("positions", 1)
    assert classify([p[None] for p in pos1], PROBE_SHAPES) == Meaning("positions", 2)
    const = classify([np.array([1, 2, 64])] * 3, PROBE_SHAPES)
    assert const.kind == "constant" and const.value.tolist() == [1, 2, 64]
    assert classify([np.array(s.past) for s in PROBE_SHAPES], PROBE_SHAPES) is None
    assert classify([np.arange(s.new) for s in PROBE_SHAPES], PROBE_SHAPES) is None
    total = [np.arange(s.past + s.new) for s in PROBE_SHAPES]
    assert classify(total, PROBE_SHAPES) is None


def _toy_graph():
    """x -> Relu -> SV0 -> Add(residual x) -> SV1 -> Neg -> logits"""
    x = gs.Variable("x", np.float32, [1, 2, 3, 4])
    a, b, c, d, e = (gs.Variable(n, np.float32) for n in "abcde")
    sv = dict(op=VERIFY_OP, domain=VERIFY_DOMAIN)
    nodes = [
        gs.Node("Relu", "relu", inputs=[x], outputs=[a]),
        gs.Node(name="sv0", inputs=[a, a, a], outputs=[b], **sv),
        gs.Node("Add", "add", inputs=[b, x], outputs=[c]),
        gs.Node(name="sv1", inputs=[c, c, c], outputs=[d], **sv),
        gs.Node("Neg", "neg", inputs=[d], outputs=[e]),
    ]
    return gs.Graph(nodes=nodes, inputs=[x], outputs=[e])


def test_cut_segments_at_verify_nodes():
    cuts, after = cut_segments(_toy_graph())
    assert [[n.name for n in c.nodes] for c in cuts] == [["relu"], ["add"], ["neg"]]
    assert after == {"sv0": 0, "sv1": 1}
    assert [t.name for t in cuts[0].inputs] == ["x"]
    assert [t.name for t in cuts[0].outputs] == ["a"]
    assert sorted(t.name for t in cuts[1].inputs) == ["b", "x"]  # x carried across the cut
    assert [t.name for t in cuts[1].outputs] == ["c"]
    assert [t.name for t in cuts[2].outputs] == ["e"]


def _model_with(*tensors):
    graph = onnx.helper.make_graph([], "g", [], [], list(tensors))
    return onnx.helper.make_model(graph)


def test_weight_store_places_each_name_once_page_aligned():
    big = onnx.numpy_helper.from_array(np.arange(1000, dtype=np.float32), "w")
    other = onnx.numpy_helper.from_array(np.ones(300, np.float32), "u")
    tiny = onnx.numpy_helper.from_array(np.ones(4, np.float32), "tiny")
    buf = io.BytesIO()
    store = WeightStore(buf, "weights.bin")
    m1, m2 = _model_with(big, tiny), _model_with(big, other)
    assert store.externalize(m1) == 1 and store.externalize(m2) == 2
    refs = {}
    for t in list(m1.graph.initializer) + list(m2.graph.initializer):
        if t.data_location == onnx.TensorProto.EXTERNAL:
            ext = {e.key: e.value for e in t.external_data}
            refs.setdefault(t.name, set()).add((ext["offset"], ext["length"]))
    assert refs == {"w": {("0", "4000")}, "u": {(str(ALIGN), "1200")}}
    data = buf.getvalue()
    assert len(data) == ALIGN + 1200
    assert np.array_equal(np.frombuffer(data[:4000], np.float32), np.arange(1000))
    assert m1.graph.initializer[1].raw_data  # tiny tensors stay inline


def test_weights_stay_in_their_file_through_the_passes_and_are_copied_once(tmp_path):
    """compiler/lazy_weights.py: imported, a weight is a reference to its file (read when a
    pass asks for its values); a session built on a piece of the graph gets it inline; the
    store copies it from its file, file to file, once, page-aligned, under its new name."""
    from dspark.compiler.lazy_weights import FileValues, import_lazy, session_bytes
    from dspark.runtime.model.sessions import make_session

    w = np.arange(2048, dtype=np.float32).reshape(32, 64)
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 32])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 64])
    graph = onnx.helper.make_graph([onnx.helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                                   [x], [y], [onnx.numpy_helper.from_array(w, "w")])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    onnx.save(model, str(tmp_path / "m.onnx"), save_as_external_data=True,
              location="m.weights", size_threshold=1024)
    lazy = import_lazy(tmp_path / "m.onnx")
    const = lazy.tensors()["w"]
    assert isinstance(const._values, FileValues)
    assert np.array_equal(const.values, w)
    session = make_session(session_bytes(lazy), level="none")  # no folder: the bytes hold w
    ones = np.ones((1, 32), np.float32)
    assert np.allclose(session.run(None, {"x": ones})[0], ones @ w)
    buf = io.BytesIO()
    store = WeightStore(buf, "weights.bin", source=tmp_path)
    exported = gs.export_onnx(lazy)
    assert store.externalize(exported) == 1 and store.externalize(gs.export_onnx(lazy)) == 1
    assert buf.getvalue() == w.tobytes()  # placed once
    ext = {e.key: e.value for e in exported.graph.initializer[0].external_data}
    assert ext == {"location": "weights.bin", "offset": "0", "length": str(w.nbytes)}
    assert lazy.tensors()["w"]._values.tensor.external_data[0].value == "m.weights"
