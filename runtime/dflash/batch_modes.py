"""Whether a step of several sequences speculates at all: decided by measured output, per
batch size.

One sequence's speculation is weighed by the hybrid's cost model (drafting/hybrid.py), from
forward costs measured alone. In a batch those costs mislead: every sequence's verify
tokens share one forward, and past a few sequences a CPU forward is compute-bound, so one
sequence's drafts lengthen every sequence's step. So steps of two or more sequences are
split by batch size into buckets (2, 3-4, 5-8, 9-16, ...), and each bucket keeps the output
tokens per second its speculating steps and its plain steps realized (over each mode's last
WINDOW measured steps: their tokens over their seconds) and their mean seconds. A step takes
the faster mode, tries each until its window is full, and tries the slower one again to
follow what changed (context lengths, acceptance, another process on a core) once the time
spent in the faster since its last trial is `explore_every` trials' worth of the slower's
steps, times how many of the faster's steps one of the slower's lasts. So trials take at
most 1 / explore_every of the time, and a trial that stalls the batch (a speculating step of
16 sequences, its draft catching up on all their tokens, can last 14 plain steps) comes that
much more rarely: the stall is what every request in the batch sees as one long
inter-token gap.

A trial is TRIAL_STEPS steps in a row, and the first step after the other mode is not
measured: it carries the switch's one-off work (the draft catching up on the tokens decoded
plain), which the mode's own steps do not. Measured as one step and blended into a running
mean, as before, a speculative trial at 3-4 sequences realized 4-10 tokens a step where
speculation's own steps realize ~17, and plain, once ahead, stayed ahead: the fp32 sample at
4 clients ran at plain's speed where speculating is 1.4x (docs/serving.md). Nor is a step
measured that follows an idle spell (`after_idle`): a machine's first step after one can
take several times its usual time. Nor is a step that could speculate but verified no drafts
(its sequences just admitted, or their own policies declining): it was a plain step, and
counted as speculation's it made speculation look no faster than plain from the first
steps on. Steps that feed a prompt are plain and not measured: a prompt chunk waits for
nothing but the decode tokens beside it (engine/decide.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

WINDOW = 4  # measured steps a mode's rate is taken over
SETTLE_STEPS = 1  # steps after a switch that carry its one-off work: not measured
TRIAL_STEPS = SETTLE_STEPS + WINDOW  # a trial refills the slower mode's whole window
MIN_STEPS = WINDOW  # measurements of each mode before the faster one is trusted


@dataclass
class Bucket:
    measured: dict[bool, deque] = field(default_factory=dict)  # mode -> (tokens, seconds)
    steps: dict[bool, int] = field(default_factory=dict)  # measured, since the start
    since_other: float = 0.0  # seconds in the faster mode since the slower was tried
    trial: tuple[bool, int] | None = None  # the mode on trial, steps of it still to run

    def rate(self, mode: bool) -> float:
        steps = self.measured[mode]
        return sum(t for t, _ in steps) / sum(s for _, s in steps)

    def seconds(self, mode: bool) -> float:
        steps = self.measured[mode]
        return sum(s for _, s in steps) / len(steps)


class BatchModes:
    def __init__(self, explore_every: int = 24):
        self.explore_every = explore_every
        self.buckets: dict[int, Bucket] = {}
        self.last: bool | None = None  # the mode of the last step of 2+ sequences
        self.run = 0  # steps in that mode in a row

    @staticmethod
    def bucket(sequences: int) -> int:
        return (sequences - 1).bit_length()  # 2 -> 1, 3-4 -> 2, 5-8 -> 3, ...

    def speculate(self, sequences: int) -> bool:
        """Should a step of `sequences` sequences speculate?"""
        if sequences < 2:
            return True  # one sequence: the hybrid's own cost model decides
        b = self.buckets.setdefault(self.bucket(sequences), Bucket())
        if b.trial is not None:
            mode, left = b.trial
            b.trial = (mode, left - 1) if left > 1 else None
            return mode
        for mode in (True, False):
            if b.steps.get(mode, 0) < MIN_STEPS:
                return mode
        best = b.rate(True) >= b.rate(False)
        slow, fast = b.seconds(not best), b.seconds(best)
        if b.since_other >= self.explore_every * TRIAL_STEPS * slow * max(1.0, slow / fast):
            b.since_other = 0.0
            b.trial = (not best, TRIAL_STEPS - 1)
            return not best
        return best

    def observe(self, sequences: int, speculated: bool, tokens: int, seconds: float,
                after_idle: bool = False) -> None:
        """A step's outcome: its sequences, its mode, the tokens it emitted, its time;
        `after_idle`: the engine sat idle before it."""
        if sequences < 2 or seconds <= 0:
            return
        self.run = self.run + 1 if speculated == self.last else 1
        self.last = speculated
        b = self.buckets.setdefault(self.bucket(sequences), Bucket())
        if self.run <= SETTLE_STEPS or after_idle:
            return
        b.measured.setdefault(speculated, deque(maxlen=WINDOW)).append((tokens, seconds))
        b.steps[speculated] = b.steps.get(speculated, 0) + 1
        if len(b.measured) == 2 and speculated == (b.rate(True) >= b.rate(False)):
            b.since_other += seconds

    def summary(self) -> dict[str, dict[str, float]]:
        """Per bucket (its largest batch), each mode's tokens per second."""
        return {str(1 << k): {("speculative" if m else "plain"): round(b.rate(m), 1)
                              for m in b.measured} for k, b in self.buckets.items()}
