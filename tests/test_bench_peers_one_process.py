"""bench_peers --one-process: a dsrun bundle's modes served by one worker, each request line
naming its mode (samples/bench_peers.py, samples/peer_workers.py)."""

from __future__ import annotations

import argparse
import io
import json
import sys

import bench_peers
import peer_workers


def test_dsrun_systems_of_one_bundle_share_a_process_and_peers_keep_their_own():
    shared = argparse.Namespace(one_process=True)
    assert bench_peers.process_of("dsrun-q4-plain", shared) == ("dsrun-q4-*", "plain")
    assert bench_peers.process_of("dsrun-q4-default", shared) == ("dsrun-q4-*", "default")
    # a second process (#N) and a thread count (@tN) stay apart from the first
    assert bench_peers.process_of("dsrun-q4-default#2", shared) == ("dsrun-q4-*#2", "default")
    assert bench_peers.process_of("dsrun-q4-plain@t1", shared) == ("dsrun-q4-*@t1", "plain")
    assert bench_peers.process_of("dsrun-fp32-ngram@tauto#3", shared) == (
        "dsrun-fp32-*@tauto#3", "ngram")
    assert bench_peers.process_of("genai-int4-ngram", shared) == ("genai-int4-ngram", None)
    apart = argparse.Namespace(one_process=False)
    assert bench_peers.process_of("dsrun-q4-default", apart) == ("dsrun-q4-default", None)


def test_a_shared_worker_warms_every_mode_and_runs_the_one_each_line_names(monkeypatch, capsys):
    calls = []

    def run(ids, n, seed, mode="plain"):
        calls.append((tuple(ids), n, seed, mode))
        return [len(calls)], 0.5, {"mode": mode}

    prompts = [{"name": "a", "class": "chat", "ids": [1, 2]},
               {"name": "b", "class": "code", "ids": [3]}]
    monkeypatch.setattr(sys, "stdin", io.StringIO("1 7 default\n0 8 plain\n"))
    peer_workers.emit_runs(run, prompts, 16, ("plain", "default"))
    lines = capsys.readouterr().out.splitlines()
    assert calls[:2] == [((1, 2), 8, 0, "plain"), ((1, 2), 8, 0, "default")]  # warm-ups
    assert calls[2:] == [((3,), 16, 7, "default"), ((1, 2), 16, 8, "plain")]
    assert lines[0] == "ready"
    results = [json.loads(line) for line in lines[1:]]
    assert [(r["name"], r["mode"]) for r in results] == [("b", "default"), ("a", "plain")]


def test_a_single_mode_worker_reads_lines_without_a_mode(monkeypatch, capsys):
    calls = []

    def run(ids, n, seed):
        calls.append((tuple(ids), n, seed))
        return [9], 0.25

    monkeypatch.setattr(sys, "stdin", io.StringIO("0 3\n"))
    peer_workers.emit_runs(run, [{"name": "a", "class": "edit", "ids": [4]}], 5)
    assert calls == [((4,), 8, 0), ((4,), 5, 3)]
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "ready" and json.loads(out[1])["tokens"] == [9]
