"""onnxruntime-genai's builder output as `dsc compile` input: a model folder (or its
model.onnx) with GroupQueryAttention (packed QKV, rotary from its caches, a symbolic head
dim, window-sized caches for sliding layers), SimplifiedLayerNormalization and, in int4
builds, MatMulNBits without zero points and a GatherBlockQuantized embedding. Each compiles,
verifies against the original at lengths past its windows, generates the original's greedy
tokens with and without speculation, and takes its EOS from genai_config.json."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from lossless import first_fork

from dspark.compiler.compile import CompileOptions
from dspark.compiler.reference import OriginalModel
from dspark.compiler.verify import verify_model
from dspark.runtime.bundle.bundle import open_bundle
from dspark.runtime.bundle.tokenizer import load_tokenizer
from dspark.runtime.engine.engine import Engine
from dspark.runtime.sequence.request import GenerationRequest

from bundle_cache import compiled
from model_fixtures import GENAI, SLIDING_WINDOW, build_genai_fixtures

WINDOWS = {"llama": (0, 0, 0), "qwen2": (0, SLIDING_WINDOW, SLIDING_WINDOW),
           "gemma3": (SLIDING_WINDOW,) * 5 + (0,), "qwen3": (0, 0, 0), "phi3": (0, 0, 0),
           "gemma2": (SLIDING_WINDOW, 0, SLIDING_WINDOW), "granite": (0, 0, 0)}


@pytest.fixture(scope="module")
def genai_models(tmp_path_factory):
    from conftest import BUILD

    return build_genai_fixtures(BUILD)


@pytest.fixture(scope="module")
def genai_bundles(genai_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("genai")
    return {name: compiled(CompileOptions(folder, None, root / f"{name}.dsmodel",
                                          max_seq_len=256, kv_budget_mb=8))
            for name, folder in genai_models.items()}


def test_the_builder_writes_what_the_compiler_must_map(genai_models):
    ops = {name: {n.op_type for n in onnx.load(str(folder / "model.onnx"),
                                                load_external_data=False).graph.node}
           for name, folder in genai_models.items()}
    assert all("GroupQueryAttention" in o and "SimplifiedLayerNormalization" in o
               for o in ops.values())
    assert {"MatMulNBits", "GatherBlockQuantized"} <= ops["llama-int4"]
    header = onnx.load(str(genai_models["qwen2-fp32"] / "model.onnx"), load_external_data=False)
    gqa = [n for n in header.graph.node if n.op_type == "GroupQueryAttention"]
    windowed = [any(a.name == "sliding_window_cache" and a.i == 1 for a in n.attribute)
                for n in gqa]
    assert windowed == [False, True, True]


@pytest.mark.parametrize("name", list(GENAI))
def test_genai_model_compiles_with_its_windows_and_verifies(genai_models, genai_bundles, name):
    bundle = open_bundle(genai_bundles[name])
    spec = bundle.model("main")
    assert spec.windows == WINDOWS[GENAI[name][0]]  # measured on the node, not its attribute
    assert {op.layout for op in spec.verify_ops} == {"tokens"} and spec.head_dim == 16
    report = verify_model(bundle, "main", genai_models[name], seqs=3, steps=3)
    assert report.ok(1e-3) and report.longest == 256, report
    if GENAI[name][1] == "fp32":  # int4: within what its own int8 inputs move it (verify.py)
        assert report.max_abs_diff <= 1e-4 and report.argmax_agree == 1.0, report


@pytest.mark.parametrize("name", list(GENAI))
def test_genai_model_generates_its_own_greedy_tokens(genai_models, genai_bundles, name):
    """Prompts below, at and past the window, batched, plain and with lookup drafts: the
    same tokens each way, and the original's (int4: forks within its own int8 noise, as in
    test_int4_mains.py)."""
    bundle = open_bundle(genai_bundles[name])
    original = OriginalModel(genai_models[name])
    tie = 1e-4
    if GENAI[name][1] == "int4":
        tie = verify_model(bundle, "main", genai_models[name], seqs=2, steps=2).noise_floor
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(0, 300, n)] for n in (1, 5, 8, 13, 40)]
    refs = [original.greedy(p, 40) for p in prompts]
    plain = None
    for speculative, window in ((False, 1), (True, 4), (True, 8)):
        engine = Engine(bundle, "fixed", window, max_batch=8)
        seqs = engine.generate([GenerationRequest(tuple(p), 40, speculative=speculative,
                                                  method="lookup") for p in prompts])
        plain = plain or [s.generated for s in seqs]
        assert [s.generated for s in seqs] == plain, (speculative, window)
        forks = [f for p, s, r in zip(prompts, seqs, refs)
                 if (f := first_fork(s.generated, r, p, original, set(), s.finish_reason, tie))]
        assert len(forks) <= (len(prompts) if tie > 1e-4 else 1), (speculative, window, forks)


def test_a_genai_folder_brings_its_tokenizer_and_eos(genai_models, genai_bundles):
    bundle = open_bundle(genai_bundles["qwen2-fp32"])
    config = json.loads((genai_models["qwen2-fp32"] / "genai_config.json").read_text())
    eos = config["model"]["eos_token_id"]
    tokenizer = load_tokenizer(bundle.tokenizer_dir)
    assert set(eos if isinstance(eos, list) else [eos]) <= tokenizer.eos_ids
    assert tokenizer.tokenizer.token_to_id("w5") == 5 and tokenizer.decode([5]) == "w5"


def test_a_group_query_attention_it_cannot_map_is_refused(capsys, genai_models, tmp_path):
    import bad_models
    from cli_helpers import run_dsc

    model = bad_models.softcapped_gqa_model(genai_models["llama-fp32"], tmp_path / "sunk",
                                            cap=1, attribute="smooth_softmax")
    r = run_dsc(capsys, "compile", model, "-o", tmp_path / "b.dsmodel")
    assert r.code == 2 and "Traceback" not in r.err
    line = r.err.strip().splitlines()[-1]
    assert "layer 1" in line and "/model/layers.1/attn/GroupQueryAttention" in line
    assert "smooth_softmax=1 is not supported" in line
    assert not (tmp_path / "b.dsmodel").exists()


def test_a_group_query_attention_softcap_compiles_and_verifies(genai_models, tmp_path):
    """onnxruntime-genai writes Gemma 2's cap as GroupQueryAttention's `softcap`: here set on
    every layer of its Llama (2.0, so that it shows), the original run by onnxruntime."""
    import bad_models

    folder = bad_models.softcapped_gqa_model(genai_models["llama-fp32"], tmp_path / "capped",
                                             layer=None, cap=2.0)
    bundle = open_bundle(compiled(CompileOptions(folder, None, tmp_path / "b.dsmodel",
                                                 max_seq_len=64, kv_budget_mb=8)))
    assert {op.softcap for op in bundle.model("main").verify_ops} == {2.0}
    report = verify_model(bundle, "main", folder, seqs=3, steps=3)
    assert report.ok(1e-3) and report.max_abs_diff <= 1e-4, report
    assert report.argmax_agree == 1.0, report


def test_an_fp16_cpu_build_is_refused_naming_its_attention(capsys, genai_models, tmp_path):
    """The builder writes MultiHeadAttention (not GroupQueryAttention) for fp16 on CPU."""
    from cli_helpers import run_dsc

    fp16 = genai_models["llama-fp32"].parent / "llama-fp16"  # model_fixtures.REFUSED_GENAI
    r = run_dsc(capsys, "compile", fp16, "-o", tmp_path / "b.dsmodel")
    assert r.code == 2 and "Traceback" not in r.err
    line = r.err.strip().splitlines()[-1]
    assert "MultiHeadAttention node '/model/layers.0/attn/MultiHeadAttention'" in line
    assert "-p fp32 / -p int4" in line
    assert not (tmp_path / "b.dsmodel").exists()
