"""dsc compile on real exported pairs: structure of the bundle, determinism, verify."""

from __future__ import annotations

import hashlib
import json

import onnx
import pytest

from dspark.compiler.compile import CompileOptions, compile_bundle
from dspark.compiler.progress import Progress
from dspark.compiler.verify import verify_model
from dspark.runtime.bundle.bundle import open_bundle
from dspark.runtime.bundle.spec import VERIFY_DOMAIN, VERIFY_OP
from dspark.runtime.version import BUNDLE_FORMAT_VERSION

from cli_helpers import run_dsc
from model_fixtures import PAIRS, SLIDING_WINDOW

# (query heads, kv heads): gpt2 is the one without GQA
HEADS = {"llama": (4, 2), "gpt2": (4, 4), "gemma3": (4, 2), "mistral": (4, 2)}
SCALE = {"gemma3": 256 ** -0.5}  # Gemma's query_pre_attn_scalar; the others 1/sqrt(16)
# each main layer's attention window: gemma3's 5 sliding + 1 global, mistral's all sliding
WINDOWS = {"llama": (0,) * 3, "gpt2": (0,) * 3, "gemma3": (SLIDING_WINDOW,) * 5 + (0,),
           "mistral": (SLIDING_WINDOW,) * 3}


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: "-".join(p))
def test_bundle_structure(compiled, pair):
    bundle = open_bundle(compiled[pair])
    windows = WINDOWS[pair[0]]
    for role, layers in (("main", len(windows)), ("draft", 1)):
        spec = bundle.model(role)
        assert (spec.num_heads, spec.num_kv_heads) == HEADS[pair[0]]
        assert (spec.num_layers, spec.head_dim, spec.vocab_size) == (layers, 16, 320)
        assert len(spec.segments) == layers + 1
        assert [op.layer for op in spec.verify_ops] == list(range(layers))
        assert [op.after_segment for op in spec.verify_ops] == list(range(layers))
        assert spec.windows == windows[:layers]  # found in the graph's mask arithmetic
        assert all(op.scale == pytest.approx(SCALE.get(pair[0], 0.25))
                   for op in spec.verify_ops)
        assert set(spec.inputs) == {"input_ids", "position_ids", "logits_index"}
        for seg in spec.segments:
            assert not any(n.startswith(("past_key_values", "attention_mask")) for n in seg.inputs)
            assert not any(n.startswith("present.") for n in seg.outputs)
        whole = onnx.load(str(bundle.path(spec.graph_file)), load_external_data=False)
        verify = [n for n in whole.graph.node if n.op_type == VERIFY_OP]
        assert [n.domain for n in verify] == [VERIFY_DOMAIN] * layers
        assert verify[0].name == f"/{role}/layers.0/attn/{VERIFY_OP}"
        assert verify[0].output[0] == f"/{role}/layers.0/attn/{VERIFY_OP}/output_0"
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in verify[0].attribute}
        assert attrs["num_kv_heads"] == HEADS[pair[0]][1] and attrs["head_dim"] == 16
        assert attrs["window"] == windows[0]


def _external_refs(path):
    model = onnx.load(str(path), load_external_data=False)
    refs = {}
    for t in model.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            ext = {e.key: e.value for e in t.external_data}
            refs[t.name] = (ext["location"], int(ext["offset"]), int(ext["length"]))
    return refs


def test_weights_stored_once_per_model(compiled):
    bundle = open_bundle(compiled[("llama", "classic")])
    spec = bundle.model("main")
    whole = _external_refs(bundle.path(spec.graph_file))
    seen = {}
    for seg in spec.segments:
        for name, ref in _external_refs(bundle.path(seg.file)).items():
            assert ref == whole[name], "segment and whole graph must share one copy"
            seen[name] = ref
    assert set(seen) == set(whole)
    assert {loc for loc, _, _ in whole.values()} == {"weights.bin"}
    payload = sum(length for _, _, length in whole.values())
    size = bundle.path(spec.weights_file).stat().st_size
    assert payload <= size < payload + 4096 * (len(whole) + 1)  # page alignment only


def _digests(root):
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_same_inputs_give_byte_identical_bundle(fixture_pairs, compiled, tmp_path):
    """The fixture bundle (compiled in this process, or by an earlier one into the test
    bundle cache) and a fresh compile of the same inputs are byte-identical, also after an
    engine has registered the CPU op's domain with onnxruntime in this process (onnxruntime
    then lists it in every model it optimizes)."""
    from conftest import TEST_KV_MB

    from dspark.runtime.engine.engine import Engine
    from dspark.runtime.model.fused import FusedModel

    assert isinstance(Engine(open_bundle(compiled[("llama", "dynamo")])).main.model, FusedModel)
    main, draft = fixture_pairs[("llama", "dynamo")]
    again = tmp_path / "again.dsmodel"
    compile_bundle(CompileOptions(main, draft, again, kv_budget_mb=TEST_KV_MB),
                   Progress(quiet=True))
    assert _digests(again) == _digests(compiled[("llama", "dynamo")])


def test_flags_change_the_plan_and_are_recorded(fixture_pairs, tmp_path):
    main, draft = fixture_pairs[("gpt2", "classic")]
    out = tmp_path / "b.dsmodel"
    compile_bundle(CompileOptions(main, draft, out, kv_budget_mb=8, block_size=32,
                                  max_seq_len=300), Progress(quiet=True))
    bundle = open_bundle(out)
    plan = bundle.plan
    assert (plan.block_size, plan.max_seq_len) == (32, 300)
    per_block = 32 * (bundle.model("main").kv_bytes_per_token
                      + bundle.model("draft").kv_bytes_per_token)
    assert plan.num_blocks == 8 * 2**20 // per_block
    assert plan.max_seqs == plan.num_blocks // 10  # ceil(300 / 32) blocks per sequence
    assert bundle.manifest.flags == {"block_size": 32, "kv_budget_mb": 8, "max_seq_len": 300,
                                        "extra_drafts": [], "lean": True}


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: "-".join(p))
def test_verify_matches_original_models(fixture_pairs, compiled, pair):
    bundle = open_bundle(compiled[pair])
    for role, path in zip(("main", "draft"), fixture_pairs[pair]):
        report = verify_model(bundle, role, path, seqs=4, steps=4, seed=1)
        print(f"{pair} {role}: max |diff| {report.max_abs_diff:.2e}")
        assert report.max_abs_diff <= 1e-4
        assert report.argmax_agree == 1.0
        assert report.tokens > 4 * 4


def test_dsc_verify_cli(capsys, fixture_pairs, compiled):
    main, draft = fixture_pairs[("gpt2", "dynamo")]
    r = run_dsc(capsys, "verify", compiled[("gpt2", "dynamo")], "--main", main, "--draft", draft,
                "--json")
    assert r.code == 0, r.err
    data = json.loads(r.out)
    assert data["ok"] and [m["role"] for m in data["models"]] == ["main", "draft"]
    assert all(m["max_abs_diff"] <= 1e-4 for m in data["models"])
    # progress on stderr (the forwards' every 2 s at most), none with --quiet
    assert "[dsc] verify main: " in r.err and "forwards, up to 2048 positions" in r.err
    assert "[dsc] verify draft: the original's own noise" in r.err
    r = run_dsc(capsys, "verify", compiled[("gpt2", "dynamo")], "--main", main, "--draft", draft,
                "--quiet")
    assert r.code == 0 and r.err == "", r.err


def _perturbed(src, dst):
    """Same geometry, different function: one weight matrix shifted."""
    model = onnx.load(str(src))
    big = max(model.graph.initializer, key=lambda t: len(t.raw_data))
    w = onnx.numpy_helper.to_array(big) + 0.05
    big.CopyFrom(onnx.numpy_helper.from_array(w, big.name))
    onnx.save(model, str(dst))
    return dst


def test_dsc_verify_fails_when_bundle_differs(capsys, fixture_pairs, compiled, tmp_path):
    main, draft = fixture_pairs[("llama", "classic")]
    bundle = compiled[("llama", "classic")]
    r = run_dsc(capsys, "verify", bundle, "--main", draft, "--draft", draft)
    assert r.code == 2 and "does not match the bundle's main model" in r.err
    r = run_dsc(capsys, "verify", bundle, "--main", _perturbed(main, tmp_path / "m.onnx"),
                "--draft", draft)
    assert r.code == 1, r.out
    assert "main  max |logits diff|" in r.out and "FAIL" in r.out.splitlines()[0]
    assert r.out.splitlines()[1].endswith(": ok")


def test_dsc_compile_and_inspect_cli(capsys, fixture_pairs, tmp_path):
    main, draft = fixture_pairs[("llama", "classic")]
    out = tmp_path / "v41.dsmodel"
    r = run_dsc(capsys, "compile", main, draft, "-o", out, "--json")
    assert r.code == 0, r.err
    for stage in ("optimize main", "verify-nodes main", "write main", "optimize draft",
                  "layout", "kernels"):
        assert f"[dsc] {stage} done" in r.err
    assert "[dsc] max_seq_len 2048: the default, 2048 (--max-seq-len sets it)" in r.err
    manifest = json.loads(r.out)
    assert manifest["format_version"] == BUNDLE_FORMAT_VERSION
    assert set(manifest["timings_s"]) >= {"layout"}
    r = run_dsc(capsys, "inspect", out)
    assert r.code == 0 and "main  3 layers, 4 heads / 2 kv heads x 16" in r.out
    assert "memory plan: [block][kv_head][block_size][head_dim]" in r.out
    r = run_dsc(capsys, "inspect", out, "--json")
    info = json.loads(r.out)
    assert info["models"]["draft"]["segments"] == 2
    assert info["memory_plan"]["num_blocks"] > 0 and info["config"]["window"]["initial"] == 4


def test_force_replaces_an_existing_bundle(capsys, fixture_pairs, tmp_path):
    main, draft = fixture_pairs[("gpt2", "classic")]
    out = tmp_path / "b.dsmodel"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    assert run_dsc(capsys, "compile", main, draft, "-o", out, "--force").code == 0
    assert not (out / "stale.txt").exists() and (out / "manifest.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.dsmodel"]
