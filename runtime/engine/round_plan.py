"""What one engine step does, per sequence: an immutable plan the stages fill in turn.

    scheduler    which sequences run, each one's prompt chunk (uncached tokens fed) and the
                 room its reservation gives
    decide       the round's decision (engine/decide.py): the drafting method and windows,
                 which source actually proposed (plain, lookup, draft, lookup+draft) and
                 the pending drafts themselves, how many of them the verify forward checks
Each stage returns a new plan (`with_slots`); nothing per-round is kept on the Sequence.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from dspark.runtime.drafting.state import DraftState
from dspark.runtime.sequence.request import Sequence

UNBOUNDED = 1 << 30


@dataclass(frozen=True)
class Slot:
    seq: Sequence
    chunk: int  # uncached tokens fed to the main model this round
    room: int = UNBOUNDED  # positions the sequence may fill in any pool (its reservation)
    catch_up: int = UNBOUNDED  # tokens a draft model reads per forward while catching up
    method: str = "plain"  # hybrid, lookup, draft, or plain
    window: int = 0  # model drafts wanted in the pending buffer
    lookup: int = 0  # lookup drafts wanted
    source: str = "plain"  # what proposed this round's pending drafts
    verify: int = 0  # pending drafts the verify forward checks
    pending: DraftState = field(default_factory=DraftState)  # the drafting's buffer: read
    # by the verify and acceptance, changed only by the drafting's settle after them

    @property
    def finishes_prompt(self) -> bool:
        """Does this round's chunk reach the sequence's end (so drafts can follow it)?"""
        return self.seq.main_cached + self.chunk == len(self.seq.tokens)

    def but(self, **changes) -> Slot:
        """A copy with `changes` (dataclasses.replace without its per-field generality,
        which cost a few calls per sequence and step a measurable share of a decode)."""
        if not changes.keys() <= FIELDS:
            raise TypeError(f"Slot has no field {sorted(changes.keys() - FIELDS)}")
        new = object.__new__(Slot)
        new.__dict__.update(self.__dict__, **changes)
        return new


FIELDS = frozenset(f.name for f in dataclasses.fields(Slot))


@dataclass(frozen=True)
class RoundPlan:
    slots: tuple[Slot, ...] = ()
    speculated: bool = False  # the step could speculate (engine/decide.py)
    measured: bool = False  # a step VLB measures: a speculative request, no prompt fed

    def __bool__(self) -> bool:
        return bool(self.slots)

    def __iter__(self):
        return iter(self.slots)

    def __len__(self) -> int:
        return len(self.slots)

    def with_slots(self, slots) -> RoundPlan:
        return RoundPlan(tuple(slots), self.speculated, self.measured)

    @property
    def seqs(self) -> list[Sequence]:
        return [s.seq for s in self.slots]
