"""Stage-1 leanness: shape arithmetic folded, rotary fused, attention in token rows, on every
fixture architecture and export form. That the rewritten models still match the originals
is test_compile's `test_verify_matches_original_models` and the lossless generation tests
(same bundles)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest

from dspark.compiler.passes.fold_shapes import reshape_target
from dspark.compiler.passes.rotary import TableMaker, rotary_tables
from dspark.runtime.bundle.bundle import open_bundle
from dspark.runtime.bundle.spec import POSITION_IDS

from bundle_cache import compiled
from model_fixtures import PAIRS

SHAPE_OPS = {"Shape", "Size", "ConstantOfShape"}


def segment_ops(path, role: str = "main") -> Counter:
    bundle = open_bundle(path)
    ops = Counter()
    for seg in bundle.model(role).segments:
        model = onnx.load(str(bundle.path(seg.file)), load_external_data=False)
        ops.update(n.op_type for n in model.graph.node)
    return ops


@pytest.mark.parametrize("pair", PAIRS, ids=["-".join(p) for p in PAIRS])
def test_segments_compute_no_shapes_at_run_time(compiled, pair):
    for role in ("main", "draft"):
        ops = segment_ops(compiled[pair], role)
        assert not SHAPE_OPS & ops.keys(), (role, ops)
        assert ops["MatMul"] + ops["Gemm"] > 0


# gemma3's q/k RMSNorm sits between the head transpose and the rotary; the transpose moves
# past it (sink_transpose.py), except in the dynamo form, whose norm output the 3-D rotary
# cannot take (its attention runs heads-first)
TOKEN_ROW_PAIRS = [p for p in PAIRS if p != ("gemma3", "dynamo")]


@pytest.mark.parametrize("form", ["classic", "sdpa"])
def test_gemma_q_k_norm_lets_the_rotary_fuse(compiled, form):
    """Each q/k norm runs before the head transpose, so every rotary fuses (2 per layer)."""
    bundle = open_bundle(compiled[("gemma3", form)])
    report = bundle.manifest.stage1["main"]["passes"]
    assert report["transposes_sunk"] == 2 * 6 and report["rotary_fused"] == 2 * 6
    assert report["rotary_unfused"] == 0


@pytest.mark.parametrize("pair", TOKEN_ROW_PAIRS, ids=["-".join(p) for p in TOKEN_ROW_PAIRS])
def test_attention_reads_and_writes_token_rows_without_transposes(compiled, pair):
    for role in ("main", "draft"):
        spec = open_bundle(compiled[pair]).model(role)
        assert {op.layout for op in spec.verify_ops} == {"tokens"}, role
        assert "Transpose" not in segment_ops(compiled[pair], role)


def _attention_graph(extra_reader: bool, target: list[int]) -> gs.Graph:
    """q/k/v [1, T, 2, 8] transposed to heads-first into a SpeculativeVerify node, its
    result transposed back and reshaped to `target` (`extra_reader`: an Add reads the
    transposed result too)."""
    from dspark.runtime.bundle.spec import VERIFY_DOMAIN, VERIFY_OP

    graph = gs.Graph(opset=17)
    heads_first = []
    for name in "qkv":
        x = gs.Variable(f"{name}_rows", np.float32, [1, "T", 16])
        x4, y = gs.Variable(f"{name}_4d", np.float32), gs.Variable(name, np.float32)
        graph.inputs.append(x)
        graph.nodes += [
            gs.Node("Reshape", f"{name}_split", inputs=[
                x, gs.Constant(f"{name}_shape", np.array([1, -1, 2, 8]))], outputs=[x4]),
            gs.Node("Transpose", f"{name}_t", {"perm": [0, 2, 1, 3]}, [x4], [y])]
        heads_first.append(y)
    out, back, flat = (gs.Variable(n, np.float32) for n in ("out", "back", "flat"))
    graph.nodes += [
        gs.Node(VERIFY_OP, "/main/layers.0/attn/SpeculativeVerify", {
            "num_heads": 2, "num_kv_heads": 2, "head_dim": 8}, heads_first, [out],
            domain=VERIFY_DOMAIN),
        gs.Node("Transpose", "out_t", {"perm": [0, 2, 1, 3]}, [out], [back]),
        gs.Node("Reshape", "merge", inputs=[back, gs.Constant("merged", np.array(target))],
                outputs=[flat])]
    graph.outputs = [flat]
    if extra_reader:
        other = gs.Variable("other", np.float32)
        graph.nodes.append(gs.Node("Add", "reads_back", inputs=[back, back], outputs=[other]))
        graph.outputs.append(other)
    return graph


@pytest.mark.parametrize(("extra_reader", "target", "done", "reshapes"), [
    (False, [1, -1, 16], 1, 0),  # the merge is what the node now writes: it goes
    (False, [-1, 16], 1, 1),  # a 2-D merge stays, reading the node's rows
    (False, [0, 0, -1], 1, 0),  # copied dims agree in both layouts
    (False, [1, -1, 2, 8], 1, 1),
    (True, [1, -1, 16], 0, 4),  # something else reads the transposed result: left alone
])
def test_token_major_rewrite_or_left_alone(extra_reader, target, done, reshapes):
    from dspark.compiler.passes.verify_layout import token_major_verify

    graph = _attention_graph(extra_reader, target)
    assert token_major_verify(graph) == done
    [node] = [n for n in graph.nodes if n.op == "SpeculativeVerify"]
    assert node.attrs.get("layout", "heads") == ("tokens" if done else "heads")
    assert [n.op for n in graph.nodes].count("Reshape") == reshapes
    if done:
        assert [t.name for t in node.inputs] == ["q_rows", "k_rows", "v_rows"]
        assert "Transpose" not in {n.op for n in graph.nodes}


def test_classic_llama_rotary_is_one_op_per_q_and_k(compiled):
    ops = segment_ops(compiled[("llama", "classic")])
    assert ops["RotaryEmbedding"] == 2 * 3  # 3 layers
    assert not {"Neg", "Slice", "Concat"} & ops.keys(), ops
    spec = open_bundle(compiled[("llama", "classic")]).model("main")
    assert spec.max_positions == 2048  # the tables cover the default max_seq_len
    # no rotary tables, but its attention spans are proven to that length and no further
    assert open_bundle(compiled[("gpt2", "classic")]).model("main").max_positions == 2048


def test_reshape_target_moves_in_one_dim_only():
    assert reshape_target([(1, 3, 9, 64), (1, 4, 9, 64)]).tolist() == [1, -1, 9, 64]
    assert reshape_target([(1, 3, 576), (1, 5, 576), (1, 4, 576)]).tolist() == [1, -1, 576]
    assert reshape_target([(1, 3, 9), (2, 4, 9)]) is None  # two dims move
    assert reshape_target([(1, 3, 9), (1, 3, 9)]) is None  # nothing moves: a constant
    assert reshape_target([(0, 3, 9), (0, 4, 9)]) is None  # a zero dim means "copy" in ONNX
    assert reshape_target([(1, 3), (1, 3, 1)]) is None


def _cos_sin_graph(dim: int, dynamic: bool) -> tuple[gs.Graph, gs.Variable, gs.Variable]:
    """position_ids -> cos, sin [1, 1, T, dim] as Hugging Face's rotary computes them;
    `dynamic` scales the frequencies by the largest position (dynamic NTK-like)."""
    pos = gs.Variable(POSITION_IDS, np.int64, [1, "T"])
    inv = gs.Constant("inv", (1.0 / 10000 ** (np.arange(0, dim, 2) / dim)).astype(np.float32))
    nodes, t = [], gs.Variable("posf", np.float32)
    nodes.append(gs.Node("Cast", "cast", {"to": onnx.TensorProto.FLOAT}, [pos], [t]))
    if dynamic:
        big, scaled = gs.Variable("big", np.float32), gs.Variable("scaled", np.float32)
        nodes.append(gs.Node("ReduceMax", "max", {"keepdims": 1}, [t], [big]))
        nodes.append(gs.Node("Div", "div", inputs=[t, big], outputs=[scaled]))
        t = scaled
    col, freqs, emb = (gs.Variable(n, np.float32) for n in ("col", "freqs", "emb"))
    nodes.append(gs.Node("Unsqueeze", "unsq", inputs=[t, gs.Constant("ax", np.array([-1]))],
                         outputs=[col]))
    nodes.append(gs.Node("Mul", "mul", inputs=[col, inv], outputs=[freqs]))
    nodes.append(gs.Node("Concat", "cat", {"axis": -1}, [freqs, freqs], [emb]))
    cos, sin = gs.Variable("cos", np.float32), gs.Variable("sin", np.float32)
    nodes.append(gs.Node("Cos", "cos", inputs=[emb], outputs=[cos]))
    nodes.append(gs.Node("Sin", "sin", inputs=[emb], outputs=[sin]))
    graph = gs.Graph(nodes=nodes, inputs=[pos], outputs=[cos, sin], opset=17)
    return graph, cos, sin


def test_rotary_tables_are_the_graphs_own_cos_sin():
    graph, cos, sin = _cos_sin_graph(8, dynamic=False)
    tables = rotary_tables(TableMaker(graph, cos, sin), 4, 64)
    assert tables is not None
    angles = np.arange(64)[:, None] / 10000 ** (np.arange(0, 8, 2) / 8)
    np.testing.assert_allclose(tables[0], np.cos(angles), atol=1e-6)
    np.testing.assert_allclose(tables[1], np.sin(angles), atol=1e-6)
    assert tables[0].shape == (64, 4)


def test_rotary_tables_refused_when_a_row_depends_on_the_batch():
    graph, cos, sin = _cos_sin_graph(8, dynamic=True)
    assert rotary_tables(TableMaker(graph, cos, sin), 4, 64) is None
    graph, cos, sin = _cos_sin_graph(8, dynamic=False)
    assert rotary_tables(TableMaker(graph, cos, sin), 2, 64) is None  # halves are not 2 x 2


def test_no_lean_compiles_the_graph_as_exported_with_the_same_output(fixture_pairs, compiled,
                                                                      tmp_path):
    from dspark.compiler.compile import CompileOptions, compile_bundle
    from dspark.compiler.progress import Progress
    from dspark.runtime.engine.engine import Engine
    from dspark.runtime.sequence.request import GenerationRequest

    main, draft = fixture_pairs[("llama", "classic")]
    out = tmp_path / "plain.dsmodel"
    manifest = compile_bundle(CompileOptions(main, draft, out, lean=False), Progress(quiet=True))
    assert manifest.flags["lean"] is False
    ops = segment_ops(out)
    assert {"Shape", "Neg"} <= ops.keys() and "RotaryEmbedding" not in ops
    request = GenerationRequest((3, 1, 4, 1, 5), 24, method="draft")
    runs = [Engine(open_bundle(b), "fixed", 4).generate([request])[0].generated
            for b in (out, compiled[("llama", "classic")])]
    assert runs[0] == runs[1]


def test_a_flattened_batch_longer_than_the_rotary_tables(fixture_pairs, tmp_path):
    """Four 40-token prompts read in one forward: 160 tokens in the flattened batch against
    rotary tables of 64 positions, every sequence within them; onnxruntime's op refuses a
    sequence longer than its tables, so the fused rotary runs one token per batch row."""
    from dspark.compiler.compile import CompileOptions
    from dspark.compiler.reference import OriginalModel
    from dspark.runtime.engine.engine import Engine
    from dspark.runtime.sequence.request import GenerationRequest

    main, draft = fixture_pairs[("llama", "classic")]
    out = tmp_path / "short.dsmodel"
    compiled(CompileOptions(main, draft, out, max_seq_len=64))
    assert open_bundle(out).model("main").max_positions == 64
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(0, 320, 40)] for _ in range(4)]
    engine = Engine(open_bundle(out), "fixed", 4, max_batch=4, prefill_tokens=256)
    seqs = engine.generate([GenerationRequest(tuple(p), 16, method="draft") for p in prompts])
    assert engine.main.tokens >= 160 and engine.main.forwards < engine.main.tokens / 4
    reference = OriginalModel(main)
    for p, seq in zip(prompts, seqs):
        assert seq.generated == reference.greedy(p, 16)


def _rotary_graph(dynamic: bool, transposed: bool) -> gs.Graph:
    """rotate_half rotary on x [1, 2 heads, T, 8] feeding a SpeculativeVerify node as q."""
    from dspark.runtime.bundle.spec import VERIFY_DOMAIN, VERIFY_OP

    graph, cos, sin = _cos_sin_graph(8, dynamic)
    x = gs.Variable("x", np.float32, [1, 2, "T", 8])
    if transposed:
        pre = gs.Variable("x_pre", np.float32, [1, "T", 2, 8])
        graph.inputs.append(pre)
        graph.nodes.append(gs.Node("Transpose", "to_heads", {"perm": [0, 2, 1, 3]}, [pre], [x]))
    else:
        graph.inputs.append(x)
    c = lambda name, v: gs.Constant(name, np.array(v, np.int64))  # noqa: E731
    lo, hi, neg, rot, a, b, y, out = (gs.Variable(n, np.float32) for n in (
        "lo", "hi", "neg", "rot", "a", "b", "y", "out"))
    graph.nodes += [
        gs.Node("Slice", "lo", inputs=[x, c("s0", [0]), c("e0", [4]), c("ax0", [-1])],
                outputs=[lo]),
        gs.Node("Slice", "hi", inputs=[x, c("s1", [4]), c("e1", [2**62]), c("ax1", [-1])],
                outputs=[hi]),
        gs.Node("Neg", "neg", inputs=[hi], outputs=[neg]),
        gs.Node("Concat", "rot", {"axis": -1}, [neg, lo], [rot]),
        gs.Node("Mul", "a", inputs=[x, cos], outputs=[a]),
        gs.Node("Mul", "b", inputs=[rot, sin], outputs=[b]),
        gs.Node("Add", "rotary_add", inputs=[a, b], outputs=[y]),
        gs.Node(VERIFY_OP, "/main/layers.0/attn/SpeculativeVerify", {
            "num_heads": 2, "num_kv_heads": 2}, [y, y, y], [out], domain=VERIFY_DOMAIN),
    ]
    graph.outputs = [out]
    return graph


@pytest.mark.parametrize(("dynamic", "transposed", "why"), [
    (False, True, None), (True, True, "pure function"), (False, False, "transposed")])
def test_rotary_fused_or_left_unfused_by_name(dynamic, transposed, why):
    from dspark.compiler.passes.rotary import fuse_rotary

    graph = _rotary_graph(dynamic, transposed)
    fused, unfused = fuse_rotary(graph, "main", 64)
    if why is None:
        assert (fused, unfused) == (1, [])
        assert [n.op for n in graph.nodes].count("RotaryEmbedding") == 1
        assert not {"Neg", "Concat", "Slice"} & {n.op for n in graph.nodes}
    else:
        assert fused == 0 and len(unfused) == 1
        assert unfused[0].startswith("rotary_add") and why in unfused[0]


@pytest.mark.parametrize("form", ["classic", "dynamo", "sdpa"])
def test_a_tied_head_reads_the_embedding_table(compiled, form):
    """gemma3's head is its embedding transposed: stored once, read through Gemm(transB);
    llama's is its own matrix (tie_word_embeddings=False) and stays."""
    tied = open_bundle(compiled[("gemma3", form)])
    assert tied.manifest.stage1["main"]["passes"]["tied_head_shared"] == 1
    graph = onnx.load(str(tied.path(tied.model("main").graph_file)), load_external_data=False)
    shapes = [tuple(t.dims) for t in graph.graph.initializer]
    assert shapes.count((320, 64)) == 1 and (64, 320) not in shapes
    assert any(n.op_type == "Gemm" for n in graph.graph.node)
    untied = open_bundle(compiled[("llama", form)])
    assert untied.manifest.stage1["main"]["passes"]["tied_head_shared"] == 0
