"""Every bad input: one clear line naming the file and the problem, exit 2, nothing written."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import bad_models
from cli_helpers import run_dsc


def _only(path, expected):
    """The output's parent holds exactly `expected`: no bundle, no temp dir left behind."""
    assert sorted(p.name for p in path.parent.iterdir()) == sorted(expected)


def _refused(r, *fragments):
    assert r.code == 2, (r.code, r.out, r.err)
    lines = [line for line in r.err.splitlines() if not line.startswith("[dsc]")]
    assert len(lines) == 1, r.err
    assert lines[0].startswith("dsc: error: "), lines[0]
    assert "Traceback" not in r.err
    for f in fragments:
        assert f in lines[0], (f, lines[0])


@pytest.fixture
def llama(fixture_pairs):
    return fixture_pairs[("llama", "classic")]


@pytest.fixture
def outdir(tmp_path):
    d = tmp_path / "out"
    d.mkdir()
    return d


def test_missing_file(capsys, llama, outdir):
    r = run_dsc(capsys, "compile", outdir / "nope.onnx", llama[1], "-o", outdir / "b.dsmodel")
    _refused(r, "nope.onnx", "no such file")
    _only(outdir / "b.dsmodel", [])


def test_not_onnx(capsys, llama, outdir):
    junk = outdir / "junk.onnx"
    junk.write_text("this is not a protobuf\n" * 10)
    r = run_dsc(capsys, "compile", llama[0], junk, "-o", outdir / "b.dsmodel")
    _refused(r, "junk.onnx", "not an ONNX model")
    _only(junk, ["junk.onnx"])


def test_no_kv_cache_io(capsys, llama, outdir):
    model = bad_models.no_kv_model(outdir / "nokv.onnx")
    r = run_dsc(capsys, "compile", model, llama[1], "-o", outdir / "b.dsmodel")
    _refused(r, "nokv.onnx", "no KV-cache I/O", "past_key_values")
    _only(model, ["nokv.onnx"])


def test_encoder(capsys, llama, outdir):
    model = bad_models.encoder_model(outdir / "bert.onnx")
    r = run_dsc(capsys, "compile", llama[0], model, "-o", outdir / "b.dsmodel")
    _refused(r, "bert.onnx", "no KV-cache I/O")
    _only(model, ["bert.onnx"])


def test_non_causal_model(capsys, llama, outdir):
    model = bad_models.bidirectional_model(llama[0], outdir / "bidir.onnx")
    r = run_dsc(capsys, "compile", model, llama[1], "-o", outdir / "b.dsmodel")
    _refused(r, "bidir.onnx", "not a causal LM")
    _only(model, ["bidir.onnx"])


def test_vocab_sizes_differ(capsys, llama, outdir):
    draft = bad_models.other_vocab_model(llama[1], outdir / "small.onnx", 300)
    r = run_dsc(capsys, "compile", llama[0], draft, "-o", outdir / "b.dsmodel")
    _refused(r, "small.onnx", "draft vocab size 300 != main vocab size 320")
    _only(draft, ["small.onnx"])


def test_unmappable_attention_names_the_node(capsys, llama, outdir):
    """A Tanh of scores already masked squashes the mask itself: not Gemma 2's cap."""
    model = bad_models.softcapped_model(llama[0], outdir / "capped.onnx")
    r = run_dsc(capsys, "compile", model, llama[1], "-o", outdir / "b.dsmodel")
    _refused(r, "capped.onnx", "layer 0", "/softcap_0/Tanh", "soft-caps scores already masked")
    _only(model, ["capped.onnx"])


def test_attention_bias_is_refused_naming_layer_and_node(capsys, llama, outdir):
    """ALiBi-style scores are not a mask SpeculativeVerify can reproduce."""
    model = bad_models.alibi_model(llama[0], outdir / "alibi.onnx")
    r = run_dsc(capsys, "compile", model, llama[1], "-o", outdir / "b.dsmodel")
    _refused(r, "alibi.onnx", "layer 1", "attention span", "a bias, not a mask")
    _only(model, ["alibi.onnx"])


def test_chunked_attention_is_refused_naming_layer_and_node(capsys, llama, outdir):
    """Attention inside chunks of 4 positions: causal, but not a sliding window."""
    model = bad_models.chunked_model(llama[0], outdir / "chunked.onnx")
    r = run_dsc(capsys, "compile", model, llama[1], "-o", outdir / "b.dsmodel")
    _refused(r, "chunked.onnx", "layer 1", "layers.1/self_attn/Add", "not a sliding window")
    _only(model, ["chunked.onnx"])


def test_blocked_match_names_the_node_that_blocks_it(capsys, fixture_pairs, outdir):
    """A Where after the Softmax that is not SDPA's NaN guard: the message names it."""
    main, draft = fixture_pairs[("llama", "sdpa")]
    model = bad_models.broken_guard_model(main, outdir / "guard.onnx")
    r = run_dsc(capsys, "compile", model, draft, "-o", outdir / "b.dsmodel")
    _refused(r, "guard.onnx", "layer 0", "do not meet in one MatMul", "IsNaN '", "Where '")
    _only(model, ["guard.onnx"])


def test_a_model_onnxruntime_cannot_run_is_refused_naming_the_file(capsys, llama, outdir):
    """onnxruntime loads it but fails in the compiler's probes (as genai's builder writes a
    GroupQueryAttention whose rotary dims it cannot run): one line, not an internal error."""
    model = bad_models.unrunnable_model(llama[0], outdir / "unrunnable.onnx")
    r = run_dsc(capsys, "compile", model, llama[1], "-o", outdir / "b.dsmodel")
    _refused(r, "unrunnable.onnx", "onnxruntime cannot run it", "cannot be reshaped")
    _only(model, ["unrunnable.onnx"])


def test_output_exists_without_force(capsys, llama, outdir):
    (outdir / "b.dsmodel").mkdir()
    (outdir / "b.dsmodel" / "keep.txt").write_text("mine")
    r = run_dsc(capsys, "compile", *llama, "-o", outdir / "b.dsmodel")
    _refused(r, "b.dsmodel", "already exists", "--force")
    assert (outdir / "b.dsmodel" / "keep.txt").read_text() == "mine"


def test_output_that_is_a_symlink_is_refused(capsys, llama, tmp_path):
    """OUT as a symlink (here to a folder elsewhere) is refused before any work, with or
    without --force, and what it points to is left alone."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("mine")
    link = tmp_path / "b.dsmodel"
    link.symlink_to(elsewhere)
    for force in ((), ("--force",)):
        r = run_dsc(capsys, "compile", *llama, "-o", link, *force)
        _refused(r, "b.dsmodel", "symbolic link")
    assert link.is_symlink() and (elsewhere / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.dsmodel", "elsewhere"]


def test_unwritable_output(capsys, llama, tmp_path):
    target = tmp_path / "ro"
    target.mkdir()
    os.chmod(target, 0o555)
    if os.access(target, os.W_OK):  # root ignores permissions: use a read-only filesystem
        target = "/proc"
    try:
        r = run_dsc(capsys, "compile", *llama, "-o", f"{target}/b.dsmodel")
        _refused(r, "b.dsmodel", "cannot write")
    finally:
        os.chmod(tmp_path / "ro", 0o755)
    assert not any((tmp_path / "ro").iterdir())


def test_output_parent_missing(capsys, llama, tmp_path):
    r = run_dsc(capsys, "compile", *llama, "-o", tmp_path / "no" / "such" / "b.dsmodel")
    _refused(r, "b.dsmodel", "does not exist")


def _tokenizer_dir(path, vocab):
    from tokenizers import Tokenizer, models

    path.mkdir()
    words = {f"w{i}": i for i in range(vocab)}
    Tokenizer(models.WordLevel(words, unk_token="w0")).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w1"}))
    return path


def test_tokenizer_missing_or_unreadable(capsys, llama, outdir, tmp_path):
    r = run_dsc(capsys, "compile", *llama, "-o", outdir / "b.dsmodel",
                "--tokenizer", tmp_path / "nope")
    _refused(r, "nope", "no such directory")
    empty = tmp_path / "empty"
    empty.mkdir()
    r = run_dsc(capsys, "compile", *llama, "-o", outdir / "b.dsmodel", "--tokenizer", empty)
    _refused(r, "empty", "no tokenizer.json")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{not json")
    r = run_dsc(capsys, "compile", *llama, "-o", outdir / "b.dsmodel", "--tokenizer", broken)
    _refused(r, "broken/tokenizer.json", "not a readable tokenizer")
    big = _tokenizer_dir(tmp_path / "big", 400)
    r = run_dsc(capsys, "compile", *llama, "-o", outdir / "b.dsmodel", "--tokenizer", big)
    _refused(r, "big/tokenizer.json", "400 tokens", "vocab size 320")
    _only(outdir / "b.dsmodel", [])


def test_tokenizer_is_bundled(capsys, llama, outdir, tmp_path):
    tok = _tokenizer_dir(tmp_path / "tok", 320)
    r = run_dsc(capsys, "compile", *llama, "-o", outdir / "b.dsmodel", "--tokenizer", tok)
    assert r.code == 0, r.err
    assert (outdir / "b.dsmodel" / "tokenizer" / "tokenizer.json").read_bytes() == \
        (tok / "tokenizer.json").read_bytes()
    assert "tokenizer: tokenizer.json, tokenizer_config.json" in run_dsc(
        capsys, "inspect", outdir / "b.dsmodel").out


def test_bad_flags_are_usage_errors(capsys, llama, outdir):
    r = run_dsc(capsys, "compile", *llama, "-o", outdir / "b.dsmodel", "--block-size", "24")
    assert r.code == 2 and "--block-size" in r.err
    r = run_dsc(capsys, "compile", *llama, "-o", outdir / "b.dsmodel", "--kv-budget-mb", "0.001")
    assert r.code == 2 and "--kv-budget-mb" in r.err
    r = run_dsc(capsys, "compile", *llama)
    assert r.code == 2 and "-o" in r.err
    _only(outdir / "b.dsmodel", [])


def test_budget_too_small_for_one_sequence(capsys, llama, outdir):
    r = run_dsc(capsys, "compile", *llama, "-o", outdir / "b.dsmodel", "--kv-budget-mb", "1",
                "--max-seq-len", "100000")
    _refused(r, "--kv-budget-mb 1 is too small", "--max-seq-len 100000")
    _only(outdir / "b.dsmodel", [])


def test_failure_mid_compile_leaves_nothing(capsys, llama, outdir, monkeypatch):
    import dspark.compiler.compile as compile_mod

    def boom(*_):
        raise KeyboardInterrupt

    monkeypatch.setattr(compile_mod, "build_kernels", boom)
    r = run_dsc(capsys, "compile", *llama, "-o", outdir / "b.dsmodel")
    assert r.code == 130 and "interrupted" in r.err
    _only(outdir / "b.dsmodel", [])


def test_console_scripts_exit_2_with_one_line():
    bindir = os.path.dirname(sys.executable)
    r = subprocess.run([os.path.join(bindir, "dsc"), "inspect", "/no/such.dsmodel"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr == "dsc: error: /no/such.dsmodel: no such bundle\n"
    r = subprocess.run([os.path.join(bindir, "dsrun")], capture_output=True, text=True)
    assert r.returncode == 2 and "give --model BUNDLE" in r.stderr
    r = subprocess.run([os.path.join(bindir, "ds-tokenizer-check")], capture_output=True, text=True)
    assert r.returncode == 2 and "--draft-model" in r.stderr
