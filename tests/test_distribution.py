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

import dspark.runtime.engine.acceptance as acceptance_mod
from dspark.compiler.reference import OriginalModel
from dspark.runtime.bundle.bundle import open_bundle
from dspark.runtime.bundle.config import DFlashConfig, VerifyBalanceConfig
from dspark.runtime.drafting.state import DraftState
from dspark.runtime.engine.acceptance import Acceptance, accept_sampled
from dspark.runtime.engine.engine import Engine
from dspark.runtime.sequence.request import GenerationRequest
from dspark.runtime.sequence.sampling import SamplingParams, probabilities, sample

from chi_square import chi_square

SAMPLES = 2500  # ~1170 sequences keep the likely first token: the broken rule reads p ~1e-13
# speculate at any batch size and beside prompt chunks (VLB would turn drafting off for 512
# sequences at once, and keeps steps that feed a prompt plain)
ALWAYS = DFlashConfig(verify_balance=VerifyBalanceConfig(batch_cap=False, batch_modes=False,
                                                        plain_prompt_steps=False))
PARAMS = SamplingParams(temperature=1.3)


def _second_tokens(bundle_path, prompt: tuple[int, ...], first: int,
                   method: str = "draft") -> np.ndarray:
    """Second generated tokens of the sequences whose first token is `first`, drafting with
    `method` (the draft model, or the lookup)."""
    engine = Engine(open_bundle(bundle_path), "fixed", 3, max_batch=512, config=ALWAYS)
    requests = [GenerationRequest(prompt, 5, SamplingParams(PARAMS.temperature, seed=i),
                                  method=method) for i in range(SAMPLES)]
    seqs = [s for s in engine.generate(requests) if s.generated[0] == first]
    assert engine.arena.free_blocks == engine.plan.num_blocks
    # token 2 came from a round verifying a proposal of that drafter
    assert all(s.stats.sources[method].drafted_at[0] >= 1 for s in seqs)
    return np.array([s.generated[1] for s in seqs])


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


@pytest.mark.slow
def test_speculated_token_follows_main_distribution(setup):
    bundle, prompt, first, p = setup
    tokens = _second_tokens(bundle, prompt, first)
    assert len(tokens) > 1000
    pvalue = chi_square(tokens, p)
    print(f"chi-square p-value (correct rule, {len(tokens)} samples): {pvalue:.3g}")
    assert pvalue > 1e-3


def _broken(drafts, q, p, rng) -> Acceptance:
    """A classic bug: on rejection, resample from p instead of norm(max(0, p - q))."""
    for i, d in enumerate(drafts):
        if rng.random() * (1.0 if q[i] is None else q[i][d]) < p[i][d]:
            continue
        return Acceptance(drafts[:i] + [sample(p[i], rng)], i, len(drafts))
    return Acceptance(list(drafts) + [sample(p[len(drafts)], rng)], len(drafts), len(drafts))


@pytest.mark.slow
def test_broken_rule_is_detected(setup, monkeypatch):
    bundle, prompt, first, p = setup
    monkeypatch.setattr(acceptance_mod, "accept_sampled", _broken)
    pvalue = chi_square(_second_tokens(bundle, prompt, first), p)
    print(f"chi-square p-value (broken rule): {pvalue:.3g}")
    assert pvalue < 1e-6


def test_seeded_runs_are_reproducible(compiled):
    bundle = open_bundle(compiled[("gpt2", "dynamo")])
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=123)
    prompt = (11, 42, 7, 99, 250)
    runs = [Engine(bundle, "fixed", 4).generate([GenerationRequest(prompt, 32, params,
                                                                method="draft")])[0]
            for _ in range(2)]
    assert runs[0].generated == runs[1].generated
    other = Engine(bundle, "fixed", 4).generate(
        [GenerationRequest(prompt, 32, SamplingParams(0.9, 0.9, 50, seed=124))])[0]
    assert other.generated != runs[0].generated


def _lookup_round(p: np.ndarray, proposal: tuple[int, ...], rule, samples: int) -> list:
    """Emitted tokens of `samples` verify rounds of a lookup proposal (deterministic: q is
    one-hot, built by DraftState as the engine does) against main distributions p[i]."""
    state = DraftState()
    for x in proposal:
        state.add(x, "lookup")
    q = state.q[:len(proposal)]  # None: proposed deterministically (q one-hot)
    return [rule(list(proposal), q, p, np.random.default_rng(i)).tokens for i in range(samples)]


@pytest.fixture(scope="module")
def lookup_setup(fixture_pairs):
    """Real main distributions at two positions, and a proposal of moderately likely tokens
    (so both an accepted and a rejected lookup draft happen often)."""
    main, _ = fixture_pairs[("llama", "classic")]
    prompt = [11, 42, 7, 99, 250]
    p1 = _probs(main, prompt)
    x1 = int(p1.argmax())
    p2 = _probs(main, [*prompt, x1])
    x2 = int(p2.argmax())
    p3 = _probs(main, [*prompt, x1, x2])
    return np.stack([p1, p2, p3]), (x1, x2)


@pytest.mark.parametrize("position", [0, 1])
def test_lookup_proposal_follows_main_distribution(lookup_setup, position):
    """A deterministic proposal x is accepted with probability p(x), else the token is drawn
    from p without x: the token emitted at each position follows p exactly (position 1:
    among rounds that accepted the first draft)."""
    p, proposal = lookup_setup
    rounds = _lookup_round(p, proposal, accept_sampled, 60000)
    tokens = np.array([r[position] for r in rounds if len(r) > position])
    pvalue = chi_square(tokens, p[position])
    print(f"chi-square p-value (lookup, position {position}, {len(tokens)}): {pvalue:.3g}")
    assert len(tokens) > 1000 and pvalue > 1e-3


def test_broken_rule_is_detected_with_lookup(lookup_setup):
    p, proposal = lookup_setup
    tokens = np.array([r[0] for r in _lookup_round(p, proposal, _broken, 20000)])
    assert chi_square(tokens, p[0]) < 1e-6
