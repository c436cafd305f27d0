"""OpenAI's sampling surface over HTTP, with the official openai client: logprobs (chat and
completions, streamed and not), echo (lm-evaluation-harness's loglikelihood shape), n,
presence / frequency / repetition penalties, logit_bias and min_p, and their 400s."""

from __future__ import annotations

import pytest
from server_helpers import CHAT, MODEL, LiveServer, api_error


@pytest.fixture(scope="module")
def server(tok_bundle):
    with LiveServer(tok_bundle) as live:
        yield live


def test_chat_logprobs_in_openais_shape_streamed_and_not(server):
    client = server.client()
    kwargs = dict(model=MODEL, messages=CHAT, max_tokens=10, temperature=0, logprobs=True,
                  top_logprobs=3)
    resp = client.chat.completions.create(**kwargs)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens == 10
    # a word-level vocabulary: the text is the tokens, spaced
    assert [bytes(c.bytes).decode() for c in content] == resp.choices[0].message.content.split()
    for c in content:
        assert c.logprob <= 0 and len(c.top_logprobs) == 3
        assert c.top_logprobs[0].token == c.token  # greedy: the chosen token is the top one
        assert abs(c.top_logprobs[0].logprob - c.logprob) < 1e-6
        assert c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob >= c.top_logprobs[2].logprob
    streamed = [e for chunk in client.chat.completions.create(**kwargs, stream=True)
                if chunk.choices and chunk.choices[0].logprobs
                for e in chunk.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [
        (e.token, round(e.logprob, 4)) for e in content]
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10,
                                           temperature=0)
    assert plain.choices[0].logprobs is None


def test_echo_scores_the_prompt_as_lm_eval_asks(server, tok_bundle, fixture_pairs):
    """echo + logprobs + max_tokens 1 on token ids: every prompt token's logprob (the
    first None), the original model's log-softmax."""
    from dspark.compiler.reference import OriginalModel
    from dspark.runtime.sequence.logprobs import log_softmax

    ids = [302, 303, 17, 42, 99, 7, 250, 13, 302, 303]
    resp = server.client().completions.create(model=MODEL, prompt=ids, max_tokens=1,
                                              temperature=0, logprobs=2, echo=True)
    lp = resp.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and all(len(t) <= 2 for t in lp.top_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert resp.choices[0].text.startswith("hello world")
    original = OriginalModel(fixture_pairs[("llama", "classic")][0])
    logits, _ = original.forward(ids, original.empty_past())
    for j in range(1, len(ids)):
        assert abs(lp.token_logprobs[j] - log_softmax(logits[j - 1])[ids[j]]) < 1e-4
    streamed = list(server.client().completions.create(
        model=MODEL, prompt=ids, max_tokens=1, temperature=0, logprobs=2, echo=True,
        stream=True))
    first = streamed[0].choices[0]
    assert first.text.startswith("hello world") and first.logprobs.token_logprobs[0] is None


def test_n_choices_share_the_prompt_and_count_their_tokens(server):
    client = server.client()
    resp = client.completions.create(model=MODEL, prompt="hello world w5 w9 w12 w30 w44",
                                     max_tokens=8, temperature=1.2, n=3, seed=7,
                                     extra_body={"speculative_decoding": False})
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert resp.usage.completion_tokens == 3 * 8  # no end token in this vocabulary
    assert resp.usage.prompt_tokens == 7  # the prompt once
    again = client.completions.create(model=MODEL, prompt="hello world w5 w9 w12 w30 w44",
                                      max_tokens=8, temperature=1.2, n=3, seed=7,
                                      extra_body={"speculative_decoding": False})
    assert [c.text for c in again.choices] == [c.text for c in resp.choices]  # seeded
    assert len({c.text for c in resp.choices}) > 1  # each choice samples its own
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6,
                                                 temperature=0, n=2, stream=True,
                                                 stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts[0] == texts[1] and texts[0]  # greedy: the same answer twice
    assert chunks[-1].usage.completion_tokens == 12
    finals = [c for chunk in chunks for c in chunk.choices if c.finish_reason]
    assert sorted(c.index for c in finals) == [0, 1]


def test_penalties_and_bias_change_greedy_output_the_same_with_speculation(server):
    client = server.client()
    prompt = "hello world w5 w9 hello world w5 w9 hello"

    def run(spec: bool, **kw) -> str:
        return client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
            extra_body={"speculative_decoding": spec, **kw}).choices[0].text

    base = run(False)
    for kw in ({"presence_penalty": 1.5, "frequency_penalty": 1.0}, {"repetition_penalty": 1.8},
               {"logit_bias": {"303": 100}}, {"min_p": 0.2, "presence_penalty": 0.5}):
        off, on = run(False, **kw), run(True, **kw)
        assert on == off, kw
    assert base != run(False, logit_bias={"303": 100})  # (each processor's own effect is
    # checked against the original model in tests/test_processors.py)
    assert run(False, logit_bias={"303": 100}).split() == ["world"] * 16


@pytest.mark.parametrize("body,param", [
    ({"logit_bias": {"99999": 1}}, "logit_bias"),
    ({"logit_bias": {"w3": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"n": 17}, "n"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
])
def test_bad_sampling_fields_are_400s_naming_them(server, body, param):
    e = api_error(lambda: server.client().chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4, extra_body=body))
    assert e.status_code == 400 and param in str(e.body), e.body


def test_completions_refuse_what_they_do_not_have(server):
    e = api_error(lambda: server.client().completions.create(
        model=MODEL, prompt="hello", max_tokens=2, logprobs=21))
    assert e.status_code == 400 and "logprobs" in str(e.body)
    e = api_error(lambda: server.client().chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=2, extra_body={"echo": True}))
    assert e.status_code == 400 and "echo" in str(e.body)
    e = api_error(lambda: server.client().completions.create(
        model=MODEL, prompt="hello", max_tokens=2, best_of=2))
    assert e.status_code == 400 and "best_of" in str(e.body)
