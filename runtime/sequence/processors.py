"""Logits processors: what a request does to the main model's logits before a token is
chosen, position by position, exactly as plain decoding would have done it.

    logits -> + logit_bias                      (token ids: bias, OpenAI's)
           -> repetition_penalty              (prompt and output tokens: a positive logit
                                               divided by it, a negative one multiplied)
           -> - presence - frequency x count  (output tokens, their count so far)
           -> the grammar's mask (runtime/grammar)
           -> temperature, top-k, top-p, min-p (sampling.py)
A verify window's row i is processed with the sequence as it would stand had drafts 0..i-1
been accepted: its output so far and those drafts (`rows`). Rows are computed on demand and
in order, so acceptance reads only those up to the first rejection; the draft model's
proposals and the lookup's are scored against these same rows, so greedy output with
speculation is plain decoding's token for token and sampled output keeps its distribution.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from dspark.runtime.errors import RequestError


@dataclass(frozen=True)
class Penalties:
    """A request's logits processors (all off by default)."""

    presence: float = 0.0  # OpenAI's presence_penalty, [-2, 2]
    frequency: float = 0.0  # frequency_penalty, [-2, 2]
    repetition: float = 1.0  # vLLM's repetition_penalty, > 0 (1: off)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100])

    def __post_init__(self) -> None:
        for name, value in (("presence_penalty", self.presence),
                            ("frequency_penalty", self.frequency)):
            if not -2 <= value <= 2:
                raise RequestError(f"{name} must lie in [-2, 2], got {value}", name)
        if not 0 < self.repetition <= 10:
            raise RequestError(f"repetition_penalty must lie in (0, 10], got "
                               f"{self.repetition}", "repetition_penalty")
        for token, bias in self.logit_bias:
            if not -100 <= bias <= 100:
                raise RequestError(f"logit_bias[{token}] must lie in [-100, 100], got {bias}",
                                   "logit_bias")

    @property
    def active(self) -> bool:
        return bool(self.presence or self.frequency or self.repetition != 1.0
                    or self.logit_bias)


class Processors:
    """One sequence's processors and what they read: its prompt's tokens, and its output's
    tokens with their counts (kept up to date by `emit`)."""

    def __init__(self, penalties: Penalties, prompt: tuple[int, ...]):
        self.penalties = penalties
        self.counts: Counter[int] = Counter()  # output tokens
        self.prompt_ids = np.unique(np.asarray(prompt, np.int64))
        self.bias_ids = np.array([t for t, _ in penalties.logit_bias], np.int64)
        self.bias = np.array([b for _, b in penalties.logit_bias], np.float32)

    def emit(self, tokens: list[int]) -> None:
        self.counts.update(tokens)

    def row(self, logits: np.ndarray, drafts: list[int]) -> np.ndarray:
        """`logits` (one row) processed for the position after the output and `drafts`."""
        p = self.penalties
        x = np.array(logits, dtype=np.float32)
        if len(self.bias_ids):
            x[self.bias_ids] += self.bias
        counts = self.counts + Counter(drafts) if drafts else self.counts
        if p.repetition != 1.0:
            seen = np.union1d(self.prompt_ids, np.fromiter(counts, np.int64, len(counts)))
            values = x[seen]
            x[seen] = np.where(values > 0, values / p.repetition, values * p.repetition)
        if (p.presence or p.frequency) and counts:
            ids = np.fromiter(counts.keys(), np.int64, len(counts))
            n = np.fromiter(counts.values(), np.float32, len(counts))
            x[ids] -= p.presence + p.frequency * n
        return x

    def rows(self, logits, drafts: list[int]) -> ProcessedRows:
        return ProcessedRows(self, logits, drafts)


class ProcessedRows:
    """rows[i]: logits row i processed after drafts[:i], computed on first use and kept."""

    def __init__(self, processors: Processors, logits, drafts: list[int]):
        self.p, self.logits, self.drafts = processors, logits, drafts
        self.rows: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.logits)

    def __getitem__(self, i: int) -> np.ndarray:
        if i not in self.rows:
            self.rows[i] = self.p.row(self.logits[i], self.drafts[:i])
        return self.rows[i]
