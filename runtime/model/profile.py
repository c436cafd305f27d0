"""Warm-up and profiling: run every model at a few batch sizes before serving.

First runs pay onnxruntime's allocations; second runs fill the cost table (seconds per
forward size, and the per-sequence overhead from one forward of 8 one-token sequences)
that the window policies, VLB and the hybrid drafter read. Then each model's context cost
(costs.py): a one- and an eight-token forward after no cached positions and after a long
prompt, interleaved, medians of CONTEXT_REPEATS. The probes use sequence ids below 0,
which no request gets, and leave the arena as they found it.
"""

from __future__ import annotations

import statistics
import time

from dspark.runtime.cache.kv_arena import KVArena
from dspark.runtime.model.costs import CostModel
from dspark.runtime.model.runner import ModelRunner

PROBE, PROBES = -1, tuple(range(-9, -1))
CONTEXT_TOKENS = 512  # the long prompt the context cost is measured after (at most)
CONTEXT_REPEATS = 3
WIDE = 8  # the multi-token forward's tokens
MIN_CONTEXT = 64  # a shorter bundle's context cost is left at 0


def warmup(arena: KVArena, costs: CostModel, runners: dict[str, list[ModelRunner]],
           sizes: dict[str, list[int]], context: int = 0) -> dict:
    """runners/sizes by cost role ("main", "draft"); `context`: the cached positions the
    context cost is measured after (under MIN_CONTEXT: not measured). Returns seconds, the
    main's ms per size and each role's context cost."""
    for seq_id in (PROBE, *PROBES):
        arena.add_sequence(seq_id)
    t0 = time.perf_counter()
    try:
        for measure in (False, True):
            if measure:
                costs.reset()
            for role, runner_list in runners.items():
                for runner in runner_list:
                    for n in sizes[role]:
                        runner.forward([(PROBE, 0, [1] * n)], [1])
                        arena.rollback(PROBE, runner.pool, 0)
                    runner.forward([(p, 0, [1]) for p in PROBES], [1] * len(PROBES))
                    for p in PROBES:
                        arena.rollback(p, runner.pool, 0)
        if context >= MIN_CONTEXT:
            for role, runner_list in runners.items():
                if runner_list:
                    costs.context[role] = context_cost(arena, runner_list[0], context)
    finally:
        for seq_id in (PROBE, *PROBES):
            arena.release(seq_id)
    return {"seconds": time.perf_counter() - t0,
            "main_ms": {n: round(1000 * costs.seconds("main", n), 2) for n in sizes["main"]},
            "context_us": {role: [round(1e6 * x, 3) for x in rp]
                           for role, rp in costs.context.items()}}


def context_cost(arena: KVArena, runner: ModelRunner, length: int) -> tuple[float, float]:
    """(r, p) of costs.py: seconds per cached position read, and per cached position and
    new token, from forwards of 1 and WIDE tokens after no cached positions and after
    `length` of them."""
    runner.forward([(PROBE, 0, [1] * length)], [1], record=False)
    times: dict[tuple[int, int], list[float]] = {}
    for _ in range(CONTEXT_REPEATS):
        for start in (0, length):
            for n in (1, WIDE):
                t0 = time.perf_counter()
                runner.forward([(PROBE, start, [1] * n)], [1], record=False)
                times.setdefault((start, n), []).append(time.perf_counter() - t0)
    arena.rollback(PROBE, runner.pool, 0)
    t = {key: statistics.median(v) for key, v in times.items()}
    one = max(0.0, t[length, 1] - t[0, 1]) / length  # r + p
    wide = max(0.0, t[length, WIDE] - t[0, WIDE]) / length  # r + WIDE p
    p = max(0.0, (wide - one) / (WIDE - 1))
    return max(0.0, one - p), p
