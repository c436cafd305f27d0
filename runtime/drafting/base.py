"""The Drafter protocol and its registry.

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

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from dspark.runtime.drafting.state import DraftState
from dspark.runtime.sequence.request import Sequence


@dataclass
class DraftWork:
    """One sequence's drafting job this round."""

    seq: Sequence
    state: DraftState
    window: int  # drafts wanted in the pending buffer by the end of the round
    keep: Callable[[Sequence, int], bool] | None = None  # draft one more after j? (policy)


class Drafter(Protocol):
    name: str

    def propose(self, work: list[DraftWork]) -> None: ...

    def trim(self, seq: Sequence, valid: int) -> None: ...

    def release(self, seq: Sequence) -> None: ...
