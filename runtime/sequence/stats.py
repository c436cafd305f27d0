"""Per-sequence statistics: all a window policy or the drafting choice may read."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SourceStats:
    """Drafts verified and accepted, per position in the window, of one drafting source."""

    drafted_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    reached_at: list[int] = field(default_factory=list)  # verified with every draft before it held

    @property
    def drafted(self) -> int:
        return sum(self.drafted_at)

    @property
    def accepted(self) -> int:
        return sum(self.accepted_at)

    def record(self, position: int, accepted: bool, reached: bool = True) -> None:
        while len(self.drafted_at) <= position:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
            self.reached_at.append(0)
        self.drafted_at[position] += 1
        self.accepted_at[position] += accepted
        self.reached_at[position] += reached


@dataclass
class SeqStats:
    """Per-sequence statistics: all a window policy may read."""

    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_at: list[int] = field(default_factory=list)  # accepted count per draft position
    last_window: int = 0  # drafts verified last round
    last_accepted: int = 0
    windows: int = 0  # sum of verified windows, for the mean
    # per draft of the last verified window: the draft's top-1 probability, and the entropy
    # of its renormalised top-3 (model drafts; a lookup's confidence, no entropy)
    draft_top1: list[float] = field(default_factory=list)
    draft_entropy: list[float] = field(default_factory=list)
    sources: dict[str, SourceStats] = field(default_factory=dict)  # lookup, draft
    methods: dict[str, int] = field(default_factory=dict)  # rounds per chosen method

    def record_sources(self, sources: list[str], accepted: int) -> None:
        """The verified drafts' sources, in window order; the first `accepted` held."""
        for i, source in enumerate(sources):
            self.sources.setdefault(source, SourceStats()).record(i, i < accepted, i <= accepted)

    def record_method(self, method: str) -> None:
        self.methods[method] = self.methods.get(method, 0) + 1

    def record(self, drafted: int, accepted: int, top1: list[float] | None = None,
               entropy: list[float] | None = None) -> None:
        """A verified round: its drafts, how many held, the window's confidences."""
        if top1 is not None:
            self.draft_top1, self.draft_entropy = list(top1), list(entropy or ())
        if drafted:
            self.rounds += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        self.windows += drafted
        self.last_window, self.last_accepted = drafted, accepted
        if len(self.accepted_at) < drafted:
            self.accepted_at += [0] * (drafted - len(self.accepted_at))
        for i in range(accepted):
            self.accepted_at[i] += 1

    def summary(self) -> dict:
        """The statistics a user sees (CLI --json, bench, the API's response extension)."""
        return {"rounds": self.rounds, "draft_tokens": self.draft_tokens,
                "accepted_tokens": self.accepted_tokens,
                "mean_accepted_per_round": round(self.mean_accepted_per_round, 4),
                "acceptance_rate": round(self.acceptance_rate, 4),
                "mean_window": round(self.mean_window, 3), "methods": dict(self.methods),
                "sources": {name: {"drafted_at": s.drafted_at, "accepted_at": s.accepted_at}
                            for name, s in self.sources.items()}}

    @property
    def mean_accepted_per_round(self) -> float:
        return self.accepted_tokens / self.rounds if self.rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_window(self) -> float:
        return self.windows / self.rounds if self.rounds else 0.0

    @property
    def confidence_slope(self) -> float | None:
        """Mean |first difference| of the draft's top-1 probability along the window."""
        p = self.draft_top1
        if len(p) < 2:
            return None
        return sum(abs(b - a) for a, b in zip(p, p[1:])) / (len(p) - 1)

    @property
    def top3_entropy(self) -> float | None:
        """Mean entropy (nats) of the draft's renormalised top-3 over the window."""
        e = self.draft_entropy
        return sum(e) / len(e) if e else None
