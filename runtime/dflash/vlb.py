"""VLB, the verification load balancer.

Every request's first draft token is always verified (fast lane); further draft tokens
(steady lane) are admitted by the executor's utilisation u: below `low_utilisation` up to
`steady_tokens_low` per round, up to `high_utilisation` `steady_tokens_mid`, above it none.
Tokens not admitted are held: they stay valid for the next round and are dropped if an
earlier token is rejected (see Engine.accept).

On a CPU the engine thread is busy whenever any request runs, so a plain busy fraction
would read ~1 at any load. u is instead the verify throughput in use: an EWMA over ~1 s of
verified tokens per second over the peak the cost model measured. It is low for a single
request (few tokens per forward, weight streaming dominates) and high under many
concurrent requests (the forward is compute-bound and each extra token costs real time).
"""

from __future__ import annotations

import math
import time

from dspark.runtime.config import VerifyBalanceConfig
from dspark.runtime.dflash.costs import CostModel

WINDOW_S = 1.0


class VerifyBalancer:
    def __init__(self, config: VerifyBalanceConfig, costs: CostModel):
        self.config = config
        self.costs = costs
        self.utilisation = 0.0
        self.last = time.perf_counter()

    def peak(self) -> float | None:
        table = self.costs.table.get("main") or {}
        rates = [tokens / seconds for tokens, seconds in table.items() if seconds > 0]
        return max(rates) if rates else None

    def observe(self, tokens: int, seconds: float) -> None:
        """After a verify forward of `tokens` tokens that took `seconds`."""
        now = time.perf_counter()
        idle = max(0.0, now - self.last - seconds)
        self.utilisation *= math.exp(-idle / WINDOW_S)
        peak = self.peak()
        if peak and seconds > 0:
            x = min(1.0, tokens / seconds / peak)
            self.utilisation += (1 - math.exp(-seconds / WINDOW_S)) * (x - self.utilisation)
        self.last = now

    def steady_tokens(self) -> int:
        cfg, u = self.config, self.utilisation
        if u < cfg.low_utilisation:
            return cfg.steady_tokens_low
        if u <= cfg.high_utilisation:
            return cfg.steady_tokens_mid
        return 0

    def admit(self, drafted: int) -> int:
        """How many of `drafted` tokens go into this round's verify."""
        return min(drafted, 1 + self.steady_tokens()) if drafted else 0
