"""Warm-up and profiling: run every model at a few batch sizes before serving.

First runs pay onnxruntime's allocations; second runs fill the cost table (seconds per
forward size, and the per-sequence overhead from one forward of 8 one-token sequences)
that the window policies, VLB and the hybrid drafter read. The forwards are shaped as the
rounds': the main's score every token, as a verify does (costs.py), a draft's its last.
The probes use sequence ids below 0, which no request gets, and leave the arena as they
found it.
"""

from __future__ import annotations

import time

from dspark.runtime.cache.kv_arena import KVArena
from dspark.runtime.model.costs import CostModel
from dspark.runtime.model.runner import ModelRunner

PROBE, PROBES = -1, tuple(range(-9, -1))


def warmup(arena: KVArena, costs: CostModel, runners: dict[str, list[ModelRunner]],
           sizes: dict[str, list[int]]) -> dict:
    """runners/sizes by cost role ("main", "draft"); returns seconds and main ms per size."""
    for seq_id in (PROBE, *PROBES):
        arena.add_sequence(seq_id)
    t0 = time.perf_counter()
    try:
        for measure in (False, True):
            if measure:
                costs.reset()
            for role, runner_list in runners.items():
                for runner in runner_list:
                    for n in sizes[role]:  # the main's as a verify (every row scored)
                        runner.forward([(PROBE, 0, [1] * n)], [n if role == "main" else 1])
                        arena.rollback(PROBE, runner.pool, 0)
                    runner.forward([(p, 0, [1]) for p in PROBES], [1] * len(PROBES))
                    for p in PROBES:
                        arena.rollback(p, runner.pool, 0)
    finally:
        for seq_id in (PROBE, *PROBES):
            arena.release(seq_id)
    return {"seconds": time.perf_counter() - t0,
            "main_ms": {n: round(1000 * costs.seconds("main", n), 2) for n in sizes["main"]}}
