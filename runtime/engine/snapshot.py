"""What the engine publishes, immutable: the report of each step (StepReport, what `step()`
returns) and its gauges between steps (EngineGauges, `Engine.gauges()`). The server's event
loop and the metrics read only these (everything else goes through the engine service's
command queue), so they never see a half-updated engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dspark.runtime.sequence.request import Sequence
from dspark.runtime.sequence.validate import Limits

if TYPE_CHECKING:
    from dspark.runtime.engine.engine import Engine


@dataclass(frozen=True)
class RoundRecord:
    """One speculative sequence's round within a step."""

    tenant: str
    window: int  # pending drafts offered to the verify
    drafted: int  # drafts verified
    accepted: int
    sources: tuple[str, ...]  # each verified draft's source, in window order
    method: str  # what proposed: plain, lookup, draft or lookup+draft


@dataclass(frozen=True)
class StepReport:
    advanced: tuple[Sequence, ...] = ()  # the sequences the step advanced (finished ones too)
    rounds: tuple[RoundRecord, ...] = ()
    verify_ms: float | None = None  # the verify forward's time (None: no forward ran)


@dataclass(frozen=True)
class EngineGauges:
    limits: Limits
    waiting: int  # submitted, not yet admitted
    running: int
    resize_grace_s: float
    kv_usage: float  # share of the arena's blocks in use
    hit_rate: float  # cache health (dflash/che.py)
    kdr: float
    vfi: float
    clca: float
    compactions: int
    defrag_moves: int
    degraded: bool  # resources (dflash/ras.py)
    switches: int
    utilisation: float  # verify balancer (dflash/vlb.py)
    reloads: tuple[tuple[str, int], ...] | None  # config reloads by result; None: not watched
    prefix_queried: int = 0  # prompt tokens looked up in the prefix cache, since start
    prefix_hit: int = 0  # of them, found cached
    cached_blocks: int = 0  # registered blocks of the main model (held or not)
    evictions: int = 0  # cached blocks evicted, since start
    copies: int = 0  # shared blocks copied before a write (copy on write), since start
    remaining: tuple[int, ...] = ()  # tokens each running sequence may still generate, fewest first

    @classmethod
    def of(cls, engine: Engine, reloads: tuple[tuple[str, int], ...] | None) -> EngineGauges:
        """An engine's gauges now (between its steps); `reloads`: its config watcher's."""
        health, h, prefix = engine.health, engine.health.health, engine.kv.prefix
        return cls(
            engine.limits, engine.scheduler.pending, len(engine.scheduler.running),
            engine.config.cache_resize_grace_period_sec, engine.arena.usage(),
            health.hit_rate, h.kdr, h.vfi, h.clca, health.compactions, health.defrag_moves,
            engine.resources.degraded, engine.resources.switches,
            engine.balancer.utilisation, reloads, prefix.queried, prefix.hit,
            prefix.cached_blocks(),
            sum(g.blocks.evictions for g in engine.arena.groups.values()), engine.arena.copies,
            tuple(sorted(s.request.max_tokens - len(s.generated)
                         for s in engine.scheduler.running)))
