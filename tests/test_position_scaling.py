"""Rope scalings that switch on the call's longest position (LongRoPE, as Phi-3's 128k models
have) give a token a rotary that depends on the other tokens of its call, so no batching
reproduces the original exactly: `dsc compile` refuses them, naming the layer and the node,
and says the longest --max-seq-len at which every position's values are its own. Below the
switch the model is plain RoPE, and compiles and verifies exactly."""

from __future__ import annotations

import pytest
from arch_fixtures import LONGROPE_SWITCH, build_longrope_fixtures

from dspark.compiler.compile import CompileOptions
from dspark.compiler.verify import verify_model
from dspark.runtime.bundle.bundle import open_bundle

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
    line = _refusal(run_dsc(capsys, "compile", longrope["genai"], "-o", tmp_path / "b.dsmodel"))
    assert "model.onnx: node '" in line
    assert "it decides If node '/model/rope_caches_subgraph/If'" in line
    assert list(tmp_path.iterdir()) == []
