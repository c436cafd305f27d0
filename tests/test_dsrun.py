"""dsrun generate and bench through their CLI; every bad input is one line and exit 2."""

from __future__ import annotations

import json
import shutil

import pytest

from cli_helpers import run_dsrun


def test_generate_json_and_plain_agree(capsys, compiled):
    bundle = compiled[("gpt2", "classic")]
    # --drafter draft: the draft model drafts every round (the default hybrid may find, from
    # the tiny model's measured costs, that no draft pays, and draft nothing)
    r = run_dsrun(capsys, "generate", "--model", bundle, "--prompt-ids", "1,2,3,4",
                  "--max-tokens", "16", "--json", "--drafter", "draft")
    assert r.code == 0, r.err
    spec = json.loads(r.out)
    assert len(spec["token_ids"]) == 16 and spec["finish_reason"] == "length"
    assert set(spec["stats"]) == {"rounds", "draft_tokens", "accepted_tokens",
                                  "mean_accepted_per_round", "acceptance_rate", "mean_window",
                                  "methods", "sources", "tokens_per_s", "ttft_ms"}
    assert spec["stats"]["draft_tokens"] > 0 and spec["stats"]["ttft_ms"] > 0
    r = run_dsrun(capsys, "generate", "--model", bundle, "--prompt-ids", "1,2,3,4",
                  "--max-tokens", "16", "--json", "--no-speculative")
    plain = json.loads(r.out)
    assert plain["token_ids"] == spec["token_ids"] and plain["stats"]["draft_tokens"] == 0
    r = run_dsrun(capsys, "generate", "--model", bundle, "--prompt-ids", "1,2,3,4",
                  "--max-tokens", "16", "--window", "2")
    assert r.out.strip() == ",".join(map(str, spec["token_ids"]))
    assert "[dsrun] 16 tokens" in r.err


def test_generate_text_chat_and_stop(capsys, tok_bundle):
    r = run_dsrun(capsys, "generate", "--model", tok_bundle, "--chat", "hello world",
                  "--max-tokens", "12", "--json")
    assert r.code == 0, r.err
    phases = [line.split(" in ")[0] for line in r.err.splitlines() if line.startswith("[dsrun]")]
    assert phases[:2] == ["[dsrun] bundle opened, its files checked",
                          "[dsrun] sessions built, the KV cache allocated"], r.err
    assert phases[2] in ("[dsrun] warmed up (the cost table measured)", "[dsrun] warmed up "
                         "(the cost table read from this machine's last load)"), r.err
    quiet = run_dsrun(capsys, "generate", "--model", tok_bundle, "--chat", "hello world",
                      "--max-tokens", "12", "--json", "--quiet")
    assert quiet.code == 0 and quiet.err == ""
    assert json.loads(quiet.out)["token_ids"] == json.loads(r.out)["token_ids"]
    out = json.loads(r.out)
    assert out["text"] and len(out["token_ids"]) == 12
    first = out["text"].split()[1]
    r = run_dsrun(capsys, "generate", "--model", tok_bundle, "--chat", "hello world",
                  "--max-tokens", "12", "--json", "--stop", first)
    stopped = json.loads(r.out)
    assert stopped["finish_reason"] == "stop" and first not in stopped["text"]
    r = run_dsrun(capsys, "generate", "--model", tok_bundle, "--prompt", "hello world w7",
                  "--max-tokens", "4", "--temperature", "0.8", "--seed", "3", "--json",
                  "--drafter", "draft")
    again = run_dsrun(capsys, "generate", "--model", tok_bundle, "--prompt", "hello world w7",
                      "--max-tokens", "4", "--temperature", "0.8", "--seed", "3", "--json",
                      "--drafter", "draft")
    assert json.loads(r.out)["token_ids"] == json.loads(again.out)["token_ids"]


def _refused(r, *fragments):
    assert r.code == 2, (r.code, r.out, r.err)
    lines = [x for x in r.err.splitlines() if x and not x.startswith("[dsrun]")]  # progress
    assert "Traceback" not in r.err and len(lines) <= 3, r.err
    for f in fragments:
        assert f in r.err, (f, r.err)


def test_generate_bad_input(capsys, compiled, tok_bundle, tmp_path):
    bundle = compiled[("gpt2", "classic")]
    gen = ("generate", "--model")
    _refused(run_dsrun(capsys, *gen, tmp_path / "nope.dsmodel", "--prompt-ids", "1"),
             "nope.dsmodel: no such bundle")
    _refused(run_dsrun(capsys, *gen, bundle, "--prompt-ids", "1", "--max-tokens", "0"),
             "--max-tokens")
    _refused(run_dsrun(capsys, *gen, bundle, "--prompt-ids", "1", "--max-tokens", "-4"),
             "--max-tokens")
    _refused(run_dsrun(capsys, *gen, bundle, "--prompt-ids", "1", "--window", "0"), "--window")
    _refused(run_dsrun(capsys, *gen, bundle, "--prompt-ids", "1,999"),
             "token id 999 is outside the vocabulary [0, 320)")
    _refused(run_dsrun(capsys, *gen, bundle, "--prompt-ids", "1,x"), "--prompt-ids")
    _refused(run_dsrun(capsys, *gen, bundle, "--prompt", "hi"), "no tokenizer: use --prompt-ids")
    _refused(run_dsrun(capsys, *gen, bundle, "--prompt", "hi", "--prompt-ids", "1"),
             "exactly one of")
    long_prompt = ",".join(["5"] * 70)
    _refused(run_dsrun(capsys, *gen, tok_bundle, "--prompt-ids", long_prompt),
             "70 tokens", "maximum context length is 64")
    _refused(run_dsrun(capsys, *gen, tok_bundle, "--prompt-ids", "1,2,3", "--max-tokens", "62"),
             "exceeds the maximum context length 64")
    tampered = tmp_path / "t.dsmodel"
    shutil.copytree(bundle, tampered)
    (tampered / "draft" / "weights.bin").write_bytes(b"\0" * 10)
    _refused(run_dsrun(capsys, *gen, tampered, "--prompt-ids", "1"), "draft/weights.bin")
    _refused(run_dsrun(capsys, "--model", tmp_path / "gone.dsmodel"),
             "gone.dsmodel: no such bundle")


def test_bench_reports_speedup_and_bound(capsys, compiled, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"name": "a", "class": "code", "prompt_ids": [1, 2, 3]}\n'
                       '{"name": "b", "class": "chat", "prompt_ids": [9, 8, 7, 6, 5]}\n')
    png = tmp_path / "bench.png"
    r = run_dsrun(capsys, "bench", "--model", compiled[("llama", "dynamo")], "--prompts", prompts,
                  "--max-tokens", "12", "--repeats", "2", "--json", "--plot", png,
                  "--drafter", "draft")
    assert r.code == 0, r.err
    report = json.loads(r.out)
    assert [c["name"] for c in report["classes"]] == ["chat", "code"]
    for row in report["prompts"] + report["classes"]:
        assert row["identical"] and row["tps_plain"] > 0 and row["tps_spec"] > 0
        assert 0 <= row["alpha"] < 1 and row["c"] > 0 and row["bound"] > 0
        assert row["measured_over_bound"] == pytest.approx(row["speedup"] / row["bound"])
    assert png.read_bytes()[:4] == b"\x89PNG"
    r = run_dsrun(capsys, "bench", "--model", compiled[("llama", "dynamo")], "--prompts", prompts,
                  "--max-tokens", "4", "--repeats", "1")
    assert "speedup" in r.out and "meas/bound" in r.out
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n")
    _refused(run_dsrun(capsys, "bench", "--model", compiled[("llama", "dynamo")], "--prompts",
                       bad), "bad.jsonl:1: not JSON")


@pytest.mark.parametrize("given, opt_out, expect", [
    ("glibc.malloc.arena_max=4", False, "glibc.malloc.arena_max=4:glibc.malloc.hugetlb=1"),
    ("glibc.malloc.arena_max=4", True, "glibc.malloc.arena_max=4"),
    (None, False, "glibc.malloc.hugetlb=1:glibc.malloc.arena_max=2")])
def test_commands_rerun_with_glibc_malloc_tunables(given, opt_out, expect):
    """dsrun and ds-inference-server re-run themselves with glibc's huge-page and arena
    tunables (read only at start-up), keeping tunables already set, unless
    DSPARK_HUGEPAGES=0."""
    import os
    import subprocess
    import sys

    code = ("from dspark.runtime.cli.util import with_hugepages; with_hugepages(); "
            "import os; print(os.environ.get('GLIBC_TUNABLES'))")
    env = {k: v for k, v in os.environ.items()
           if k not in ("GLIBC_TUNABLES", "DSPARK_HUGEPAGES")}
    if given is not None:
        env["GLIBC_TUNABLES"] = given
    if opt_out:
        env["DSPARK_HUGEPAGES"] = "0"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == expect


@pytest.mark.parametrize("segments", [False, True], ids=["one-session", "segments"])
def test_bench_profile_accounts_for_the_step(capsys, compiled, monkeypatch, segments):
    """--profile splits a decode and a verify step into parts that add up to the step: the
    one session (attention inside) or, with the CPU op off, the segments and the attention."""
    if segments:
        monkeypatch.setenv("DSPARK_CPU_OP", "0")
    r = run_dsrun(capsys, "bench", "--model", compiled[("llama", "classic")], "--profile",
                  "--repeats", "1", "--json")
    assert r.code == 0, r.err
    report = json.loads(r.out)
    assert set(report["models"]) == {"main", "draft"}
    keys = (("feeds_ms", "first_segment_ms", "layer_segments_ms", "last_segment_ms",
             "attention_ms", "glue_ms") if segments else ("feeds_ms", "session_ms", "glue_ms"))
    for model in report["models"].values():
        assert model["weight_bytes"] > 0
        assert ("segments" in model["executor"]) == segments
        for step in model["steps"].values():
            parts = sum(step[k] for k in keys)
            assert parts == pytest.approx(step["total_ms"], rel=0.4)
            assert step[keys[-2]] > 0 and step["gb_per_s"] > 0
        ops = model["op_shares"]["decode"]
        assert ops["ops"]["MatMul"] > 0 and 0 < ops["kernel_ms"] <= ops["run_ms"]
        assert ("SpeculativeVerify" in ops["ops"]) != segments  # the op runs inside
    assert report["engine"]["tokens"] > 0 and report["engine"]["engine_ms_per_token"] >= 0


def test_bench_profile_at_a_given_context(capsys, compiled):
    """--context and --verify-tokens set where the profile's steps run; a context past the
    bundle's length is a usage error naming the option, before anything is measured."""
    bundle = compiled[("llama", "classic")]
    r = run_dsrun(capsys, "bench", "--model", bundle, "--profile", "--repeats", "1", "--json",
                  "--context", "40", "--verify-tokens", "3")
    assert r.code == 0, r.err
    report = json.loads(r.out)
    assert (report["context"], report["verify_tokens"]) == (40, 3)
    assert all(m["steps"]["verify"]["tokens"] == 3 for m in report["models"].values())
    r = run_dsrun(capsys, "bench", "--model", bundle, "--profile", "--context", "100000")
    assert r.code == 2
    assert "--context" in r.err and "context length" in r.err and "Traceback" not in r.err
