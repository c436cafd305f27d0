"""Rope scalings that switch on the call's longest position (LongRoPE, as Phi-3's 128k models
have) give a token a rotary that depends on the other tokens of its call, so no batching
reproduces the original exactly: `dsc compile` refuses them, naming the layer and the node,
and says the longest --max-seq-len at which every position's values are its own. Below the
switch the model is plain RoPE, and compiles and verifies exactly."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
import pytest
from arch_fixtures import LONGROPE_SWITCH, build_longrope_fixtures

from dspark.compiler.compile import CompileOptions
from dspark.compiler.passes.length_switch import condition_subgraph
from dspark.compiler.reference import OriginalModel
from dspark.compiler.verify import verify_model
from dspark.runtime.bundle.bundle import open_bundle
from dspark.runtime.engine.engine import Engine
from dspark.runtime.sequence.request import GenerationRequest

from bundle_cache import compiled
from cli_helpers import run_dsc


@pytest.fixture(scope="module")
def longrope():
    from conftest import BUILD

    return build_longrope_fixtures(BUILD)


def _refusal(r) -> str:
    assert r.code == 2, (r.code, r.out, r.err)
    assert "Traceback" not in r.err
    lines = [line for line in r.err.splitlines() if not line.startswith("[dsc]")]
    assert len(lines) == 1 and lines[0].startswith("dsc: error: "), r.err
    return lines[0]


def test_a_longrope_export_is_refused_naming_its_switch(capsys, longrope, tmp_path):
    out = tmp_path / "b.dsmodel"
    line = _refusal(run_dsc(capsys, "compile", longrope["dynamo"], "-o", out))
    assert "main.onnx: layer 0: cannot prove the positions" in line
    assert "(Where)" in line  # torch.where(longest > switch, long, short frequencies)
    assert f"up to --max-seq-len {LONGROPE_SWITCH}" in line
    assert list(tmp_path.iterdir()) == []


def test_below_its_switch_it_compiles_and_verifies_exactly(longrope, tmp_path):
    bundle = open_bundle(compiled(CompileOptions(longrope["dynamo"], None, tmp_path / "b.dsmodel",
                                                 max_seq_len=LONGROPE_SWITCH, kv_budget_mb=8)))
    report = verify_model(bundle, "main", longrope["dynamo"], seqs=3, steps=3)
    assert report.ok(1e-3) and report.longest == LONGROPE_SWITCH, report
    assert report.max_abs_diff <= 1e-4 and report.argmax_agree == 1.0, report


def test_one_position_past_the_switch_is_refused(capsys, longrope, tmp_path):
    r = run_dsc(capsys, "compile", longrope["dynamo"], "-o", tmp_path / "b.dsmodel",
                "--max-seq-len", str(LONGROPE_SWITCH + 1))
    assert "cannot prove the positions" in _refusal(r)


def test_genai_longrope_build_is_refused_naming_its_if(capsys, longrope, tmp_path):
    """onnxruntime-genai writes the switch as an If on the mask's length (rope_caches_subgraph)."""
    line = _refusal(run_dsc(capsys, "compile", longrope["genai"], "-o", tmp_path / "b.dsmodel",
                            "--max-seq-len", str(LONGROPE_SWITCH + 1)))
    assert "model.onnx: layer 0: cannot prove the positions: If node " in line
    assert "'/model/rope_caches_subgraph/If'" in line
    assert f"once a sequence holds {LONGROPE_SWITCH + 1} tokens" in line
    assert f"one branch up to --max-seq-len {LONGROPE_SWITCH}" in line
    assert list(tmp_path.iterdir()) == []


def test_genai_longrope_at_its_switch_folds_the_if_and_generates_the_originals_tokens(
        longrope, tmp_path):
    bundle = open_bundle(compiled(CompileOptions(longrope["genai"], None, tmp_path / "b.dsmodel",
                                                 max_seq_len=LONGROPE_SWITCH, kv_budget_mb=8)))
    report = verify_model(bundle, "main", longrope["genai"], seqs=3, steps=3)
    assert report.ok(1e-3) and report.longest == LONGROPE_SWITCH, report
    assert report.max_abs_diff <= 1e-4 and report.argmax_agree == 1.0, report
    original = OriginalModel(longrope["genai"])
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(0, 300, n)] for n in (3, 40, LONGROPE_SWITCH - 41)]
    refs = [original.greedy(p, 40) for p in prompts]
    for speculative in (False, True):
        seqs = Engine(bundle, "fixed", 4, max_batch=4).generate(
            [GenerationRequest(tuple(p), 40, speculative=speculative, method="lookup")
             for p in prompts])
        assert [s.generated for s in seqs] == refs, speculative


def test_an_if_on_the_caches_values_is_not_folded():
    """Only conditions on shapes, the mask and the positions are run; one that reads the
    cache's values is left to bind, which refuses it."""
    past = gs.Variable("past_key_values.0.key", np.float32, [1, 1, "p", 4])
    mask = gs.Variable("attention_mask", np.int64, [1, "t"])
    on_shape = _condition([gs.Node("Shape", inputs=[mask])], "Gather", 1)
    on_values = _condition([gs.Node("ReduceSum", inputs=[past], attrs={"keepdims": 0})],
                           "Identity", None)
    assert condition_subgraph(on_shape) is not None
    assert condition_subgraph(on_values) is None


def _condition(first: list[gs.Node], op: str, index: int | None) -> gs.Variable:
    """first[0]'s output, through `op`, compared with a constant."""
    head = gs.Variable("x")
    first[0].outputs = [head]
    picked = gs.Variable("y")
    extra = [gs.Constant("i", np.array(index))] if index is not None else []
    gs.Node(op, inputs=[head, *extra], outputs=[picked])
    cond = gs.Variable("c", np.bool_)
    gs.Node("Greater", inputs=[picked, gs.Constant("k", np.array(3.0))], outputs=[cond])
    return cond


def test_an_if_on_the_masks_values_is_folded_below_its_switch_and_refused_past_it(
        capsys, longrope, tmp_path):
    """The genai build with its If decided by ReduceSum(attention_mask) > 256 (the mask's
    values, not its shape): those are run too, as the runtime fixes them (all ones)."""
    import shutil

    import onnx

    folder = tmp_path / "on-values"
    shutil.copytree(longrope["genai"], folder)
    graph = gs.import_onnx(onnx.load(str(folder / "model.onnx")))
    switch = next(n for n in graph.nodes if n.op == "If")
    mask = next(t for t in graph.inputs if t.name == "attention_mask")
    total, cond = gs.Variable("/test/total", np.int64), gs.Variable("/test/cond", np.bool_)
    graph.nodes += [
        gs.Node("ReduceSum", "/test/ReduceSum", {"keepdims": 0}, [mask], [total]),
        gs.Node("Greater", "/test/Greater", inputs=[
            total, gs.Constant("/test/switch", np.array(LONGROPE_SWITCH))], outputs=[cond])]
    switch.inputs[0] = cond
    onnx.save(gs.export_onnx(graph.cleanup().toposort()), str(folder / "model.onnx"))
    line = _refusal(run_dsc(capsys, "compile", folder, "-o", tmp_path / "b.dsmodel"))
    assert (f"If node '{switch.name}' takes its other branch once a sequence holds "
            f"{LONGROPE_SWITCH + 1} tokens") in line
    bundle = open_bundle(compiled(CompileOptions(folder, None, tmp_path / "c.dsmodel",
                                                 max_seq_len=LONGROPE_SWITCH, kv_budget_mb=8)))
    report = verify_model(bundle, "main", folder, seqs=3, steps=3)
    assert report.max_abs_diff <= 1e-4 and report.argmax_agree == 1.0, report
