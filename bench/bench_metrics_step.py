"""What the server's metrics cost an engine step once a busy minute is behind them.

    python bench/bench_metrics_step.py [--steps-per-minute 12000]
    PYTHONPATH=build/revisions/bfc16ac-path python bench/bench_metrics_step.py  # an older one

Fills runtime/server/metrics.py's one-minute windows with a minute of steps (a q4 SmolLM2
serving one client back to back makes ~12000), then times Metrics.on_step, the call the
engine thread makes after every step, for a plain step and for a speculative round: the
median of 2000 calls (the /proc read every few seconds left out). An older revision, put
first on PYTHONPATH as above (bench_revisions.py checks one out), is filled through its
deques directly.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from dspark.runtime.engine.snapshot import EngineGauges, RoundRecord, StepReport
from dspark.runtime.server.metrics import MINUTE, Metrics


def _gauges() -> EngineGauges:
    values = {"waiting": 0, "running": 1, "resize_grace_s": 30.0, "kv_usage": 0.1,
              "hit_rate": 0.9, "kdr": 0.9, "vfi": 0.0, "clca": 0.0, "compactions": 0,
              "defrag_moves": 0, "degraded": False, "switches": 0, "utilisation": 0.5,
              "reloads": None}
    return EngineGauges(**{f.name: values.get(f.name) for f in dataclasses.fields(EngineGauges)})


def step_cost(speculative: bool, per_minute: int, calls: int = 2000) -> float:
    """Median microseconds of on_step after `per_minute` steps in the last minute."""
    metrics, gauges = Metrics("m", "cpu"), _gauges()
    metrics._host = lambda now: None  # /proc every HOST_EVERY s: not per step, left out
    rounds = (RoundRecord("default", 0, 0, 0, (), "plain"),) if speculative else ()
    report = StepReport((), rounds, 4.0)
    now = time.perf_counter()
    for i in range(per_minute):
        at = now - MINUTE + i * MINUTE / per_minute
        if hasattr(metrics, "observe"):
            metrics.observe(report, gauges, at)
        else:  # revisions before the running sums
            metrics.verifies.append((at, 4.0))
            if speculative:
                metrics.rounds.append((at, "default", 0, 0, 0))
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        metrics.on_step(report, gauges, 0.004)
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps-per-minute", type=int, default=12000)
    args = ap.parse_args()
    import dspark.runtime.server.metrics as module

    print(f"{module.__file__}: a minute of {args.steps_per_minute} steps behind")
    for speculative in (False, True):
        print(f"on_step, {'speculative round' if speculative else 'plain step':17s} "
              f"{step_cost(speculative, args.steps_per_minute):8.0f} us (median)")


if __name__ == "__main__":
    main()
