"""What the engine publishes, immutable: the report of each step (StepReport, what `step()`
returns) and its gauges between steps (EngineGauges, `Engine.gauges()`). The server's event
loop and the metrics read only these (everything else goes through the engine service's
command queue), so they never see a half-updated engine."""

from __future__ import annotations

from dataclasses import dataclass

from dspark.runtime.sequence.request import Sequence
from dspark.runtime.sequence.validate import Limits


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
