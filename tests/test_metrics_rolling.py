"""The one-minute gauges (runtime/server/metrics.py) kept by running sums and a sorted list:
after every step they equal what the minute's rounds and verifies give recomputed from
scratch, as rounds arrive and leave the minute, per tenant."""

from __future__ import annotations

import random

from prometheus_client.parser import text_string_to_metric_families

from dspark.runtime.engine.snapshot import EngineGauges, RoundRecord, StepReport
from dspark.runtime.server.metrics import MINUTE, Metrics

GAUGES = EngineGauges(None, 0, 1, 30.0, 0.1, 0.9, 0.9, 0.0, 0.0, 0, 0, False, 0, 0.5, None)


def _samples(metrics: Metrics) -> dict[tuple, float]:
    text = metrics.render().decode()
    return {(s.name, s.labels.get("tenant")): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def _expected(history: list[tuple], now: float) -> dict[tuple, float]:
    """The gauges recomputed from the rounds and verifies of the minute before `now`."""
    rounds = [h for h in history if h[1] is not None and now - h[0] <= MINUTE]
    out: dict[tuple, float] = {}
    span = max(1.0, min(MINUTE, now - rounds[0][0])) if rounds else MINUTE
    for tenant in {r[1].tenant for r in rounds}:
        mine = [r[1] for r in rounds if r[1].tenant == tenant]
        drafted = sum(r.drafted for r in mine)
        out[("dflash_window_size_current", tenant)] = sum(r.window for r in mine) / len(mine)
        out[("dflash_reject_rate_1m", tenant)] = (
            1 - sum(r.accepted for r in mine) / drafted if drafted else 0)
        out[("dflash_scheduler_decision_count_1m", tenant)] = len(mine)
        out[("dflash_accept_throughput_tps", tenant)] = sum(r.accepted + 1 for r in mine) / span
    latencies = sorted(h[2] for h in history if now - h[0] <= MINUTE)
    out[("dspar_verify_latency_p99_ms", None)] = latencies[
        min(len(latencies) - 1, int(0.99 * len(latencies)))]
    return out


def test_rolling_gauges_equal_the_minute_recomputed():
    rng = random.Random(5)
    metrics, history, now = Metrics("m", "cpu"), [], 1000.0
    for step in range(3000):
        now += rng.choice([0.004, 0.03, 0.5])  # three minutes and more of steps
        record = None
        if rng.random() < 0.7:
            drafted = rng.randint(0, 5)
            record = RoundRecord(rng.choice(["a", "b"]) if step < 2500 else "a",
                                 rng.randint(drafted, 8), drafted, rng.randint(0, drafted),
                                 ("lookup",) * drafted, "lookup" if drafted else "plain")
        verify_ms = round(rng.uniform(2, 40), 1)
        history.append((now, record, verify_ms))
        metrics.observe(StepReport((), (record,) if record else (), verify_ms), GAUGES, now)
        if step % 97 == 0 or step > 2990:
            got = _samples(metrics)
            for key, value in _expected(history, now).items():
                assert abs(got[key] - value) < 1e-9, (step, key)
    # tenant "b" left the minute: no rounds, its gauges keep their last values
    assert metrics.sums["b"][0] == 0 and ("dflash_reject_rate_1m", "b") in _samples(metrics)
    assert len(metrics.latencies) == len(metrics.verifies)


def test_counters_count_every_round():
    metrics = Metrics("m", "cpu")
    rounds = [RoundRecord("t", 4, 3, 2, ("lookup", "lookup", "draft"), "lookup+draft"),
              RoundRecord("t", 0, 0, 0, (), "plain")]
    for i, r in enumerate(rounds):
        metrics.observe(StepReport((), (r,), 3.0), GAUGES, 10.0 + i)
    text = metrics.render().decode()
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for f in text_string_to_metric_families(text) for s in f.samples}
    base = (("device", "cpu"), ("model", "m"), ("tenant", "t"))
    assert got[("dflash_draft_tokens_total", base)] == 3
    assert got[("dflash_accepted_tokens_total", base)] == 2
    assert got[("dflash_draft_method_rounds_total",
                tuple(sorted((*base, ("method", "plain")))))] == 1
    assert got[("dflash_draft_tokens_by_source_total", tuple(sorted(
        (*base, ("source", "lookup"), ("result", "accepted")))))] == 2
    draft = tuple(sorted((*base, ("source", "draft"), ("result", "drafted"))))
    assert got[("dflash_draft_tokens_by_source_total", draft)] == 1
    assert got[("dflash_accepted_tokens_by_position_total", tuple(sorted(
        (*base, ("position", "2")))))] == 1
