"""The bundled sample: real pretrained SmolLM2-135M-Instruct, fp32 main + int4 draft."""

from __future__ import annotations

import onnx
import pytest

from dspark.compiler.verify import verify_model
from dspark.runtime.bundle.bundle import open_bundle

pytestmark = pytest.mark.slow


def test_sample_pair_is_real_and_quantized(smollm2_pair):
    draft = onnx.load(str(smollm2_pair / "draft.onnx"), load_external_data=False)
    ops = {n.op_type for n in draft.graph.node}
    assert "MatMulNBits" in ops  # int4 weights
    main = onnx.load(str(smollm2_pair / "main.onnx"), load_external_data=False)
    assert "MatMulNBits" not in {n.op_type for n in main.graph.node}
    assert (smollm2_pair / "tokenizer.json").stat().st_size > 1_000_000


def test_sample_bundle(smollm2_bundle):
    bundle = open_bundle(smollm2_bundle)
    for role in ("main", "draft"):
        spec = bundle.model(role)
        assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (30, 9, 3, 64)
        assert spec.vocab_size == 49152 and len(spec.segments) == 31
    assert bundle.tokenizer_dir is not None
    assert "chat_template.jinja" in bundle.manifest.tokenizer


def test_sample_bundle_verifies(smollm2_pair, smollm2_bundle):
    bundle = open_bundle(smollm2_bundle)
    main = verify_model(bundle, "main", smollm2_pair / "main.onnx", seqs=3, steps=3)
    print(f"main: max |diff| {main.max_abs_diff:.2e}, noise floor {main.noise_floor:.2e}")
    assert main.max_abs_diff <= 1e-3 and main.argmax_agree == 1.0
    draft = verify_model(bundle, "draft", smollm2_pair / "draft.onnx", seqs=3, steps=3)
    print(f"draft: max |diff| {draft.max_abs_diff:.2e}, noise floor {draft.noise_floor:.2e}")
    # int8-activation int4 MatMulNBits is not shape-deterministic: judged against its own noise
    assert draft.ok(1e-3) and draft.argmax_agree >= 0.8
