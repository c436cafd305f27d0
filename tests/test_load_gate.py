"""Forwards leave the pool while other processes hold the cores (runtime/model/load_gate.py):
by default our ops' work runs on the calling thread, under DSPARK_THREADS=adaptive a session
without a pool takes the forward; by measured load, with the same bits in either mode."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from dspark.runtime import env
from dspark.runtime.model.load_gate import LoadGate


class FakeHost:
    """Readings of other processes' cores, one per sample() (None: unknown)."""

    def __init__(self, readings):
        self.readings = list(readings)

    def sample(self):
        return self.readings.pop(0) if self.readings else None


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _gate(readings, cores=2, every=0.25):
    clock = Clock()
    return LoadGate(cores, FakeHost(readings), clock, every), clock


def _modes(gate, clock, steps):
    out = []
    for _ in range(steps):
        out.append(gate.check())
        clock.now += 0.3
    return out


def test_a_lasting_load_sends_forwards_solo_and_its_end_brings_them_back():
    gate, clock = _gate([0.0, 1.0, 1.0, 1.0, 0.1, 0.1, 0.1])
    assert _modes(gate, clock, 7) == [False, False, True, True, True, False, False]
    assert gate.switches == 2


def test_one_high_reading_is_not_a_load():
    # another onnxruntime process's pool spins for a moment after each run: one reading
    gate, clock = _gate([0.0, 0.9, 0.0, 0.9, 0.0, 0.9])
    assert not any(_modes(gate, clock, 6)) and gate.switches == 0


def test_between_the_thresholds_the_mode_holds():
    gate, clock = _gate([0.8, 0.8, 0.4, 0.4, 0.4, 0.2, 0.2])
    assert _modes(gate, clock, 7) == [False, True, True, True, True, True, False]


def test_more_cores_count_only_what_the_last_free_core_loses():
    gate, clock = _gate([2.4, 2.4, 2.6, 2.6], cores=4)  # 4 cores, 2.4 taken: 1.6 left
    assert _modes(gate, clock, 4) == [False, False, False, True]


def test_readings_are_taken_at_most_every_interval():
    gate, clock = _gate([1.0, 1.0, 1.0])
    for _ in range(10):
        gate.check()  # no time passes: one reading
    assert len(gate.host.readings) == 2


def test_unknown_load_keeps_the_pool():
    gate, clock = _gate([None, None, None])
    assert not any(_modes(gate, clock, 3))


def test_adaptive_threads_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("DSPARK_THREADS", "adaptive")
    monkeypatch.setattr(env.os, "cpu_count", lambda: 2)
    e = env.read_env()
    assert e.adaptive and e.follow_load and e.threads == 2
    monkeypatch.setattr(env.os, "cpu_count", lambda: 1)
    assert not env.read_env().adaptive  # one core: nothing to leave
    assert not env.read_env().follow_load
    monkeypatch.setattr(env.os, "cpu_count", lambda: 2)
    monkeypatch.setenv("DSPARK_THREADS", "")
    e = env.read_env()
    assert e.follow_load and not e.adaptive  # the default: our ops follow the load
    monkeypatch.setenv("DSPARK_THREADS", "2")
    e = env.read_env()
    assert not e.adaptive and not e.follow_load  # a number: that many threads, always
    monkeypatch.setenv("DSPARK_THREADS", "lots")
    with pytest.raises(env.DSparkError, match="integer, auto or adaptive"):
        env.read_env()


# Run in a process of its own: the mode's sessions exist only without the global pool, which
# this test process created at import (conftest).
ADAPTIVE_RUN = textwrap.dedent("""
    import ctypes, json, sys
    import numpy as np
    from dspark.runtime.engine.loader import load_engine
    from dspark.runtime.model.load_gate import shared_gate
    from dspark.runtime.sequence.request import GenerationRequest

    engine, _ = load_engine(sys.argv[1], window=4, watch=False, warmup=False)
    gate = shared_gate()
    gate.every = float("inf")  # no readings: the test sets the mode
    gate.at = gate.clock()
    runners = [engine.main, *engine.draft_models.values()]
    out = {"solo_sessions": [r.model.solo is not None for r in runners], "equal": [],
           "switch": []}
    flag = ctypes.c_int.in_dll(ctypes.CDLL(str(engine.main.model.library)), "dspark_solo")
    engine.arena.add_sequence(1)
    ids = np.random.default_rng(0).integers(0, 200, 24).tolist()
    for r in runners:
        for start, toks, rows in ((0, ids[:16], 1), (16, ids[16:17], 1), (17, ids[17:24], 7)):
            got = []
            for solo in (False, True):
                gate.solo = solo
                got.append(r.forward([(1, start, toks)], [rows], record=False)[0].copy())
                out["switch"].append(flag.value)
            out["equal"].append(bool(np.array_equal(*got)))
    out["solo_forwards"] = [r.model.solo_forwards for r in runners]
    engine.arena.release(1)

    class Flip:  # a gate whose mode changes every forward
        solo = False
        def check(self):
            self.solo = not self.solo
            return self.solo
    for r in runners:
        r.model.gate = Flip()
    prompts = [tuple(ids[i:i + 6]) for i in (0, 6, 12)]
    plain = engine.generate([GenerationRequest(p, 20, speculative=False) for p in prompts])
    spec = engine.generate([GenerationRequest(p, 20, method="draft") for p in prompts])
    out["same"] = [s.generated for s in spec] == [s.generated for s in plain]
    out["drafted"] = sum(s.stats.draft_tokens for s in spec)
    out["accepted"] = sum(s.stats.accepted_tokens for s in spec)
    print(json.dumps(out))
""")


@pytest.mark.parametrize("threads", ["adaptive", ""])
def test_solo_forwards_give_the_pools_bits_and_speculation_stays_exact(int4_self_bundle,
                                                                       threads):
    """Solo forwards: under `adaptive` a session without a pool, otherwise the pool's session
    with our ops' work on the calling thread (the library's switch)."""
    bundle, _ = int4_self_bundle
    if (env.os.cpu_count() or 1) < 2:
        pytest.skip("one core: no pool to leave")
    env_vars = {**env.os.environ, "DSPARK_THREADS": threads}
    done = subprocess.run([sys.executable, "-c", ADAPTIVE_RUN, str(bundle)], env=env_vars,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    adaptive = threads == "adaptive"
    assert out["solo_sessions"] == [adaptive, adaptive]  # main and its int4 draft
    assert all(out["equal"]) and len(out["equal"]) == 6
    # a solo forward on the pool's session set the switch; the adaptive one leaves it off
    assert out["switch"] == [0, 0 if adaptive else 1] * 6
    assert out["solo_forwards"] == [3, 3]
    assert out["same"] and out["drafted"] > 0, out  # drafts verified across switches


def test_a_pinned_mode_holds_whatever_the_load_and_the_mode_before_returns():
    gate, clock = _gate([1.0, 1.0, 1.0, 1.0])
    with gate.pinned(True):
        assert _modes(gate, clock, 3) == [True] * 3 and gate.solo
    assert len(gate.host.readings) == 4 and not gate.solo  # no reading taken meanwhile
    assert _modes(gate, clock, 2) == [False, True]  # then the load decides again
