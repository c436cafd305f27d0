"""The window-policy interface (the registry that builds them: dflash/policies.py).

A policy sees a `RoundView` (lengths and the sequence's SeqStats) and the cost model; it
never touches the executor. Per round it is told one thing, answers three questions and
learns from the result:
    begin_round(drafting)       told: how many sequences draft together this round
    window(view)                how many tokens may be drafted (0: plain decoding)
    keep_drafting(view, j)      after drafting j tokens, draft one more?
    survival(view, j)           chance the j-th draft is kept; None: the policy has no model
                                of it (VLB alone then decides how many are verified)
    observe(view)               learns: the round is verified; update state from the
                                statistics
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

from dspark.runtime.errors import DSparkError
from dspark.runtime.sequence.stats import SeqStats


@dataclass(frozen=True)
class RoundView:
    seq_id: int
    tenant: str
    prompt_len: int
    generated: int
    stats: SeqStats
    cap: int  # the tightest of config, tenant, request and resource caps
    # the draft's top-1 probability at each draft in question: the pending ones while a
    # round is planned and drafted, the last verified window's after it (stats.draft_top1)
    confidence: tuple[float, ...] = ()

    @property
    def plnp(self) -> float:
        """Prompt-length-normalised position: generated / prompt tokens."""
        return self.generated / max(1, self.prompt_len)


class WindowPolicy(Protocol):
    name: str

    def begin_round(self, drafting: int) -> None: ...

    def survival(self, view: RoundView, drafted: int) -> float | None: ...

    def window(self, view: RoundView) -> int: ...

    def keep_drafting(self, view: RoundView, drafted: int) -> bool: ...

    def observe(self, view: RoundView) -> None:
        """After a round that verified drafts (view.stats.last_window > 0)."""

    def forget(self, seq_id: int) -> None: ...


@dataclass(frozen=True)
class KeepRule:
    """A sequence's per-token drafting rule for this round: its policy and its view, handed
    to the draft model with the job, so the drafter asks the policy directly (no callback
    into the round's decision)."""

    policy: WindowPolicy
    view: RoundView

    def keep(self, confidence: list[float], drafted: int) -> bool:
        """After `drafted` drafts with these pending confidences, draft one more?"""
        return self.policy.keep_drafting(replace(self.view, confidence=tuple(confidence)),
                                         drafted)


class FixedWindow:
    """The same window every round."""

    name = "fixed"

    def __init__(self, window: int = 4, **_):
        if window < 1:
            raise DSparkError(f"window must be >= 1, got {window}")
        self.size = window

    def begin_round(self, drafting: int) -> None:
        pass

    def survival(self, view: RoundView, drafted: int) -> float | None:
        return None

    def window(self, view: RoundView) -> int:
        return self.size

    def keep_drafting(self, view: RoundView, drafted: int) -> bool:
        return True

    def observe(self, view: RoundView) -> None:
        pass

    def forget(self, seq_id: int) -> None:
        pass
