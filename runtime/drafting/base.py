"""The drafting protocols: Drafting (what the planner and the engine call each round,
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
from typing import NamedTuple, Protocol

from dspark.runtime.dflash.policy import KeepRule
from dspark.runtime.drafting.state import DraftState
from dspark.runtime.sequence.request import Sequence


@dataclass
class DraftWork:
    """One sequence's drafting job this round."""

    seq: Sequence
    state: DraftState
    window: int  # drafts wanted in the pending buffer by the end of the round
    keep: KeepRule | None = None  # draft one more after j? (the sequence's policy)
    room: int = 1 << 30  # positions the sequence may fill in any pool (its reservation)
    catch_up: int = 1 << 30  # tokens a draft model reads per forward while catching up


class DraftJob(NamedTuple):
    """One sequence's drafting this round, as the planner set it."""

    seq: Sequence
    method: str  # hybrid, lookup or draft
    window: int  # model drafts wanted
    lookup: int  # lookup drafts wanted (the lookup cap)
    at_end: bool = True  # the round's chunk reaches the sequence's end: drafts may follow
    room: int = 1 << 30  # positions the sequence may fill (its reservation)
    catch_up: int = 1 << 30  # tokens a draft model reads per forward while catching up
    keep: KeepRule | None = None  # the policy's per-token rule for the draft model


class Proposed(NamedTuple):
    """What the drafting proposed for one job: the round's pending drafts and what the
    planner's balance reads of them."""

    source: str  # plain, lookup, draft or lookup+draft
    lookup: int  # the lookup cap, raised to take a grammar's forced tokens (0: rested)
    pending: DraftState  # the sequence's pending drafts (read until settle)
    survivals: tuple[float, ...] = ()  # calibrated, per pending draft, where a lookup proposed


class Drafting(Protocol):
    """The round's drafting as the engine and the planner call it (drafting/hybrid.py):
    `rests` once per round for each lookup slot (True: nothing to do, a plain round), then
    `propose` once per round (from the planner), `settle` with verification's outcome
    (from the engine); `release` when a sequence ends."""

    default_draft: str | None  # the draft model role sequences use (None: none)

    def rests(self, seq: Sequence) -> bool: ...

    def propose(self, jobs: list[DraftJob]) -> list[Proposed]: ...

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
