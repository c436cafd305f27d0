"""Measured forward costs, the goodput policy's model of the executor's speed.

Each ModelRunner reports (tokens, seconds) per forward; costs are kept per power-of-two
bucket of tokens as an EWMA and interpolated. A warm-up profile fills the table.
"""

from __future__ import annotations

import math


class CostModel:
    SMOOTHING = 0.2

    def __init__(self):
        self.table: dict[str, dict[int, float]] = {"main": {}, "draft": {}}

    def record(self, role: str, tokens: int, seconds: float) -> None:
        if tokens < 1 or seconds <= 0:
            return
        bucket = 1 << max(0, math.floor(math.log2(tokens)))
        per = seconds * bucket / tokens  # cost scaled to the bucket's token count
        table = self.table.setdefault(role, {})
        old = table.get(bucket)
        table[bucket] = per if old is None else old + self.SMOOTHING * (per - old)

    def seconds(self, role: str, tokens: int) -> float | None:
        """Estimated forward time for `tokens` tokens (None before any measurement)."""
        table = self.table.get(role) or {}
        if not table:
            return None
        keys = sorted(table)
        if tokens <= keys[0]:
            return table[keys[0]]
        if tokens >= keys[-1]:
            return table[keys[-1]] * tokens / keys[-1]
        hi = next(k for k in keys if k >= tokens)
        lo = max(k for k in keys if k <= tokens)
        if hi == lo:
            return table[lo]
        f = (tokens - lo) / (hi - lo)
        return table[lo] + f * (table[hi] - table[lo])

    def steps_per_second(self, tokens: int) -> float | None:
        t = self.seconds("main", tokens)
        return 1.0 / t if t else None
