"""One validation path for generation requests: the CLI, the benchmark and the server all
call `validate` with the engine's published limits, and get the same messages."""

from __future__ import annotations

from dataclasses import dataclass

from dspark.runtime.errors import RequestError
from dspark.runtime.sequence.request import GenerationRequest

METHODS = ("hybrid", "lookup", "draft")


@dataclass(frozen=True)
class Limits:
    """What a request is checked against (published by the engine after every change)."""

    vocab_size: int
    max_seq_len: int
    draft_models: tuple[str, ...]  # the bundle's draft roles ("draft", "draft_<name>")


def validate(request: GenerationRequest, limits: Limits) -> None:
    ids, limit = request.prompt_ids, limits.max_seq_len
    bad = next((t for t in ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise RequestError(f"token id {bad} is outside the vocabulary [0, {limits.vocab_size})",
                           "prompt")
    if len(ids) >= limit:
        raise RequestError(f"the prompt has {len(ids)} tokens; the maximum context length "
                           f"is {limit}", "prompt", "context_length_exceeded")
    if len(ids) + request.max_tokens > limit:
        raise RequestError(f"the prompt ({len(ids)} tokens) + max_tokens ({request.max_tokens}) "
                           f"exceeds the maximum context length {limit}", "max_tokens",
                           "context_length_exceeded")
    bad = next((t for t, _ in request.penalties.logit_bias if not 0 <= t < limits.vocab_size),
               None)
    if bad is not None:
        raise RequestError(f"logit_bias names token id {bad}, outside the vocabulary "
                           f"[0, {limits.vocab_size})", "logit_bias")
    seed = request.sampling.seed
    if seed is not None and not 0 <= seed < 2**63:
        raise RequestError(f"seed must lie in [0, 2^63), got {seed}", "seed")
    if request.draft_model is not None and request.draft_model not in limits.draft_models:
        raise RequestError(f"draft model {request.draft_model!r} is not in the bundle "
                           f"(drafts: {', '.join(limits.draft_models) or 'none'})",
                           "speculative_config.draft_model")
    if request.method is not None:
        if request.method not in METHODS:
            raise RequestError(f"unknown drafting method {request.method!r} (known: "
                               f"{', '.join(METHODS)})", "speculative_config.method")
        if request.method == "draft" and not limits.draft_models:
            raise RequestError("method 'draft' needs a draft model; this bundle has none "
                               "(use 'lookup')", "speculative_config.method")


def draft_role(name: str, limits: Limits) -> str:
    """A draft model named by its role ("draft_small") or its short name ("small")."""
    for role in limits.draft_models:
        if name in (role, role.removeprefix("draft_")):
            return role
    raise RequestError(f"draft model {name!r} is not in the bundle (drafts: "
                       f"{', '.join(limits.draft_models) or 'none'})",
                       "speculative_config.draft_model")
