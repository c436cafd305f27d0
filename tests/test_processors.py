"""The logits processors (runtime/sequence/processors.py) and logprobs, lossless under
speculation.

Each processor, and combinations of them: greedy output with the draft model, lookups and the
hybrid, batched, equals plain decoding's, which is the original model's own greedy loop with
the same processors applied; sampled output keeps plain decoding's distribution; echo's prompt
logprobs are the original's log-softmax; a request's tokens are the same alone and in a batch
of 16.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from dspark.compiler.reference import OriginalModel
from dspark.runtime.bundle.bundle import open_bundle
from dspark.runtime.bundle.config import DFlashConfig, VerifyBalanceConfig
from dspark.runtime.engine.engine import Engine
from dspark.runtime.errors import RequestError
from dspark.runtime.sequence.logprobs import log_softmax
from dspark.runtime.sequence.processors import Penalties, Processors
from dspark.runtime.sequence.request import GenerationRequest
from dspark.runtime.sequence.sampling import SamplingParams, probabilities

from chi_square import chi_square

# speculate at any batch size and beside prompt chunks (VLB would turn drafting off for 512
# sequences at once, and keeps steps that feed a prompt plain)
ALWAYS = DFlashConfig(verify_balance=VerifyBalanceConfig(batch_cap=False, batch_modes=False,
                                                        plain_prompt_steps=False))
CASES = {
    "presence": Penalties(presence=1.5),
    "frequency": Penalties(frequency=0.8),
    "repetition": Penalties(repetition=1.6),
    "bias": Penalties(logit_bias=((7, 5.0), (11, -100.0), (42, 3.5))),
    "all": Penalties(presence=0.5, frequency=0.4, repetition=1.3, logit_bias=((9, 4.0),)),
}


def test_a_row_is_processed_as_written():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(50).astype(np.float32) * 3
    p = Penalties(presence=0.5, frequency=0.25, repetition=2.0, logit_bias=((3, 1.0), (4, -2.0)))
    proc = Processors(p, (1, 2, 2))
    proc.emit([5, 5, 6])
    got = proc.row(logits, [6, 7])
    want = logits.copy()
    want[3] += 1.0
    want[4] -= 2.0
    for t in (1, 2, 5, 6, 7):  # prompt and output (with the drafts before the row)
        want[t] = want[t] / 2.0 if want[t] > 0 else want[t] * 2.0
    for t, n in Counter([5, 5, 6, 6, 7]).items():  # output only, counted
        want[t] -= 0.5 + 0.25 * n
    np.testing.assert_allclose(got, want, rtol=1e-6)
    rows = proc.rows(np.stack([logits] * 3), [6, 7])
    np.testing.assert_allclose(rows[2], got, rtol=1e-6)
    np.testing.assert_allclose(rows[0], proc.row(logits, []), rtol=1e-6)


def test_min_p_keeps_what_is_likely_enough():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    p = probabilities(logits, SamplingParams(temperature=1.0, min_p=0.25))
    np.testing.assert_allclose(p, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0])


def test_out_of_range_processors_are_refused_naming_the_field(compiled):
    for kwargs, param in (({"presence": 3.0}, "presence_penalty"),
                          ({"frequency": -2.5}, "frequency_penalty"),
                          ({"repetition": 0.0}, "repetition_penalty"),
                          ({"logit_bias": ((1, 101.0),)}, "logit_bias")):
        with pytest.raises(RequestError) as info:
            Penalties(**kwargs)
        assert info.value.param == param
    engine = Engine(open_bundle(compiled[("llama", "classic")]), "fixed", 4)
    with pytest.raises(RequestError, match="token id 999") as info:
        engine.submit(GenerationRequest((1, 2), 4, penalties=Penalties(logit_bias=((999, 1.0),))))
    assert info.value.param == "logit_bias"


def _reference(original: OriginalModel, prompt: list[int], penalties: Penalties, n: int
               ) -> list[int]:
    """The original's greedy loop with the processors applied to each step's logits."""
    proc = Processors(penalties, tuple(prompt))
    logits, past = original.forward(prompt, original.empty_past())
    tokens: list[int] = []
    while len(tokens) < n:
        token = int(np.argmax(proc.row(logits[-1], [])))
        tokens.append(token)
        proc.emit([token])
        logits, past = original.forward([token], past)
    return tokens


def _prompts(seed: int = 3) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, 300, n)] for n in (4, 17, 33)] + [
        list(range(7, 27)) * 2]


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_with_processors_is_plain_decodings_with_every_drafter(self_bundle, case):
    """The llama fixture drafting with itself (its drafts hold unless the processors move
    the main's choice, so windows are long and every row's context matters)."""
    penalties = CASES[case]
    path, main = self_bundle
    prompts = _prompts()
    runs = {}
    for method in ("plain", "draft", "lookup", "hybrid"):
        engine = Engine(open_bundle(path), "fixed", 4, max_batch=len(prompts))
        seqs = engine.generate([GenerationRequest(
            tuple(p), 24, penalties=penalties, speculative=method != "plain",
            method=None if method == "plain" else method) for p in prompts])
        runs[method] = [s.generated for s in seqs]
        if method == "draft":
            assert sum(s.stats.accepted_tokens for s in seqs) > 0
    assert all(runs[m] == runs["plain"] for m in runs), case
    original = OriginalModel(main)
    assert [_reference(original, p, penalties, 24) for p in prompts] == runs["plain"]
    assert runs["plain"] != [original.greedy(p, 24) for p in prompts]  # they did something


def test_a_request_is_the_same_alone_and_in_a_batch_of_16(compiled):
    path = compiled[("gpt2", "classic")]
    rng = np.random.default_rng(9)
    prompts = [[int(t) for t in rng.integers(3, 300, int(rng.integers(3, 30)))]
               for _ in range(16)]
    penalties = CASES["all"]
    batch = Engine(open_bundle(path), "fixed", 4, max_batch=16).generate(
        [GenerationRequest(tuple(p), 16, penalties=penalties) for p in prompts])
    alone = Engine(open_bundle(path), "fixed", 4, max_batch=1)
    for p, seq in zip(prompts, batch):
        [one] = alone.generate([GenerationRequest(tuple(p), 16, penalties=penalties)])
        assert one.generated == seq.generated


def test_sampled_tokens_with_processors_keep_the_distribution(compiled, fixture_pairs,
                                                             monkeypatch):
    """The second token of 3000 seeded sequences (drafted by the draft model, verified by
    rejection sampling), among those whose first is the most frequent one, against the
    main's processed distribution there (chi-square); with the verify's rows left
    unprocessed, the test fails."""
    # the bias moves the second token's two most likely ones (found for this prompt)
    penalties = Penalties(presence=1.2, repetition=1.4, logit_bias=((4, -3.0), (71, 2.0)))
    params = SamplingParams(temperature=1.1, min_p=0.02)
    path = compiled[("llama", "classic")]
    main = fixture_pairs[("llama", "classic")][0]
    prompt = (17, 42, 99, 7, 250, 17)
    original = OriginalModel(main)
    logits, past = original.forward(list(prompt), original.empty_past())

    def second_tokens(engine: Engine):
        seqs = engine.generate([GenerationRequest(
            prompt, 3, SamplingParams(params.temperature, seed=i, min_p=params.min_p),
            penalties=penalties, method="draft") for i in range(3000)])
        first = Counter(s.generated[0] for s in seqs).most_common(1)[0][0]
        picked = [s for s in seqs if s.generated[0] == first]
        assert all(s.stats.sources["draft"].drafted_at[0] >= 1 for s in picked)
        return first, np.array([s.generated[1] for s in picked])

    engine = Engine(open_bundle(path), "fixed", 3, max_batch=512, config=ALWAYS)
    first, tokens = second_tokens(engine)
    proc = Processors(penalties, prompt)
    proc.emit([first])
    after, _ = original.forward([first], past)
    p = probabilities(proc.row(after[-1], []), params)
    raw = probabilities(after[-1], params)
    assert 0.5 * np.abs(p - raw).sum() > 0.3  # the processors matter here
    assert chi_square(tokens, p) > 1e-3
    import dspark.runtime.engine.engine as engine_module

    monkeypatch.setattr(engine_module, "scored_rows", lambda seq, drafts, logits: logits)
    _, broken = second_tokens(Engine(open_bundle(path), "fixed", 3, max_batch=512,
                                     config=ALWAYS))
    assert chi_square(broken, p) < 1e-6


def test_echo_scores_the_prompt_as_the_original_does(self_bundle):
    """Prompt logprobs (echo) over a prompt fed in several chunks, and output logprobs with
    speculation on (the llama fixture drafting with itself: long verify windows): the
    original model's log-softmax at each position."""
    path, main = self_bundle
    original = OriginalModel(main)
    prompt = [int(t) for t in np.random.default_rng(2).integers(3, 300, 70)]
    engine = Engine(open_bundle(path), "fixed", 4, prefill_tokens=32)
    [seq] = engine.generate([GenerationRequest(tuple(prompt), 12, logprobs=3, echo=True,
                                               method="draft")])
    logits, past = original.forward(prompt, original.empty_past())
    want = [log_softmax(row) for row in logits]
    assert seq.prompt_logprobs[0] is None and len(seq.prompt_logprobs) == len(prompt)
    for j, lp in enumerate(seq.prompt_logprobs[1:], start=1):
        assert lp.token == prompt[j]
        assert abs(lp.logprob - want[j - 1][prompt[j]]) < 1e-4
        assert [t for t, _ in lp.top] == list(np.argsort(-want[j - 1])[:3])
    assert len(seq.logprobs) == 12 and seq.stats.accepted_tokens > 0
    rows = [logits[-1]]
    for token in seq.generated[:-1]:
        step, past = original.forward([token], past)
        rows.append(step[-1])
    for lp, row, token in zip(seq.logprobs, rows, seq.generated):
        assert lp.token == token and abs(lp.logprob - log_softmax(row)[token]) < 1e-4
        assert lp.top[0][0] == int(np.argmax(row))  # greedy: the token is the top one
