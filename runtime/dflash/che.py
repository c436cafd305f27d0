"""CHE, the cache health evaluator: measures the arena and repairs it between steps.

    KDR  key density ratio: valid tokens / allocated capacity      compact below kdr_min
         (compaction releases slack: blocks past a sequence's lengths, left by rejected drafts)
    VFI  largest hole between allocated blocks / arena size          defragment above vfi_max
         (moves the highest allocated blocks into the lowest holes, updating block tables)
    CLCA spread of per-layer used lengths (std / mean): 0 unless layers keep different
         lengths (sliding-window layers); reported, nothing to repair here
    hit rate: fraction of the blocks a verify step reads that continue a contiguous run
It runs every interval_ms, from the engine between forwards (never while one reads the
arena), and each repair stops at repair_budget_ms.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from dspark.runtime.bundle.config import CacheHealthConfig
from dspark.runtime.cache.kv_arena import KVArena


@dataclass(frozen=True)
class Health:
    kdr: float
    vfi: float
    clca: float
    used_blocks: int


def measure(arena: KVArena) -> Health:
    """KDR over the main group's held blocks (a shared block's filled slots counted once),
    VFI over its occupied blocks (held or cached)."""
    group = arena.main
    name, bs, used = group.layout.name, arena.block_size, group.blocks.held
    filled: dict[int, int] = {}
    for t in arena.tables.values():
        length = max(t.lengths.values(), default=0)
        for i, b in enumerate(t.blocks[name]):
            if b >= 0:
                filled[b] = max(filled.get(b, 0), min(bs, max(0, length - i * bs)))
    kdr = sum(filled.values()) / (used * bs) if used else 1.0
    occupied = group.blocks.occupied()
    holes = [b - a - 1 for a, b in zip(occupied, occupied[1:])]
    vfi = max(holes, default=0) / group.layout.num_blocks
    return Health(kdr, vfi, 0.0, used)


def hit_rate(tables: list[list[int]]) -> float:
    """Fraction of blocks that continue a contiguous run (block == previous + 1)."""
    total = sum(len(t) for t in tables)
    runs = sum(1 for t in tables for a, b in zip(t, t[1:]) if b == a + 1)
    heads = sum(1 for t in tables if t)
    return (runs + heads) / total if total else 1.0


class CacheHealth:
    def __init__(self, arena: KVArena, config: CacheHealthConfig):
        self.arena = arena
        self.config = config
        self.last_run = 0.0
        self.health = measure(arena)
        self.compactions = 0
        self.defrag_moves = 0
        self.hit_rate = 1.0

    def configure(self, config) -> None:
        self.config = config.cache_health

    def observe_batch(self, seq_ids: list[int]) -> None:
        name = self.arena.main.layout.name
        self.hit_rate = hit_rate([self.arena.tables[s].blocks[name] for s in seq_ids
                                  if s in self.arena.tables])

    def maybe_run(self, now: float | None = None) -> Health:
        now = time.perf_counter() if now is None else now
        if (now - self.last_run) * 1000 >= self.config.interval_ms:
            self.last_run = now
            self.run()
        return self.health

    def run(self) -> Health:
        self.health = measure(self.arena)
        if self.health.kdr < self.config.kdr_min:
            self.compact()
        if self.health.vfi > self.config.vfi_max:
            self.defragment()
        return self.health

    def compact(self) -> int:
        freed = sum(self.arena.release_slack(s) for s in list(self.arena.tables))
        self.compactions += 1
        self.health = measure(self.arena)
        return freed

    def defragment(self) -> int:
        """Move the highest allocated block into the lowest free one below it, repeatedly,
        until no hole is above vfi_max or the time budget is spent."""
        deadline = time.perf_counter() + self.config.repair_budget_ms / 1000
        moves = 0
        group = self.arena.main
        pool = group.blocks
        while pool.free and time.perf_counter() < deadline:
            occupied = pool.occupied()
            if not occupied:
                break
            top, hole = occupied[-1], min(pool.free)
            if hole > top:
                break
            self.arena.move_block(group.layout.name, top, hole)
            moves += 1
            if moves % 8 == 0 and measure(self.arena).vfi <= self.config.vfi_max:
                break
        self.defrag_moves += moves
        self.health = measure(self.arena)
        return moves
