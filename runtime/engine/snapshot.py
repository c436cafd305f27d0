"""What the engine thread publishes for other threads to read: an immutable snapshot taken
between steps. The server's event loop reads only this (and sends everything else through
the engine service's command queue), so it never sees a half-updated engine."""

from __future__ import annotations

from dataclasses import dataclass

from dspark.runtime.sequence.validate import Limits


@dataclass(frozen=True)
class EngineSnapshot:
    limits: Limits
    waiting: int  # submitted, not yet admitted
    running: int
    resize_grace_s: float

    @classmethod
    def of(cls, engine) -> EngineSnapshot:
        return cls(engine.limits, engine.scheduler.pending, len(engine.scheduler.running),
                   engine.config.cache_resize_grace_period_sec)
