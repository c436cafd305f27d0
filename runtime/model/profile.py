"""Warm-up and profiling: run every model at a few batch sizes before serving.

First runs pay onnxruntime's allocations; second runs fill the cost table (seconds per
forward size, and the per-sequence overhead from one forward of 8 one-token sequences)
that the window policies, VLB and the hybrid drafter read. Each probe scores its last token
only, as a prompt does; a verify scores every row, and pricing it so measured slower
(docs/drafting.md). The probes use sequence ids below 0, which no request gets, and leave
the arena as they found it.
"""

from __future__ import annotations

import time

from dspark.runtime.cache.kv_arena import KVArena
from dspark.runtime.model.costs import EXACT, CostModel
from dspark.runtime.model.runner import ModelRunner

PROBE, PROBES = -1, tuple(range(-9, -1))


def warmup(arena: KVArena, costs: CostModel, runners: dict[str, list[ModelRunner]],
           sizes: dict[str, list[int]], solo=None, measure: bool = True) -> dict:
    """runners/sizes by cost role ("main", "draft"); returns seconds and main ms per size.
    `measure=False`: the allocating first runs only, the table left as it is (a load that
    reads its table from the cache).
    `solo`: the load gate's `pinned` (load_gate.py), when forwards may run solo: the main's
    verify sizes (up to EXACT) are probed in that mode too. Copied from the pool's table, a
    solo verify was priced as the pool's against a decode measured solo, too cheap, and the
    sizes seldom verified kept that price."""
    for seq_id in (PROBE, *PROBES):
        arena.add_sequence(seq_id)
    t0 = time.perf_counter()
    try:
        passes = (False, True) if measure else (False,)
        for recording in passes:
            if recording:
                costs.reset()
            for role, runner_list in runners.items():
                for runner in runner_list:
                    _sizes(arena, runner, sizes[role], record=recording)
                    runner.forward([(p, 0, [1]) for p in PROBES], [1] * len(PROBES),
                                   record=recording)
                    for p in PROBES:
                        arena.rollback(p, runner.pool, 0)
        if solo is not None:
            with solo(True):
                verifies = [n for n in sizes["main"] if n <= EXACT]
                for recording in passes:  # a solo session's first runs allocate
                    for runner in runners["main"]:
                        _sizes(arena, runner, verifies, record=recording)
    finally:
        for seq_id in (PROBE, *PROBES):
            arena.release(seq_id)
    seconds = {n: costs.seconds("main", n) for n in sizes["main"]}
    return {"seconds": time.perf_counter() - t0,
            "main_ms": {n: round(1000 * t, 2) for n, t in seconds.items() if t is not None}}


def _sizes(arena: KVArena, runner: ModelRunner, sizes: list[int], record: bool = True) -> None:
    """One forward of each size from an empty cache, its last token scored."""
    for n in sizes:
        runner.forward([(PROBE, 0, [1] * n)], [1], record=record)
        arena.rollback(PROBE, runner.pool, 0)
