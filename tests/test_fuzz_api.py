"""API fuzzing: 500 generated requests (hypothesis, derandomized) over both generation
endpoints with realistic and broken values: the served model name and others, messages of
every role and shape, every sampling and speculative field at and beyond its bounds, odd
unicode (lone surrogates), huge and empty strings, NaN, structured output and tools,
streaming on and off. Never a 5xx, every 4xx in OpenAI's error shape, every 200 complete
(a stream ends with [DONE]), no hang; the server healthy and idle afterwards."""

from __future__ import annotations

import json
from collections import Counter

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers import MODEL, LiveServer

ODD_TEXT = st.sampled_from(["", "\udcff", "w1 " * 400, "<user>", "🛒 emoji", "\x00"])
TEXT = st.one_of(st.text(max_size=30), ODD_TEXT)
BROKEN_NUMBER = st.one_of(st.integers(-3, 0), st.floats(allow_nan=True, allow_infinity=True),
                          st.sampled_from([2**63, -(2**63), "1", True, [], {}]))
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                 "content": TEXT})
SCHEMA = st.sampled_from([{"type": "object"}, {"type": "nope"}, [], {"type": "object",
                          "properties": {"a": {"type": "integer", "maximum": 3}}}])
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
# every field at and within its bounds
VALID = {
    "max_tokens": st.one_of(st.none(), st.integers(1, 40)),
    "temperature": st.one_of(st.none(), st.floats(0, 2)),
    "top_p": st.floats(0.01, 1), "top_k": st.integers(0, 50), "seed": st.integers(0, 2**31),
    "n": st.just(1), "logprobs": st.sampled_from([False, None]),
    "presence_penalty": st.just(0.0),
    "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=3)),
    "stream": st.booleans(), "stream_options": st.just({"include_usage": True}),
    "speculative_decoding": st.booleans(),
    "speculative_config": st.fixed_dictionaries({}, optional={
        "method": st.sampled_from(["hybrid", "lookup", "draft", None]),
        "max_window": st.integers(1, 64), "draft_model": st.sampled_from(["draft", None])}),
}
# and beyond: one field set to something a server must refuse (or survive)
BROKEN = {
    "model": st.sampled_from(["other", "", 5, None]),
    "max_tokens": BROKEN_NUMBER, "temperature": BROKEN_NUMBER, "top_p": BROKEN_NUMBER,
    "top_k": BROKEN_NUMBER, "seed": BROKEN_NUMBER, "n": st.integers(2, 4),
    "logprobs": st.just(True), "presence_penalty": st.floats(0.1, 2),
    "stop": st.one_of(st.lists(TEXT, min_size=5, max_size=6), st.integers()),
    "stream": st.just("yes"), "stream_options": st.just({"x": 1}),
    "speculative_decoding": BROKEN_NUMBER,
    "speculative_config": st.one_of(st.just({"method": "magic"}), st.just([]),
                                    st.builds(lambda n: {"max_window": n}, BROKEN_NUMBER),
                                    st.just({"draft_model": "other"})),
    "unknown_field": TEXT,
}
CHAT_VALID = {**VALID, "max_completion_tokens": st.integers(1, 40),
              "response_format": st.one_of(
                  st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
                  st.builds(lambda s: {"type": "json_schema",
                                       "json_schema": {"name": "x", "schema": s}}, SCHEMA)),
              "tools": st.just([TOOL]),
              "tool_choice": st.sampled_from(["auto", "none", "required"])}
CHAT_BROKEN = {**BROKEN, "max_completion_tokens": BROKEN_NUMBER,
               "messages": st.one_of(st.just([]), st.lists(st.fixed_dictionaries({
                   "role": st.sampled_from(["robot", 7, "tool", "developer"]),
                   "content": st.one_of(TEXT, st.none(), st.integers(), st.lists(
                       st.fixed_dictionaries({"type": st.sampled_from(["text", "image"]),
                                              "text": TEXT}), max_size=2))}),
                   min_size=1, max_size=2)),
               "response_format": st.sampled_from([{"type": "yaml"}, {}, [],
                                                   {"type": "json_schema"}]),
               "tools": st.sampled_from([[{"type": "function"}], [{}], "x"]),
               "tool_choice": st.sampled_from(["bad", {"type": "function",
                                                       "function": {"name": "g"}}])}
COMPLETION_BROKEN = {**BROKEN, "prompt": st.one_of(ODD_TEXT, st.lists(
    st.integers(-5, 400), max_size=70), st.lists(TEXT, min_size=2, max_size=3), st.just([]))}


def body(required: dict, valid: dict, broken: dict):
    """A request with some valid optional fields, then 0-2 of its fields broken."""
    return st.builds(lambda base, extra, breaks: {**base, **extra, **breaks},
                     st.fixed_dictionaries(required),
                     st.fixed_dictionaries({}, optional=valid),
                     st.dictionaries(st.sampled_from(sorted(broken)), st.none(), max_size=2)
                     .flatmap(lambda keys: st.fixed_dictionaries(
                         {k: broken[k] for k in keys})))


CHAT = body({"model": st.just(MODEL), "messages": st.lists(MESSAGE, min_size=1, max_size=3)},
            CHAT_VALID, CHAT_BROKEN)
COMPLETION = body({"model": st.just(MODEL), "prompt": st.one_of(
    st.text(min_size=1, max_size=30), st.lists(st.integers(0, 319), min_size=1,
                                               max_size=40))}, VALID, COMPLETION_BROKEN)


@pytest.fixture(scope="module")
def server(tok_bundle):
    with LiveServer(tok_bundle, max_batch=8) as live:
        live.http = httpx.Client(base_url=live.url, timeout=30,  # a hang fails the test
                                 headers={"content-type": "application/json"})
        yield live
        live.http.close()


SEEN: Counter = Counter()  # status codes, printed at the end (-s)


FUZZ = settings(max_examples=250, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])


def _check(response: httpx.Response) -> None:
    SEEN[response.status_code] += 1
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"]
        assert set(error) == {"message", "type", "param", "code"}
        return
    if response.headers["content-type"].startswith("text/event-stream"):
        lines = [line for line in response.text.splitlines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        for line in lines[:-1]:
            assert "error" not in json.loads(line[6:]), line
    else:
        assert response.json()["choices"][0]["finish_reason"] in (
            "stop", "length", "tool_calls")


@pytest.mark.slow
@FUZZ
@given(body=CHAT)
def test_fuzzed_chat_completions(server, body):
    _check(server.http.post("/v1/chat/completions", content=json.dumps(body)))


@pytest.mark.slow
@FUZZ
@given(body=COMPLETION)
def test_fuzzed_completions(server, body):
    _check(server.http.post("/v1/completions", content=json.dumps(body)))


def test_healthy_and_idle_after_fuzzing(server):
    print(f"fuzzed requests by status: {dict(sorted(SEEN.items()))}")
    if SEEN:  # (run with the fuzz tests) the generated requests reach the engine too
        assert SEEN[200] >= 50 and sum(SEEN.values()) >= 500
    assert server.http.get("/health").status_code == 200
    assert server.wait_idle()
    r = server.http.post("/v1/completions", json={"model": MODEL, "prompt": "hello world",
                                                  "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
