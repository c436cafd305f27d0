"""Gemma 2's soft-capping: attention scores become cap * tanh(score / cap) before the mask,
and the final logits are capped the same way. The attention's cap is a SpeculativeVerify
attribute, computed by every backend (the C op, the numba kernel, numpy, Triton: their own
tests); the logits' cap stays in the graph. Both exporters here; onnxruntime-genai's
GroupQueryAttention `softcap` in test_genai_models.py, a Tanh that is not a cap in
test_bad_input.py."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from arch_fixtures import CAPPED_FORMS, build_capped_gemma2
from lossless import assert_greedy_like_original

from dspark.compiler.compile import CompileOptions
from dspark.compiler.reference import OriginalModel
from dspark.compiler.verify import verify_model
from dspark.runtime.bundle.bundle import open_bundle

from bundle_cache import compiled
from model_fixtures import SLIDING_WINDOW


@pytest.fixture(scope="module")
def capped():
    from conftest import BUILD

    return build_capped_gemma2(BUILD)


@pytest.fixture(scope="module")
def bundles(capped, tmp_path_factory):
    return {form: compiled(CompileOptions(path, None, tmp_path_factory.mktemp(form) / "b.dsmodel",
                                          max_seq_len=128, kv_budget_mb=8))
            for form, path in capped.items()}


@pytest.mark.parametrize("form", CAPPED_FORMS)
def test_gemma2_compiles_its_caps_and_verifies_past_its_window(capped, bundles, form):
    bundle = open_bundle(bundles[form])
    spec = bundle.model("main")
    assert [op.softcap for op in spec.verify_ops] == [pytest.approx(2.0)] * 3
    assert tuple(spec.windows) == (SLIDING_WINDOW, 0, SLIDING_WINDOW)
    graph = onnx.load(str(bundles[form] / spec.graph_file), load_external_data=False).graph
    assert any(n.op_type == "Tanh" for n in graph.node)  # the final logits' cap, kept
    report = verify_model(bundle, "main", capped[form], seqs=3, steps=3)
    assert report.ok(1e-3) and report.longest == 128, report
    assert report.max_abs_diff <= 1e-4 and report.argmax_agree == 1.0, report


@pytest.mark.parametrize("cpu_op", ["1", "0"])
@pytest.mark.parametrize("form", CAPPED_FORMS)
def test_gemma2_generates_its_own_greedy_tokens(capped, bundles, form, cpu_op, monkeypatch):
    """Past the window, batched, plain and with lookup drafts, through the C op (one
    session) and through the segments (numba for verify windows, numpy for prefills)."""
    monkeypatch.setenv("DSPARK_CPU_OP", cpu_op)
    bundle = open_bundle(bundles[form])
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(0, 300, n)] for n in (1, 6, 13, 40)]
    assert_greedy_like_original(bundle, OriginalModel(capped[form]), prompts)
