"""The warm-up's cost table kept per machine (runtime/model/cost_cache.py): measured at the
first load, read back at the next, measured again when unreadable; a stale one is read back
and written again once traffic has measured it anew."""

from __future__ import annotations

import os

import pytest

from dspark.runtime.bundle.bundle import open_bundle
from dspark.runtime.engine.engine import Engine
from dspark.runtime.model import cost_cache
from dspark.runtime.model.costs import AFTER_DRAFT, CostModel

SIZES = (1, 2, 3, 5, 9, 16, 40)


def test_a_snapshot_restores_every_price():
    costs = CostModel()
    for n, ms in ((1, 10.0), (3, 12.0), (16, 30.0), (64, 90.0)):
        costs.record("main", n, ms / 1000)
    costs.record("draft", 1, 0.004)
    costs.record(AFTER_DRAFT, 2, 0.011)
    costs.record("main", 1, 0.015, seqs=4)  # a per-sequence overhead
    back = CostModel()
    back.restore(costs.snapshot())
    for role in ("main", "draft", AFTER_DRAFT):
        for n in SIZES:
            assert back.seconds(role, n, 3) == pytest.approx(costs.seconds(role, n, 3))
    back.record("main", 1, 0.020)  # restored sizes count as measured: averaged in
    assert back.seconds("main", 1) == pytest.approx(0.010 + 0.2 * (0.020 - 0.010))


def test_a_second_warmup_reads_the_first_ones_table(compiled, tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path))
    bundle = open_bundle(compiled[("llama", "classic")])
    first = Engine(bundle, max_batch=4)
    measured = first.warmup(cached=True)
    path = cost_cache.cache_path(bundle, "cpu")
    assert "cached" not in measured and path.exists()
    second = Engine(bundle, max_batch=4)
    forwards = []
    run = second.main.forward
    second.main.forward = lambda *a, **k: forwards.append(k.get("record", True)) or run(*a, **k)
    read = second.warmup(cached=True)
    assert read["cached"] == str(path)
    # the allocating runs only, unrecorded: one token, eight sequences of one, and one
    # token on the session that runs while other processes hold the cores
    assert forwards == [False] * (3 if getattr(second.main.model, "gate", None) else 2), forwards
    for n in SIZES:
        assert second.costs.seconds("main", n) == pytest.approx(first.costs.seconds("main", n))
        assert second.costs.seconds("draft", n) == pytest.approx(first.costs.seconds("draft", n))
    assert "cached" not in Engine(bundle, max_batch=4).warmup()  # not asked: measured
    old = path.stat().st_mtime - cost_cache.MAX_AGE_S - 60
    os.utime(path, (old, old))
    stale = Engine(bundle, max_batch=4)
    assert "cached" in stale.warmup(cached=True)  # stale: read back, the load not held
    for _ in range(cost_cache.REFRESH - 1):
        stale.costs.record("main", 1, 0.001)
    assert path.stat().st_mtime == pytest.approx(old)
    stale.costs.record("main", 1, 0.001)  # refreshed by traffic: written back
    assert path.stat().st_mtime > old + cost_cache.MAX_AGE_S
    path.write_text("{not json")
    assert "cached" not in Engine(bundle, max_batch=4).warmup(cached=True)  # unreadable
    assert "cached" in Engine(bundle, max_batch=4).warmup(cached=True)  # rewritten


def test_the_key_changes_with_the_threads(compiled, tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path))
    bundle = open_bundle(compiled[("llama", "classic")])
    monkeypatch.setenv("DSPARK_THREADS", "1")
    one = cost_cache.cache_path(bundle, "cpu")
    monkeypatch.setenv("DSPARK_THREADS", "2")
    assert cost_cache.cache_path(bundle, "cpu") != one
    assert cost_cache.cache_path(bundle, "cuda") != cost_cache.cache_path(bundle, "cpu")
