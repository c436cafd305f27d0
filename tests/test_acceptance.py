"""Acceptance and sampling are small pure functions: checked exactly or statistically."""

from __future__ import annotations

import numpy as np
import pytest

from dspark.runtime.cli.bench import leviathan_bound, solve_alpha
from dspark.runtime.engine.acceptance import Acceptance, LazyRows, accept_greedy, accept_sampled
from dspark.runtime.errors import DSparkError
from dspark.runtime.sequence.sampling import SamplingParams, probabilities, sample


def _logits(*rows):
    out = np.full((len(rows), 6), -5.0, np.float32)
    for i, t in enumerate(rows):
        out[i, t] = 5.0
    return out


def test_greedy_acceptance():
    main = _logits(2, 4, 1, 3)  # the main model's argmax after each prefix
    assert accept_greedy([2, 4, 1], main).tokens == [2, 4, 1, 3]  # all + bonus
    r = accept_greedy([2, 5, 1], main)
    assert (r.tokens, r.accepted, r.rejected) == ([2, 4], 1, 2)
    assert accept_greedy([0, 4, 1], main).tokens == [2]
    assert accept_greedy([], main[:1]).tokens == [2]  # window 0: plain decoding


def test_sampled_acceptance_reproduces_p():
    """For random p, q the emitted first token is distributed as p (within 4 sigma)."""
    rng = np.random.default_rng(0)
    vocab, n = 5, 40000
    p = rng.dirichlet(np.ones(vocab), size=3)
    q = rng.dirichlet(np.ones(vocab), size=2)
    counts = np.zeros(vocab)
    for _ in range(n):
        drafts = [sample(q[0], rng), sample(q[1], rng)]
        counts[accept_sampled(drafts, q, p, rng).tokens[0]] += 1
    sigma = np.sqrt(p[0] * (1 - p[0]) / n)
    assert np.all(np.abs(counts / n - p[0]) < 4 * sigma + 1e-9)


def _rounds(rule, p, q, n, rng):
    """Emitted tokens of n rounds, drafts sampled from q (None rows: a lookup's fixed x)."""
    fixed = [int(p[i].argmax()) for i in range(len(q))]
    out = []
    for _ in range(n):
        drafts = [fixed[i] if q[i] is None else sample(q[i], rng) for i in range(len(q))]
        out.append(rule(drafts, q, LazyRows(lambda i: p[i]), rng).tokens)
    return out


def _position_pvalue(rounds, p, j) -> tuple[float, int]:
    from scipy.stats import chisquare

    tokens = np.array([r[j] for r in rounds if len(r) > j])
    expected = p[j] * len(tokens)
    counts = np.bincount(tokens, minlength=len(p[j]))
    return float(chisquare(counts, expected).pvalue), len(tokens)


@pytest.mark.parametrize("kind", ["model", "mapped", "mixed"])
def test_sampled_acceptance_exact_at_every_position_and_the_bonus(kind):
    """Each emitted token, at draft positions 1..4 and the bonus, follows that position's p
    among the rounds that reached it: for model drafts (q dense), token-map-restricted drafts
    (q zero off the mapped ids) and a lookup proposal mixed in (q one-hot)."""
    rng = np.random.default_rng(3)
    vocab, w = 6, 4
    p = rng.dirichlet(np.ones(vocab) * 2, size=w + 1)
    q = list(rng.dirichlet(np.ones(vocab) * 2, size=w))
    if kind == "mapped":
        for row in q:
            row[rng.choice(vocab, 2, replace=False)] = 0.0
            row /= row.sum()
    if kind == "mixed":
        q[1] = None
    rounds = _rounds(accept_sampled, p, q, 30000, rng)
    for j in range(w + 1):
        pvalue, n = _position_pvalue(rounds, p, j)
        assert n > 1000 and pvalue > 1e-3, (j, n, pvalue)


def test_a_broken_residual_fails_at_later_positions():
    """Resampling from p instead of the residual max(0, p - q) on rejection: caught."""
    def broken(drafts, q, p, rng):
        for i, d in enumerate(drafts):
            if rng.random() * q[i][d] < p[i][d]:
                continue
            return Acceptance(drafts[:i] + [sample(p[i], rng)], i, len(drafts))
        return Acceptance(list(drafts) + [sample(p[len(drafts)], rng)], len(drafts),
                          len(drafts))

    rng = np.random.default_rng(4)
    p = rng.dirichlet(np.ones(6) * 2, size=5)
    q = list(rng.dirichlet(np.ones(6) * 2, size=4))
    rounds = _rounds(broken, p, q, 30000, rng)
    assert min(_position_pvalue(rounds, p, j)[0] for j in range(4)) < 1e-6


def test_identical_draft_is_always_accepted():
    rng = np.random.default_rng(1)
    p = rng.dirichlet(np.ones(8), size=4)
    for _ in range(200):
        drafts = [sample(p[i], rng) for i in range(3)]
        assert accept_sampled(drafts, p[:3], p, rng).accepted == 3


def test_processors():
    logits = np.log(np.array([0.5, 0.2, 0.15, 0.1, 0.05]))
    p = probabilities(logits, SamplingParams(temperature=1.0))
    np.testing.assert_allclose(p, [0.5, 0.2, 0.15, 0.1, 0.05])
    p = probabilities(logits, SamplingParams(temperature=1.0, top_k=2))
    np.testing.assert_allclose(p, [0.5 / 0.7, 0.2 / 0.7, 0, 0, 0])
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.8))
    np.testing.assert_allclose(p, [0.5 / 0.85, 0.2 / 0.85, 0.15 / 0.85, 0, 0])
    hot = probabilities(logits, SamplingParams(temperature=100.0))
    assert hot.max() - hot.min() < 0.01
    with pytest.raises(DSparkError, match="top_p"):
        SamplingParams(top_p=0)


def test_leviathan_arithmetic():
    for w in (1, 4, 8):
        for alpha in (0.3, 0.8):
            per_round = (1 - alpha ** (w + 1)) / (1 - alpha)
            assert solve_alpha(per_round, w) == pytest.approx(alpha, abs=1e-6)
    assert leviathan_bound(0.8, 4, 0.0) == pytest.approx((1 - 0.8 ** 5) / 0.2)
    assert leviathan_bound(0.0, 4, 0.5) == pytest.approx(1 / 3)
