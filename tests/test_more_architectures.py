"""Architectures beyond the fixture pairs, as users bring them (transformers' own modelling
code, the classic exporter): each compiles with every attention a SpeculativeVerify node and
its logits the original's at every position up to the bundle's last, window crossings
included (`dsc verify`'s check)."""

from __future__ import annotations

import numpy as np
import pytest
from arch_fixtures import MIXTURES, MORE_ARCHS, build_more_archs, more_config

from dspark.compiler.compile import CompileOptions
from dspark.compiler.hf_export import kv_geometry
from dspark.compiler.verify import verify_model
from dspark.runtime.bundle.bundle import open_bundle
from dspark.runtime.model.sessions import make_session

from bundle_cache import compiled
from model_fixtures import SLIDING_WINDOW

LAYERS = {"smollm3": 4}
WINDOWED = {"gemma2": (SLIDING_WINDOW, 0, SLIDING_WINDOW)}  # Gemma 2: every other layer


@pytest.fixture(scope="module")
def mains():
    from conftest import BUILD

    return build_more_archs(BUILD)


@pytest.mark.parametrize("arch", MORE_ARCHS)
def test_it_compiles_and_verifies_exactly(mains, arch, tmp_path):
    bundle = open_bundle(compiled(CompileOptions(mains[arch], None, tmp_path / "b.dsmodel",
                                                 max_seq_len=512, kv_budget_mb=8)))
    spec = bundle.model("main")
    assert len(spec.verify_ops) == LAYERS.get(arch, 3)
    assert tuple(spec.windows) == WINDOWED.get(arch, (0,) * LAYERS.get(arch, 3))
    report = verify_model(bundle, "main", mains[arch], seqs=3, steps=3)
    assert report.ok(1e-3) and report.longest == 512, report
    assert report.max_abs_diff <= 1e-3 and report.argmax_agree == 1.0, report


@pytest.mark.parametrize("arch", MIXTURES)
def test_a_mixture_of_experts_exports_its_routing_not_the_traces(mains, arch):
    """Each token's experts are chosen inside the graph: the export's logits are the model's
    for tokens that the export's trace never routed (its 3 tokens reach at most 6 of the 8
    experts a layer)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(more_config(arch)).eval()
    ids = np.random.default_rng(7).integers(0, model.config.vocab_size, (1, 40))
    layers, kv_heads, head_dim = kv_geometry(model.config)
    dims = (1, kv_heads, 0, head_dim)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    for i in range(layers):
        feeds.update({f"past_key_values.{i}.{k}": np.zeros(dims, np.float32)
                      for k in ("key", "value")})
    session = make_session(mains[arch], level="none")
    got = session.run(["logits"], feeds)[0]
    with torch.no_grad():
        want = model(torch.from_numpy(ids)).logits.numpy()
    assert np.abs(got - want).max() < 1e-4


def test_a_position_table_shorter_than_the_limit_is_refused_with_its_length(capsys, mains,
                                                                             tmp_path):
    """GPT-2's 1024 learned positions at --max-seq-len 2048: one line, the file named once,
    onnxruntime's reason and the longest length that runs."""
    from cli_helpers import run_dsc

    r = run_dsc(capsys, "compile", mains["gpt2"], "-o", tmp_path / "b.dsmodel",
                "--max-seq-len", "2048")
    assert r.code == 2 and "Traceback" not in r.err, r.err
    line = r.err.strip().splitlines()[-1]
    assert "the model does not run at 2048 positions (onnxruntime: indices" in line
    assert "compile with --max-seq-len 1024 or less" in line
    assert line.count(str(mains["gpt2"])) == 1
    assert not (tmp_path / "b.dsmodel").exists()


def test_the_default_length_is_the_models_own_limit(capsys, mains, tmp_path):
    """Without --max-seq-len GPT-2 compiles at the 1024 positions it runs, and says so; a
    config.json beside a model names its limit before any probe."""
    import shutil

    from dspark.runtime.bundle.bundle import open_bundle

    from cli_helpers import run_dsc

    r = run_dsc(capsys, "compile", mains["gpt2"], "-o", tmp_path / "b.dsmodel")
    assert r.code == 0, r.err
    assert "max_seq_len 1024: the most the models run" in r.err
    assert open_bundle(tmp_path / "b.dsmodel").model("main").max_positions == 1024
    folder = tmp_path / "with-config"
    folder.mkdir()
    shutil.copy(mains["gpt2"], folder / "model.onnx")
    (folder / "config.json").write_text('{"model_type": "gpt2", "n_positions": 512}')
    r = run_dsc(capsys, "compile", folder / "model.onnx", "-o", tmp_path / "c.dsmodel")
    assert r.code == 0, r.err
    assert f"max_seq_len 512: {folder / 'config.json'} n_positions = 512" in r.err
    assert "compiling again" not in r.err
    assert open_bundle(tmp_path / "c.dsmodel").model("main").max_positions == 512
