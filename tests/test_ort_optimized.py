"""Models saved after onnxruntime's extended optimizations (SessionOptions
optimized_model_filepath, a common deploy step): the attention's score MatMul is a
FusedMatMul with the key's transpose and the scale folded in. They compile and verify
exactly as the exports they came from."""

from __future__ import annotations

import onnx
import pytest

from dspark.compiler.compile import CompileOptions
from dspark.compiler.verify import verify_model
from dspark.runtime.bundle.bundle import open_bundle
from dspark.runtime.model.sessions import make_session

from bundle_cache import compiled

FORMS = [("llama", "classic"), ("gemma3", "classic"), ("gpt2", "dynamo"), ("mistral", "sdpa")]


@pytest.mark.parametrize("key", FORMS, ids="-".join)
def test_an_onnxruntime_optimized_model_compiles_exactly(fixture_pairs, key, tmp_path):
    optimized = tmp_path / "optimized.onnx"
    make_session(fixture_pairs[key][0], level="extended", optimized_path=optimized)
    fused = [n for n in onnx.load(str(optimized), load_external_data=False).graph.node
             if n.op_type == "FusedMatMul"]
    if key[1] == "classic":  # the eager attention's q @ k^T * scale
        assert fused and all(n.attribute for n in fused)
    bundle = open_bundle(compiled(CompileOptions(optimized, None, tmp_path / "b.dsmodel",
                                                 max_seq_len=128, kv_budget_mb=8)))
    report = verify_model(bundle, "main", optimized, seqs=3, steps=3)
    assert report.ok(1e-3) and report.argmax_agree == 1.0 and report.noise_floor < 1e-4, report
