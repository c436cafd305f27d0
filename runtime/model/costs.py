"""Measured forward costs, the scheduler's model of the executor's speed.

A forward of T tokens from S sequences costs about t(T) + (S - 1) * s: t(T) the model's
work (an EWMA per T up to EXACT, the windows a round verifies, and per power-of-two bucket
beyond, scaled within it; interpolated between measured keys), s the per-sequence
overhead (the CPU attention is one call per sequence per layer). Every ModelRunner forward
updates both; a warm-up profile fills the table first.

Draft forwards have two rows: "draft" for a round's first (it follows a main forward, whose
weights pushed the draft's state out of the caches, and reads any catch-up tokens) and
DRAFT_STEP for the ones after it (a first forward costs more than the next: one row for both
overcharged every draft past the first). The draft model drafter records them itself, each
with the drawing of its token from the logits: the cost of a draft, not of a forward alone.
Likewise a main forward right after draft forwards (their weights evicted part of the main's
from the caches) records into AFTER_DRAFT, which prices the verify of a model round; plain
and lookup rounds' verifies and prompts stay in "main".

Forwards that leave the pool while other processes hold the cores (load_gate.py) cost
otherwise, and a verify is dearer against a decode there. Each mode keeps its own table
(`mode`: whether forwards now run solo). A mode first met starts from a copy of the other's,
and each of its sizes takes its first own measurement whole: with one table the sizes a
round seldom verifies kept the idle machine's prices for minutes under load, and the windows
leaned on them.
"""

from __future__ import annotations

import math

SMOOTHING = 0.2
DRAFT_STEP = "draft_step"
AFTER_DRAFT = "main_after_draft"
# Token counts kept as their own rows. A forward's cost is far from proportional to its
# tokens: scaled into a power-of-two bucket a 3-token verify was recorded as 2/3 of itself
# and looked cheaper than a 1-token decode, and the window choice leaned on that.
EXACT = 16


def _empty() -> dict[str, dict[int, float]]:
    return {"main": {}, "draft": {}, DRAFT_STEP: {}, AFTER_DRAFT: {}}


class CostModel:
    def __init__(self, mode=lambda: False):
        """`mode()`: whether forwards run solo now (load_gate.py; default: never)."""
        self.mode = mode
        self.tables: dict[bool, dict[str, dict[int, float]]] = {}
        self.measured: dict[bool, set[tuple[str, int]]] = {}
        self.per_seq: dict[str, float] = {}
        self._then: tuple[int, object] | None = None  # (records left, call) of after()
        self.reset()

    def after(self, records: int, call) -> None:
        """Call `call(self)` once, when `records` more forwards have been recorded (a table
        read back stale is written back once traffic has measured it again)."""
        self._then = (records, call)

    def reset(self) -> None:
        """Forget the forward-size tables (a new profile follows)."""
        self.tables = {self.mode(): _empty()}
        self.measured = {solo: set() for solo in (False, True)}

    def snapshot(self) -> dict:
        """The tables and per-sequence costs as JSON data (model/cost_cache.py)."""
        return {"tables": {str(solo): {role: {str(n): t for n, t in rows.items()}
                                       for role, rows in table.items()}
                           for solo, table in self.tables.items()},
                "per_seq": dict(self.per_seq)}

    def restore(self, data: dict) -> None:
        """Take a snapshot's tables; each size counts as measured (the next forward of it
        is averaged in, not taken whole)."""
        tables = {solo == "True": {role: {int(n): float(t) for n, t in rows.items()}
                                   for role, rows in table.items()}
                  for solo, table in data["tables"].items()}
        per_seq = {role: float(t) for role, t in data["per_seq"].items()}
        self.tables, self.per_seq = tables, per_seq
        self.measured = {solo: {(role, n) for role, rows in tables.get(solo, {}).items()
                                for n in rows} for solo in (False, True)}

    @property
    def table(self) -> dict[str, dict[int, float]]:
        """The current mode's table (first met: a copy of the other's)."""
        solo = self.mode()
        if solo not in self.tables:
            other = self.tables.get(not solo) or _empty()
            self.tables[solo] = {role: dict(rows) for role, rows in other.items()}
        return self.tables[solo]

    def draft_step(self, tokens: int = 1, seqs: int = 1) -> float | None:
        """A draft forward after the round's first: its own row once measured, else the
        first forward's."""
        return self.seconds(DRAFT_STEP if self.table.get(DRAFT_STEP) else "draft", tokens, seqs)

    def after_draft(self, tokens: int, seqs: int = 1) -> float | None:
        """A main forward after draft forwards: its own row once it holds this size (or
        one above it), else the main's."""
        own = self.table.get(AFTER_DRAFT) or {}
        if own and max(own) >= tokens:
            return self.seconds(AFTER_DRAFT, tokens, seqs)
        return self.seconds("main", tokens, seqs)

    def record(self, role: str, tokens: int, seconds: float, seqs: int = 1) -> None:
        if tokens < 1 or seconds <= 0:
            return
        if self._then is not None:
            left, call = self._then
            self._then = (left - 1, call) if left > 1 else None
            if left <= 1:
                call(self)
        base = self.seconds(role, tokens) if seqs > 1 else None
        if base is not None:
            residual = max(0.0, (seconds - base) / (seqs - 1))
            old = self.per_seq.get(role)
            self.per_seq[role] = residual if old is None else old + SMOOTHING * (residual - old)
            return
        bucket = tokens if tokens <= EXACT else 1 << math.floor(math.log2(tokens))
        per = seconds * bucket / tokens  # cost scaled to the bucket's token count
        table = self.table.setdefault(role, {})
        old = table.get(bucket)
        measured = self.measured[self.mode()]
        if (role, bucket) not in measured:  # a copied price, or none: this one replaces it
            measured.add((role, bucket))
            old = None
        table[bucket] = per if old is None else old + SMOOTHING * (per - old)

    def seconds(self, role: str, tokens: int, seqs: int = 1) -> float | None:
        """Estimated forward time (None before any measurement)."""
        table = self.table.get(role) or {}
        if not table:
            return None
        t = table.get(tokens)  # a measured size is itself (the hybrid asks ~5 times a round)
        if t is None:
            keys = sorted(table)
            if tokens < keys[0]:
                t = table[keys[0]]
            elif tokens > keys[-1]:
                t = table[keys[-1]] * tokens / keys[-1]
            else:
                hi = next(k for k in keys if k > tokens)
                lo = max(k for k in keys if k < tokens)
                t = table[lo] + (tokens - lo) / (hi - lo) * (table[hi] - table[lo])
        return t + (seqs - 1) * self.per_seq.get(role, 0.0)
