"""Whether a step of several sequences speculates at all: decided by measured output, per
batch size.

One sequence's speculation is weighed by the hybrid's cost model (drafting/hybrid.py), from
forward costs measured alone. In a batch those costs mislead: every sequence's verify
tokens share one forward, and past a few sequences a CPU forward is compute-bound, so one
sequence's drafts lengthen every sequence's step. So steps of two or more sequences are
split by batch size into buckets (2, 3-4, 5-8, 9-16, ...), and each bucket keeps the output
tokens per second its speculating steps and its plain steps realized (an EWMA of each
step's tokens over its seconds) and their mean seconds. A step takes the faster mode,
tries each until it has MIN_STEPS measurements, and tries the slower one again to follow
what changed (context lengths, acceptance, another process on a core) once the time spent
in the faster since its last trial is `explore_every` of the slower's steps, times how many
of the faster's steps one of the slower's lasts. So trials take at most 1 / explore_every of
the time, and a trial that stalls the batch (a speculating step of 16 sequences, its draft
catching up on all their tokens, can last 14 plain steps) comes that much more rarely: the
stall is what every request in the batch sees as one long inter-token gap. Steps that feed
a prompt are plain and not measured: a prompt chunk waits for nothing but the decode
tokens beside it (engine/decide.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

SMOOTHING = 0.1
MIN_STEPS = 4  # measurements of each mode before the faster one is trusted


@dataclass
class Bucket:
    rate: dict[bool, float] = field(default_factory=dict)  # speculating? -> tokens / s
    seconds: dict[bool, float] = field(default_factory=dict)  # a step's, EWMA
    steps: dict[bool, int] = field(default_factory=dict)
    since_other: float = 0.0  # seconds in the faster mode since the slower was tried


class BatchModes:
    def __init__(self, explore_every: int = 24):
        self.explore_every = explore_every
        self.buckets: dict[int, Bucket] = {}

    @staticmethod
    def bucket(sequences: int) -> int:
        return (sequences - 1).bit_length()  # 2 -> 1, 3-4 -> 2, 5-8 -> 3, ...

    def speculate(self, sequences: int) -> bool:
        """Should a step of `sequences` sequences speculate?"""
        if sequences < 2:
            return True  # one sequence: the hybrid's own cost model decides
        b = self.buckets.setdefault(self.bucket(sequences), Bucket())
        for mode in (True, False):
            if b.steps.get(mode, 0) < MIN_STEPS:
                return mode
        best = b.rate[True] >= b.rate[False]
        slow, fast = b.seconds[not best], b.seconds[best]
        if b.since_other >= self.explore_every * slow * max(1.0, slow / fast):
            b.since_other = 0.0
            return not best
        return best

    def observe(self, sequences: int, speculated: bool, tokens: int, seconds: float) -> None:
        """A step's outcome: its sequences, its mode, the tokens it emitted, its time."""
        if sequences < 2 or seconds <= 0:
            return
        b = self.buckets.setdefault(self.bucket(sequences), Bucket())
        for table, value in ((b.rate, tokens / seconds), (b.seconds, seconds)):
            old = table.get(speculated)
            table[speculated] = value if old is None else old + SMOOTHING * (value - old)
        b.steps[speculated] = b.steps.get(speculated, 0) + 1
        if len(b.rate) == 2 and speculated == (b.rate[True] >= b.rate[False]):
            b.since_other += seconds

    def summary(self) -> dict[str, dict[str, float]]:
        """Per bucket (its largest batch), each mode's tokens per second."""
        return {str(1 << k): {("speculative" if m else "plain"): round(r, 1)
                              for m, r in b.rate.items()} for k, b in self.buckets.items()}
