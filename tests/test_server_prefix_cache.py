"""The prefix cache over HTTP, with the official openai client: OpenAI's
`usage.prompt_tokens_details.cached_tokens`, the per-request opt-out (`cache_prompt`), and
the Prometheus counters."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import MODEL, LiveServer, api_error

SYSTEM = " ".join(f"w{i}" for i in range(100, 140))  # 40 tokens of the word tokenizer


@pytest.fixture(scope="module")
def server(tok_bundle):
    with LiveServer(tok_bundle) as live:
        yield live


def _chat(client, question: str, **kw):
    return client.chat.completions.create(
        model=MODEL, max_tokens=8, temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        **kw)


def _samples(server) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics").text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_a_shared_system_prompt_is_reported_cached(server):
    client = server.client()
    first = _chat(client, "hello w1")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = _chat(client, "hello w2 w3")
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 32 <= cached < second.usage.prompt_tokens  # whole blocks of the system prompt
    fresh = _chat(client, "hello w2 w3", extra_body={"cache_prompt": False})
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0
    assert fresh.choices[0].message.content == second.choices[0].message.content


def test_streamed_usage_reports_cached_tokens(server):
    client = server.client()
    _chat(client, "w7")
    chunks = list(_chat(client, "w8", stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 32


def test_prefix_cache_metrics_move(server):
    client = server.client()
    before = _samples(server)
    _chat(client, "w9")
    _chat(client, "w10")
    after = _samples(server)
    assert after["dspark_prefix_cache_hits_total"] >= before.get(
        "dspark_prefix_cache_hits_total", 0) + 32
    assert after["dspark_prefix_cache_queries_total"] > after["dspark_prefix_cache_hits_total"]
    assert 0 < after["dspark_prefix_cache_hit_rate"] < 1
    assert after["dspark_prefix_cache_blocks"] >= 2
    assert "dspark_prefix_cache_evictions_total" in after
    assert "dspark_kv_cache_copies_total" in after


def test_cache_prompt_must_be_a_boolean(server):
    e = api_error(lambda: _chat(server.client(), "w1", extra_body={"cache_prompt": "maybe"}))
    assert e.status_code == 400 and "cache_prompt" in str(e.body)
