"""The drafting protocols: Drafting (what the round's decision and the engine call each round,
drafting/hybrid.py) and Drafter (one source of drafts: the lookup, a draft model).

A drafter proposes draft tokens for the sequences of a round, appending them to each
sequence's `DraftState` (main ids), and owns whatever per-sequence state it needs (a draft
model's cache position, a lookup index). Per round:

    propose(work)             extend each (seq, state, window) up to `window` drafts
    trim(seq, valid)          after verification: `tokens + pending` is unchanged through
                              position `valid`; forget anything beyond it
    release(seq)              the sequence finished: free its state

Which drafter runs and how many tokens it may draft is the caller's decision (the window
policy and the hybrid's cost model); a drafter may stop early (no match, an unmapped
token, its own confidence rule).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from dspark.runtime.dflash.policy import KeepRule
from dspark.runtime.dflash.source import SourceChooser
from dspark.runtime.drafting.state import DraftState
from dspark.runtime.sequence.request import Sequence


@dataclass
class DraftWork:
    """One sequence's drafting job this round, as the round's decision set it (the one job
    type between the decision and the drafters)."""

    seq: Sequence
    state: DraftState
    window: int  # drafts wanted in the pending buffer by the end of the round
    keep: KeepRule | None = None  # draft one more after j? (the sequence's policy)
    room: int = 1 << 30  # positions the sequence may fill in any pool (its reservation)
    catch_up: int = 1 << 30  # tokens a draft model reads per forward while catching up


class Drafting(Protocol):
    """The round's drafting as the engine and the round's decision call it
    (drafting/hybrid.py): `rests` once per round for each lookup slot (True: nothing to do,
    a plain round), then the decision's calls (engine/decide.py), `settle` with
    verification's outcome (from the engine); `release` when a sequence ends."""

    default_draft: str | None  # the draft model role sequences use (None: none)
    chooser: SourceChooser  # the hybrid's scores (dflash/source.py), which settle teaches
    has_model: bool  # is there a draft model at all

    def rests(self, seq: Sequence) -> bool: ...

    def state(self, seq: Sequence) -> DraftState: ...

    def survivals(self, seq: Sequence, count: int | None = None) -> list[float]: ...

    def force(self, seq: Sequence, limit: int) -> int: ...

    def look_up(self, caps: list[tuple[Sequence, int]]) -> set[int]: ...

    def cut(self, seq: Sequence, keep: int, looked_up: bool) -> None: ...

    def drop(self, seq: Sequence) -> None: ...

    def model_lag(self, seq: Sequence) -> tuple[int, bool] | None: ...

    def from_store(self, seq: Sequence) -> bool: ...

    def draft(self, work: list[DraftWork]) -> None: ...

    def constrain(self, seq: Sequence) -> None: ...

    def settle(self, seq: Sequence, old_len: int, verified: int, accepted: int,
               main_token: int, seconds: float) -> None: ...

    def release(self, seq: Sequence) -> None: ...

    def configure(self, config) -> None: ...

    def use_draft(self, role: str) -> None: ...


class Drafter(Protocol):
    name: str

    def propose(self, work: list[DraftWork]) -> None: ...

    def trim(self, seq: Sequence, valid: int) -> None: ...

    def release(self, seq: Sequence) -> None: ...
