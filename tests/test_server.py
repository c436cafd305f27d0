"""The real server on loopback, driven by the official openai client (and raw HTTP where a
client would not send such a request)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import CHAT, MODEL, LiveServer, api_error

from bundle_cache import compiled
from cli_helpers import run_dsrun


@pytest.fixture(scope="module")
def server(tok_bundle):
    with LiveServer(tok_bundle) as live:
        yield live


def test_models_and_health(server):
    client = server.client()
    [model] = client.models.list().data
    assert model.id == MODEL
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"


def test_chat_completion(server):
    resp = server.client().chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=12, temperature=0,
        extra_body={"speculative_config": {"method": "draft"}})
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert resp.usage.completion_tokens == 12 and resp.usage.prompt_tokens > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 12
    stats = resp.model_extra["speculative_decoding_stats"]
    assert stats["draft_tokens"] > 0 and stats["rounds"] > 0


def test_greedy_over_http_equals_dsrun_generate(server, tok_bundle, capsys):
    resp = server.client().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16,
                                                   temperature=0)
    r = run_dsrun(capsys, "generate", "--model", tok_bundle, "--chat", CHAT[0]["content"],
                  "--max-tokens", "16", "--json")
    assert resp.choices[0].message.content == json.loads(r.out)["text"]


def test_greedy_over_http_equals_the_original_model(server, tok_bundle, fixture_pairs):
    """The served text is the original ONNX model's own greedy loop, decoded."""
    from dspark.compiler.reference import OriginalModel
    from dspark.runtime.bundle.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tok_bundle / "tokenizer")
    prompt = "hello world w5 w9 w17"
    want = OriginalModel(fixture_pairs[("llama", "classic")][0]).greedy(
        list(tokenizer.encode(prompt)), 24)
    for method in ("draft", "lookup"):
        resp = server.client().completions.create(
            model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
            extra_body={"speculative_config": {"method": method}})
        assert resp.choices[0].text == tokenizer.decode(want), method
        assert resp.usage.completion_tokens == len(want)


def test_streaming_matches_non_streaming(server):
    client = server.client()
    kwargs = dict(model=MODEL, messages=CHAT, max_tokens=20, temperature=0)
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finals] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20


def test_completions_plain_and_streaming(server):
    client = server.client()
    resp = client.completions.create(model=MODEL, prompt="hello world w7", max_tokens=8,
                                     temperature=0)
    assert resp.object == "text_completion" and resp.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="hello world w7", max_tokens=8, temperature=0, stream=True))
    assert streamed == resp.choices[0].text
    ids = client.completions.create(model=MODEL, prompt=[302, 303, 7], max_tokens=4,
                                    temperature=0)
    assert ids.usage.prompt_tokens == 3


def test_stop_seed_and_sampling(server):
    client = server.client()
    base = client.completions.create(model=MODEL, prompt="hello world w3", max_tokens=10,
                                     temperature=0).choices[0].text
    word = base.split()[2]
    cut = client.completions.create(model=MODEL, prompt="hello world w3", max_tokens=10,
                                    temperature=0, stop=[word])
    assert cut.choices[0].finish_reason == "stop" and word not in cut.choices[0].text
    # a seed fixes plain sampling; with speculation the server adapts windows to its load,
    # so a seeded sample may differ between calls (each one drawn from the main model's
    # distribution), as OpenAI's seed is best-effort
    runs = [client.completions.create(model=MODEL, prompt="hello world w3", max_tokens=10,
                                      temperature=0.9, top_p=0.95, seed=11,
                                      extra_body={"speculative_decoding": False}).choices[0].text
            for _ in range(2)]
    assert runs[0] == runs[1]


def test_stop_string_across_tokens_streamed_and_not(server):
    """A stop string spanning two tokens (the end of one word, the space, the start of the
    next): the text is exactly what precedes it, streamed or not, none of it leaked."""
    client = server.client()
    kwargs = dict(model=MODEL, prompt="hello world w3", max_tokens=24, temperature=0)
    base = client.completions.create(**kwargs).choices[0].text
    words = base.split()
    stop = words[3][1:] + " " + words[4][:2]
    at = base.find(stop)
    assert at > 0, (base, stop)
    cut = client.completions.create(**kwargs, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.text == base[:at]
    stream = client.completions.create(**kwargs, stop=[stop], stream=True)
    chunks = [c.choices[0] for c in stream if c.choices]
    assert "".join(c.text for c in chunks) == base[:at]
    assert chunks[-1].finish_reason == "stop"


def test_speculative_extensions(server):
    client = server.client()
    off = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12,
                                         temperature=0, extra_body={"speculative_decoding": False})
    on = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=12, temperature=0,
        extra_body={"speculative_config": {"max_window": 2, "draft_model": "draft"}})
    assert off.choices[0].message.content == on.choices[0].message.content
    assert off.model_extra["speculative_decoding_stats"]["draft_tokens"] == 0
    assert 0 < on.model_extra["speculative_decoding_stats"]["mean_window"] <= 2


def test_errors_are_openai_objects(server):
    client = server.client()
    e = api_error(lambda: client.chat.completions.create(model="gpt-9", messages=CHAT))
    assert isinstance(e, openai.NotFoundError) and "does not exist" in e.message
    e = api_error(lambda: client.chat.completions.create(model=MODEL, messages=CHAT,
                                                      max_tokens=500))
    assert isinstance(e, openai.BadRequestError) and "maximum context length 64" in e.message
    assert e.body["param"] == "max_tokens" and e.body["code"] == "context_length_exceeded"
    for kwargs, param in (({"n": 99}, "n"), ({"top_logprobs": 2}, "top_logprobs"),
                          ({"presence_penalty": 5.0}, "presence_penalty"),
                          ({"extra_body": {"best_of": 2}}, "best_of")):
        e = api_error(lambda kw=kwargs: client.chat.completions.create(model=MODEL, messages=CHAT,
                                                                    **kw))
        assert isinstance(e, openai.BadRequestError) and param in str(e.body), e.body
    e = api_error(lambda: client.chat.completions.create(model=MODEL, messages=CHAT,
                                                      extra_body={"foo": 1}))
    assert e.status_code == 400 and "unrecognized request argument: foo" in e.message
    e = api_error(lambda: client.chat.completions.create(model=MODEL, messages=CHAT,
                                                      temperature=7))
    assert e.status_code == 400 and e.body["param"] == "temperature"
    long = [{"role": "user", "content": " ".join(["w1"] * 80)}]
    e = api_error(lambda: client.chat.completions.create(model=MODEL, messages=long))
    assert e.status_code == 400 and "maximum context length is 64" in e.message
    e = api_error(lambda: client.chat.completions.create(
        model=MODEL, messages=CHAT, extra_body={"speculative_config": {"draft_model": "x"}}))
    assert e.status_code == 400 and "draft model 'x'" in e.message
    raw = httpx.post(f"{server.url}/v1/chat/completions", content=b"{nope",
                     headers={"content-type": "application/json"})
    assert raw.status_code == 400 and raw.json()["error"]["code"] == "invalid_json"
    raw = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": 5})
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"


def _metrics(server) -> dict:
    text = httpx.get(f"{server.url}/metrics").text
    return {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}, text


def test_metrics_move(server):
    client = server.client()
    before, _ = _metrics(server)
    client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0,
                                   extra_headers={"X-Tenant-ID": "acme"})
    after, text = _metrics(server)
    for name in ("dflash_window_size_current", "dspar_kv_cache_hit_rate",
                 "dflash_reject_rate_1m", "dspar_verify_latency_p99_ms",
                 "dflash_scheduler_decision_count_1m", "dflash_accept_throughput_tps",
                 "dflash_draft_tokens_total", "dflash_accepted_tokens_total",
                 "dspar_kv_cache_usage_ratio", "dspar_kv_cache_kdr", "dflash_degrade_mode",
                 "dflash_requests_total", "dflash_ttft_ms_count", "dflash_itl_ms_count",
                 "dspar_verify_latency_ms_count", "dflash_config_reload_errors_total"):
        assert name in after, name
    deadline = time.monotonic() + 5  # the first reading spans at least 0.2 s of /proc ticks
    while "dspar_host_other_cores" not in after and time.monotonic() < deadline:
        time.sleep(0.2)
        after, _ = _metrics(server)
    assert after["dspar_host_other_cores"].value >= 0
    assert 'tenant="acme"' in text and 'model="tok"' in text
    assert after["dspar_verify_latency_ms_count"].value > before.get(
        "dspar_verify_latency_ms_count", type("", (), {"value": 0})).value


def test_drafting_methods_over_http(server):
    client = server.client()
    prompt = "hello world w5 w9 hello world w5"
    off = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                    extra_body={"speculative_decoding": False})
    for method in ("lookup", "draft", "hybrid"):
        on = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                       extra_body={"speculative_config": {"method": method}})
        assert on.choices[0].text == off.choices[0].text, method
        stats = on.model_extra["speculative_decoding_stats"]
        assert set(stats["sources"]) <= {"lookup", "draft"} and sum(stats["methods"].values())
    e = api_error(lambda: client.completions.create(
        model=MODEL, prompt=prompt, extra_body={"speculative_config": {"method": "magic"}}))
    assert e.status_code == 400 and e.body["param"] == "speculative_config.method"
    e = api_error(lambda: client.completions.create(model=MODEL, prompt=prompt, temperature=1,
                                                 seed=-3))
    assert e.status_code == 400 and e.body["param"] == "seed"
    metrics, _ = _metrics(server)
    assert any(name.startswith("dflash_draft_method_rounds") for name in metrics)
    assert any(name.startswith("dflash_draft_tokens_by_source") for name in metrics)


def test_metrics_scraped_while_streams_run(server):
    """The event loop reads only published snapshots: scraping in a tight loop while 16
    streams run sees no error and counters that never go back."""
    client = server.client()
    results, errors = [], []

    def stream(i: int) -> None:
        try:
            chunks = client.completions.create(model=MODEL, prompt=f"hello world w{i % 9}",
                                               max_tokens=40, temperature=0, stream=True)
            results.append("".join(c.choices[0].text for c in chunks if c.choices))
        except Exception as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    seen = []
    while any(t.is_alive() for t in threads):
        response = httpx.get(f"{server.url}/metrics")
        assert response.status_code == 200
        seen.append(sum(s.value for f in text_string_to_metric_families(response.text)
                        for s in f.samples if s.name == "dspar_verify_latency_ms_count"))
    for t in threads:
        t.join()
    assert not errors and len(results) == 16 and seen  # (how many scrapes overlap: timing)
    assert seen == sorted(seen)  # a counter never went back
    assert server.wait_idle()


def test_draftless_bundle_serves_lookup_only(fixture_pairs, tmp_path):
    from dspark.compiler.compile import CompileOptions

    main, _ = fixture_pairs[("llama", "classic")]
    bundle = tmp_path / "lookup.dsmodel"
    compiled(CompileOptions(main, None, bundle, aot=False))
    with LiveServer(bundle, warmup=False) as live:
        client = live.client()
        [model] = client.models.list().data
        assert model.model_extra["drafts"] == []
        ids = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
        plain = client.completions.create(model="lookup", prompt=ids, max_tokens=12,
                                          temperature=0, extra_body={"speculative_decoding": False})
        spec = client.completions.create(model="lookup", prompt=ids, max_tokens=12,
                                         temperature=0)
        # no tokenizer: the text is empty; the lossless tests compare the tokens
        assert spec.usage.completion_tokens == plain.usage.completion_tokens == 12
        e = api_error(lambda: client.completions.create(
            model="lookup", prompt=ids, extra_body={"speculative_config": {"method": "draft"}}))
        assert e.status_code == 400 and e.body["param"] == "speculative_config.method"
        assert "no draft model" in e.message or "has none" in e.message


def test_lone_surrogates_are_a_400_not_a_500(server):
    body = ('{"model": "tok", "max_tokens": 4, "messages": '
            '[{"role": "user", "content": "hi \\udcff"}]}')
    raw = httpx.post(f"{server.url}/v1/chat/completions", content=body.encode(),
                     headers={"content-type": "application/json"})
    assert raw.status_code == 400 and raw.json()["error"]["param"] == "messages[0].content"
    raw = httpx.post(f"{server.url}/v1/completions", content=(
        b'{"model": "tok", "max_tokens": 4, "prompt": "x\\ud800"}'),
        headers={"content-type": "application/json"})
    assert raw.status_code == 400 and raw.json()["error"]["param"] == "prompt"
    assert httpx.get(f"{server.url}/health").status_code == 200
