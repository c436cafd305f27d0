"""Measured forward costs, the scheduler's model of the executor's speed.

A forward of T tokens from S sequences, sequence i reading C_i cached positions with its
T_i new tokens, costs about

    t(T) + (S - 1) s + sum_i C_i (r + p T_i)

t(T) the model's work at no context (an EWMA per T up to EXACT, the windows a round
verifies, and per power-of-two bucket beyond, scaled within it; interpolated between
measured keys), s the per-sequence overhead (the CPU attention is one call per sequence
per layer), r the cost of reading one cached position (its keys and values, once per
sequence) and p of one new token attending to it. Every ModelRunner forward updates t and
s with what its context explains taken out; the warm-up profile measures r and p (a one-
and an eight-token forward at no context and at a long one) and fills the table first.

The context term is what keeps the table's sizes comparable. SmolLM2 int4 on 2 cores,
1 / 2 / 4 / 8 tokens: 3.9 / 4.5 / 4.6 / 5.4 ms at 8 cached positions, 6.3 / 7.5 / 9.5 /
14.3 ms at 900. Without it the one-token row, updated by every plain step at the current
context, drifted above the multi-token rows the warm-up left at none: past ~600 positions
a 4-token verify was priced below a decode, until lookup rounds had corrected its row.

Draft forwards have two rows: "draft" for a round's first (it follows a main forward, whose
weights pushed the draft's state out of the caches, and reads any catch-up tokens) and
DRAFT_STEP for the ones after it. The draft model drafter records them itself, each with the
drawing of its token from the logits (~0.3 ms on SmolLM2's 49k vocabulary): the cost of a
draft, not of a forward alone. Likewise a main forward right after draft forwards (their
weights evicted part of the main's from the caches: SmolLM2, 1-3 tokens, +0.6 ms) records
into AFTER_DRAFT, which prices the verify of a model round; plain and lookup rounds' verifies
and prompts stay in "main". On SmolLM2's int4 draft a one-token first forward took
7.0 ms and a following one 5.8: one row for both overcharged every draft past the first.
"""

from __future__ import annotations

import math

SMOOTHING = 0.2
DRAFT_STEP = "draft_step"
AFTER_DRAFT = "main_after_draft"
# Token counts kept as their own rows. A forward's cost is far from proportional to its
# tokens (SmolLM2 on 2 cores: 1 token 19.5 ms, 3 tokens 21.5): scaled into a power-of-two
# bucket a 3-token verify was recorded as 2/3 of itself, so a 3-token verify looked cheaper
# than a 1-token decode (15 ms) and the window choice leaned on that.
EXACT = 16


class CostModel:
    def __init__(self):
        self.table: dict[str, dict[int, float]] = {}
        self.per_seq: dict[str, float] = {}
        self.context: dict[str, tuple[float, float]] = {}  # (r, p) by model: "main", "draft"
        self.reset()

    def reset(self) -> None:
        """Forget the forward-size table (a new profile follows)."""
        self.table = {"main": {}, "draft": {}, DRAFT_STEP: {}, AFTER_DRAFT: {}}

    def draft_step(self, tokens: int = 1, seqs: int = 1, context: int = 0) -> float | None:
        """A draft forward after the round's first: its own row once measured, else the
        first forward's."""
        return self.seconds(DRAFT_STEP if self.table.get(DRAFT_STEP) else "draft", tokens, seqs,
                            context)

    def after_draft(self, tokens: int, seqs: int = 1, context: int = 0) -> float | None:
        """A main forward after draft forwards: its own row once it holds this size (or
        one above it), else the main's."""
        own = self.table.get(AFTER_DRAFT) or {}
        if own and max(own) >= tokens:
            return self.seconds(AFTER_DRAFT, tokens, seqs, context)
        return self.seconds("main", tokens, seqs, context)

    def context_seconds(self, role: str, context: int, pairs: int) -> float:
        """What the cached positions cost a forward: `context` positions read (summed over
        its sequences) and `pairs` (position, new token) products, sum_i C_i T_i."""
        r, p = self.context.get("main" if role in ("main", AFTER_DRAFT) else "draft",
                                (0.0, 0.0))
        return context * r + pairs * p

    def record(self, role: str, tokens: int, seconds: float, seqs: int = 1, context: int = 0,
               pairs: int | None = None) -> None:
        """A measured forward; `context`/`pairs` as context_seconds (pairs default: one
        sequence's, context * tokens)."""
        if tokens < 1 or seconds <= 0:
            return
        own = seconds - self.context_seconds(role, context, context * tokens
                                             if pairs is None else pairs)
        seconds = max(own, 0.1 * seconds)
        base = self.seconds(role, tokens)
        if seqs > 1 and base is not None:
            residual = max(0.0, (seconds - base) / (seqs - 1))
            old = self.per_seq.get(role)
            self.per_seq[role] = residual if old is None else old + SMOOTHING * (residual - old)
            return
        bucket = tokens if tokens <= EXACT else 1 << math.floor(math.log2(tokens))
        per = seconds * bucket / tokens  # cost scaled to the bucket's token count
        table = self.table.setdefault(role, {})
        old = table.get(bucket)
        table[bucket] = per if old is None else old + SMOOTHING * (per - old)

    def seconds(self, role: str, tokens: int, seqs: int = 1, context: int = 0) -> float | None:
        """Estimated forward time (None before any measurement); `context`: the cached
        positions one sequence's tokens follow (a batch: its sequences' total, each
        taken with tokens / seqs new ones)."""
        t = self._work(role, tokens, seqs)
        if t is None or not context:
            return t
        return t + self.context_seconds(role, context, context * tokens // max(1, seqs))

    def _work(self, role: str, tokens: int, seqs: int) -> float | None:
        table = self.table.get(role) or {}
        if not table:
            return None
        keys = sorted(table)
        if tokens <= keys[0]:
            t = table[keys[0]]
        elif tokens >= keys[-1]:
            t = table[keys[-1]] * tokens / keys[-1]
        else:
            hi = next(k for k in keys if k >= tokens)
            lo = max(k for k in keys if k <= tokens)
            t = table[lo] if hi == lo else table[lo] + (tokens - lo) / (hi - lo) * (
                table[hi] - table[lo])
        return t + (seqs - 1) * self.per_seq.get(role, 0.0)
