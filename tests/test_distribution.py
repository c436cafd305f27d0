"""Sampled output follows the main model's distribution (Leviathan-Chen rejection sampling).

Thousands of seeded sequences draft with a 1-layer draft and verify with the 3-layer main.
The first token comes from the prefill round (no drafting there); the second from the first
speculative round. Among the sequences sharing the most frequent first token t1, the second
token's counts must pass a chi-square test against the main model's softmax after
PROMPT + t1, and must fail it when the rejection rule is deliberately broken.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chisquare

import dspark.runtime.engine as engine_mod
from dspark.compiler.reference import OriginalModel
from dspark.runtime.acceptance import Acceptance
from dspark.runtime.bundle import open_bundle
from dspark.runtime.config import DFlashConfig, VerifyBalanceConfig
from dspark.runtime.engine import Engine
from dspark.runtime.request import GenerationRequest
from dspark.runtime.sampling import SamplingParams, probabilities, sample

SAMPLES = 4000
# speculate at any batch size (VLB would turn drafting off for 512 sequences at once)
ALWAYS = DFlashConfig(verify_balance=VerifyBalanceConfig(batch_cap=False))
PARAMS = SamplingParams(temperature=1.3)


def _second_tokens(bundle_path, prompt: tuple[int, ...], first: int) -> np.ndarray:
    """Second generated tokens of the sequences whose first token is `first`."""
    engine = Engine(open_bundle(bundle_path), "fixed", 3, max_batch=512, config=ALWAYS)
    requests = [GenerationRequest(prompt, 5, SamplingParams(PARAMS.temperature, seed=i))
                for i in range(SAMPLES)]
    seqs = engine.generate(requests)
    assert all(s.stats.draft_tokens >= 1 for s in seqs)  # token 2 came from a speculative round
    assert engine.arena.free_blocks == engine.plan.num_blocks
    return np.array([s.generated[1] for s in seqs if s.generated[0] == first])


def _chi_square(tokens: np.ndarray, p: np.ndarray) -> float:
    """p-value, pooling tokens expected fewer than 5 times into one bin."""
    expected = p * len(tokens)
    counts = np.bincount(tokens, minlength=len(p)).astype(float)
    big = expected >= 5
    f_obs = np.append(counts[big], counts[~big].sum())
    f_exp = np.append(expected[big], expected[~big].sum())
    keep = f_exp > 0
    return float(chisquare(f_obs[keep], f_exp[keep]).pvalue)


def _probs(path, tokens: list[int]) -> np.ndarray:
    model = OriginalModel(path)
    logits, _ = model.forward(tokens, model.empty_past())
    return probabilities(logits[-1], PARAMS)


@pytest.fixture(scope="module")
def setup(fixture_pairs, compiled):
    """A prompt whose first token is likely enough to condition on (found deterministically)."""
    main, draft = fixture_pairs[("llama", "classic")]
    rng = np.random.default_rng(0)
    for _ in range(200):
        prompt = tuple(int(t) for t in rng.integers(0, 320, 5))
        p1 = _probs(main, list(prompt))
        if p1.max() >= 0.4:
            break
    first = int(p1.argmax())
    p = _probs(main, [*prompt, first])
    q = _probs(draft, [*prompt, first])
    assert 0.5 * np.abs(p - q).sum() > 0.2  # the draft really is a different distribution
    return compiled[("llama", "classic")], prompt, first, p


def test_speculated_token_follows_main_distribution(setup):
    bundle, prompt, first, p = setup
    tokens = _second_tokens(bundle, prompt, first)
    assert len(tokens) > 1000
    pvalue = _chi_square(tokens, p)
    print(f"chi-square p-value (correct rule, {len(tokens)} samples): {pvalue:.3g}")
    assert pvalue > 1e-3


def _broken(drafts, q, p, rng) -> Acceptance:
    """A classic bug: on rejection, resample from p instead of norm(max(0, p - q))."""
    for i, d in enumerate(drafts):
        if rng.random() * q[i, d] < p[i, d]:
            continue
        return Acceptance(drafts[:i] + [sample(p[i], rng)], i, len(drafts))
    return Acceptance(list(drafts) + [sample(p[len(drafts)], rng)], len(drafts), len(drafts))


def test_broken_rule_is_detected(setup, monkeypatch):
    bundle, prompt, first, p = setup
    monkeypatch.setattr(engine_mod, "accept_sampled", _broken)
    pvalue = _chi_square(_second_tokens(bundle, prompt, first), p)
    print(f"chi-square p-value (broken rule): {pvalue:.3g}")
    assert pvalue < 1e-6


def test_seeded_runs_are_reproducible(compiled):
    bundle = open_bundle(compiled[("gpt2", "dynamo")])
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=123)
    prompt = (11, 42, 7, 99, 250)
    runs = [Engine(bundle, "fixed", 4).generate([GenerationRequest(prompt, 32, params)])[0]
            for _ in range(2)]
    assert runs[0].generated == runs[1].generated
    other = Engine(bundle, "fixed", 4).generate(
        [GenerationRequest(prompt, 32, SamplingParams(0.9, 0.9, 50, seed=124))])[0]
    assert other.generated != runs[0].generated
