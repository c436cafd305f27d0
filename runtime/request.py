"""What a caller asks for, and the running state of one sequence."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from dspark.runtime.errors import DSparkError
from dspark.runtime.sampling import SamplingParams


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    max_tokens: int = 64
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    speculative: bool = True
    max_window: int | None = None  # a cap; the window policy still decides
    tenant: str = "default"
    draft: str | None = None  # a draft role of the bundle; None: the engine's current one

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise DSparkError("the prompt is empty")
        if self.max_tokens < 1:
            raise DSparkError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.max_window is not None and self.max_window < 1:
            raise DSparkError(f"max_window must be >= 1, got {self.max_window}")


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
    draft_top1: list[float] = field(default_factory=list)  # per drafted position, this round
    draft_entropy: list[float] = field(default_factory=list)  # of the renormalised top-3

    def record(self, drafted: int, accepted: int) -> None:
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


class Sequence:
    def __init__(self, seq_id: int, request: GenerationRequest):
        self.id = seq_id
        self.request = request
        self.tokens = list(request.prompt_ids)
        self.prompt_len = len(self.tokens)
        self.main_cached = 0  # tokens whose KV the main pool holds (always len(tokens) - 1 after)
        self.draft_cached = 0  # tokens of tokens + drafts the draft model has read
        self.draft_offsets = [0]  # draft positions after each of those (a token map expands)
        self.draft_role: str | None = None  # whose pool holds the draft cache
        self.drafts: list[int] = []  # drafted, not yet verified (held ones carry over)
        self.draft_probs: list[np.ndarray] = []
        self.window = 0  # drafts wanted this round
        self.verify = 0  # drafts verified this round
        self.chunk = 0  # uncached tokens fed to the main model this round
        self.draft_conf: list[tuple[float, float]] = []  # (top-1 prob, top-3 entropy) per draft
        self.waited_from = 0  # scheduler step at submission (aging)
        self.rng = np.random.default_rng(request.sampling.seed)
        self.stats = SeqStats()
        self.finish_reason: str | None = None
        self.text_end: int | None = None  # set when a stop string cut the text
        self.submitted = time.perf_counter()
        self.first_token_at: float | None = None
        self.first_token_step: int | None = None
        self.finished_at: float | None = None

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def tenant(self) -> str:
        return self.request.tenant

    @property
    def prefilling(self) -> bool:
        """No token emitted yet: the prompt (or its rest) still has to be fed."""
        return len(self.tokens) == self.prompt_len

    @property
    def uncached(self) -> int:
        """Tokens the main model has not seen (the prompt's rest, or the last token)."""
        return len(self.tokens) - self.main_cached

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.submitted
