"""Speculative acceptance: one pure function per mode, returning tokens and statistics.

The draft proposed d_1..d_w; the main model scored the window, giving for each position i
(1..w+1) the distribution p_i of the token after the prefix ending at d_{i-1}: its logits
processed as plain decoding would process them at that position (the request's penalties
and bias counting d_1..d_{i-1}, a grammar's mask; `scored_rows`), then temperature and
truncation.

Greedy: accept the longest prefix with d_i == argmax p_i, then append argmax p_{n+1}: the
main model's own next token. Output equals plain greedy decoding token for token.

Sampling (Leviathan et al. 2023, Chen et al. 2023): the draft sampled d_i ~ q_i.
    accept d_i with probability min(1, p_i(d_i) / q_i(d_i));
    at the first rejection, emit t ~ norm(max(0, p_i - q_i)) and stop;
    if all w are accepted, emit a bonus t ~ p_{w+1}.
For every position the emitted token is distributed exactly as p_i: the accepted mass
sum_x min(p, q) plus the residual max(0, p - q) add up to p.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dspark.runtime.drafting.state import DraftState
from dspark.runtime.sequence.request import Sequence
from dspark.runtime.sequence.sampling import probabilities, sample


@dataclass(frozen=True)
class Acceptance:
    tokens: list[int]  # accepted draft tokens, then the main model's token
    accepted: int  # how many draft tokens were accepted (0..w)
    drafted: int  # w

    @property
    def rejected(self) -> int:
        return self.drafted - self.accepted


def accept_greedy(drafts: list[int], main_logits: np.ndarray) -> Acceptance:
    """main_logits: [w+1, vocab] for positions d_1..d_w and the bonus."""
    targets = main_logits.argmax(axis=-1)
    n = 0
    while n < len(drafts) and drafts[n] == targets[n]:
        n += 1
    return Acceptance(drafts[:n] + [int(targets[n])], n, len(drafts))


def accept_greedy_rows(drafts: list[int], rows) -> Acceptance:
    """accept_greedy over rows read in order, only up to the first rejection (masked rows,
    runtime/grammar, are computed on demand)."""
    n = 0
    while n < len(drafts) and drafts[n] == int(np.argmax(rows[n])):
        n += 1
    return Acceptance(drafts[:n] + [int(np.argmax(rows[n]))], n, len(drafts))


def accept_sampled(drafts: list[int], q, p, rng: np.random.Generator) -> Acceptance:
    """q[i]: draft i's proposal distribution [vocab], None where it was proposed
    deterministically (a lookup: q one-hot); p[i]: the main probabilities at position i
    (processed), for i in 0..w. Rows are read only up to the first rejection, so p may
    compute them on demand (LazyRows): a float64 softmax of every row costs a good share of
    a decode step, mostly for rows after a rejection."""
    for i, d in enumerate(drafts):
        qi, pi = q[i], p[i]
        if rng.random() * (1.0 if qi is None else qi[d]) < pi[d]:  # u < p/q, no 0-division
            continue
        if qi is None:  # max(0, p - onehot(d)): p without d
            residual = pi.copy()
            residual[d] = 0.0
        else:
            residual = np.maximum(pi - qi, 0.0)
        token = sample(residual if residual.sum() > 0 else pi, rng)  # sample() normalises
        return Acceptance(drafts[:i] + [token], i, len(drafts))
    return Acceptance(list(drafts) + [sample(p[len(drafts)], rng)], len(drafts), len(drafts))


class LazyRows:
    """rows[i] = fn(i), computed on first use and kept."""

    def __init__(self, fn):
        self.fn = fn
        self.rows: dict[int, np.ndarray] = {}

    def __getitem__(self, i: int) -> np.ndarray:
        if i not in self.rows:
            self.rows[i] = self.fn(i)
        return self.rows[i]


def scored_rows(seq: Sequence, drafts: list[int], logits: np.ndarray):
    """The rows a round's tokens are chosen from: the main model's logits, row i processed
    as if drafts[:i] were accepted (the request's processors, then a grammar's mask),
    each computed when first read (runtime/sequence/processors.py, runtime/grammar)."""
    rows = logits
    if seq.processors is not None:
        rows = seq.processors.rows(rows, drafts)
    if seq.constraint is not None:
        rows = seq.constraint.rows(rows, drafts)
    return rows


def accept(seq: Sequence, pending: DraftState, k: int, rows) -> Acceptance:
    """A sequence's round over its scored rows: greedy takes the exact-match rule,
    sampling rejection sampling against the drafts' proposals q."""
    params, drafts = seq.request.sampling, pending.tokens[:k]
    if params.greedy:
        if isinstance(rows, np.ndarray):
            return accept_greedy(drafts, rows)
        return accept_greedy_rows(drafts, rows)
    p = LazyRows(lambda i: probabilities(rows[i], params))
    return accept_sampled(drafts, pending.q[:k], p, seq.rng)
