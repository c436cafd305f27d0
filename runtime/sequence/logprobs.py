"""Log-probabilities of tokens, as the API reports them.

An output token's logprob is the log-softmax of the row it was chosen from, after the
request's logits processors and a grammar's mask (processors.py, runtime/grammar), before
temperature and top-k / top-p / min-p: what the model, so constrained, gives the token
(vLLM's processed logprobs without temperature). Whatever drafted a token, the row is the
main model's. A prompt token's (echo) is the log-softmax of the main model's raw logits at
the position before it; the first has none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # the most likely tokens there, most likely first


def log_softmax(row: np.ndarray) -> np.ndarray:
    x = np.asarray(row, np.float64)
    top = x.max()
    return x - (top + np.log(np.exp(x - top).sum()))


def _lse(x: np.ndarray) -> float:
    """log(sum(exp(x))): one float32 exp pass, summed in float64 (a full float64
    log-softmax of a row costs several times as much)."""
    top = float(x.max())
    return top + math.log(float(np.exp(x - top).sum(dtype=np.float64)))


def token_logprob(row: np.ndarray, token: int, top: int) -> TokenLogprob:
    """`token`'s logprob in `row` and the `top` most likely tokens' (finite ones only)."""
    x = np.asarray(row, np.float32)
    lse = _lse(x)
    best: tuple[tuple[int, float], ...] = ()
    if top:
        ids = np.argpartition(x, -top)[-top:]
        ids = ids[np.argsort(-x[ids], kind="stable")]
        best = tuple((int(i), float(x[i]) - lse) for i in ids if np.isfinite(x[i]))
    return TokenLogprob(token, float(x[token]) - lse, best)


def output_logprobs(rows, tokens: list[int], top: int) -> list[TokenLogprob]:
    """The logprobs of a round's emitted tokens: token i was chosen from rows[i]."""
    return [token_logprob(rows[i], t, top) for i, t in enumerate(tokens)]


def score_prompt(seq, rows: np.ndarray) -> None:
    """Echo: each fed prompt position's raw logits give the next prompt token's logprob
    (the first token has none)."""
    if seq.main_cached == 0:
        seq.prompt_logprobs.append(None)
    top = seq.request.logprobs or 0
    for r, row in enumerate(rows):
        nxt = seq.main_cached + r + 1
        if nxt < seq.prompt_len:
            seq.prompt_logprobs.append(token_logprob(row, seq.tokens[nxt], top))
