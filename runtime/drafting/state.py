"""One sequence's pending drafts: proposed, not yet verified (held ones carry over rounds).

Every drafter appends to the same buffer, so a round's proposal may be a lookup prefix
extended by the draft model. Each token keeps what verification needs: its proposal
distribution q (None for a deterministic proposal such as a lookup: q is then one-hot,
and rejection sampling accepts it with probability p(x)), the drafter's confidence, and
which drafter proposed it (statistics per source).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

FORCED = "grammar"  # the source name of a grammar's forced drafts


@dataclass
class DraftState:
    tokens: list[int] = field(default_factory=list)  # main ids
    q: list[np.ndarray | None] = field(default_factory=list)
    confidence: list[float] = field(default_factory=list)  # chance the main agrees, estimated
    entropy: list[float] = field(default_factory=list)  # of the draft's top-3 (model only)
    sources: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, token: int, source: str, q: np.ndarray | None = None,
            confidence: float = 1.0, entropy: float = 0.0) -> None:
        self.tokens.append(token)
        self.q.append(q)
        self.confidence.append(confidence)
        self.entropy.append(entropy)
        self.sources.append(source)

    def drop(self, n: int) -> None:
        """Forget the first n pending drafts (verified, or invalidated by a rejection)."""
        for buf in (self.tokens, self.q, self.confidence, self.entropy, self.sources):
            del buf[:n]

    def truncate(self, keep: int) -> None:
        """Forget every pending draft after the first `keep`."""
        for buf in (self.tokens, self.q, self.confidence, self.entropy, self.sources):
            del buf[keep:]

    def clear(self) -> None:
        self.drop(len(self.tokens))

    @property
    def forced(self) -> int:
        """How many pending drafts, from the first, a grammar forced (sure, free)."""
        return next((i for i, s in enumerate(self.sources) if s != FORCED), len(self.sources))

    @property
    def used(self) -> str:
        """What proposed the pending drafts: plain (none), or their sources joined by +."""
        used = sorted(set(self.sources))
        return "+".join(used) if used else "plain"


def settle(state: DraftState, verified: int, accepted: int, main_token: int) -> int:
    """After verification of the first `verified` pending drafts: drop what was used or
    invalidated, keep held drafts that are still right, and return how many pending drafts
    the stream `tokens + pending` kept unchanged.

    The new stream is the old tokens, the `accepted` drafts, the main model's token, then
    what stays pending. When every verified draft was accepted and the main model's token
    equals the first held draft, the held drafts after it continue exactly the stream the
    drafters already saw: all pending positions stay valid (a drafter's cache keeps them).
    Otherwise the stream is unchanged only through the accepted drafts: the main model's
    token replaced pending[accepted], and every held draft after it is dropped.
    """
    held = verified < len(state) and accepted == verified
    if held and state.tokens[verified] == main_token:
        unchanged = len(state)
        state.drop(verified + 1)
        return unchanged
    state.clear()
    return accepted
