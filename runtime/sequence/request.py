"""What a caller asks for, and the running state of one sequence."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from dspark.runtime.errors import DSparkError
from dspark.runtime.sequence.processors import Penalties, Processors
from dspark.runtime.sequence.sampling import SamplingParams
from dspark.runtime.sequence.stats import SeqStats


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    max_tokens: int = 64
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    speculative: bool = True
    max_window: int | None = None  # a cap; the window policy still decides
    tenant: str = "default"
    draft_model: str | None = None  # a draft role of the bundle; None: the current default
    method: str | None = None  # drafting method (hybrid, lookup, draft); None: the config's
    grammar: str | None = None  # an llguidance grammar the output must follow (runtime/grammar)
    cache_prompt: bool = True  # reuse a cached prefix and cache this one (cache/prefix_cache)
    penalties: Penalties = field(default_factory=Penalties)  # logits processors
    logprobs: int | None = None  # each output token's logprob and this many top ones
    echo: bool = False  # also score the prompt's tokens (their logprobs)

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise DSparkError("the prompt is empty")
        if self.max_tokens < 1:
            raise DSparkError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.max_window is not None and self.max_window < 1:
            raise DSparkError(f"max_window must be >= 1, got {self.max_window}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise DSparkError(f"logprobs must lie in [0, 20], got {self.logprobs}")


class Sequence:
    def __init__(self, seq_id: int, request: GenerationRequest):
        self.id = seq_id
        self.request = request
        self.tokens = list(request.prompt_ids)
        self.prompt_len = len(self.tokens)
        self.main_cached = 0  # tokens whose KV the main pool holds (len(tokens) - 1 after)
        self.cached_tokens = 0  # of the prompt, found in the prefix cache at admission
        self.waited_from = 0  # scheduler step at submission (aging)
        self.rng = np.random.default_rng(request.sampling.seed)
        self.stats = SeqStats()
        self.finish_reason: str | None = None
        self.text_end: int | None = None  # set when a stop string cut the text
        self.error: Exception | None = None  # what ended it, with finish_reason "error"
        self.submitted = time.perf_counter()
        self.first_token_at: float | None = None
        self.first_token_step: int | None = None
        self.constraint = None  # the grammar's state (runtime/grammar), with request.grammar
        self.processors = (Processors(request.penalties, request.prompt_ids)
                           if request.penalties.active else None)
        self.logprobs: list = []  # per output token (logprobs.py), with request.logprobs
        self.prompt_logprobs: list = []  # per prompt token, the first None, with request.echo

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
