"""Serving limits and admin, each on a server of its own: cache resize and warm-up, the
rotary tables' length, request body size (413), API key (401), queue full (429), overload
(queued, or 429)."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest
from server_helpers import CHAT, MODEL, LiveServer, api_error, queued_behind_gate


def test_cache_resize_and_warmup(gpt2_tok_bundle, tmp_path):
    config = json.loads((gpt2_tok_bundle / "dflash_config.json").read_text())
    config["cache_resize_grace_period_sec"] = 0
    (tmp_path / "c.json").write_text(json.dumps(config))
    with LiveServer(gpt2_tok_bundle, config=tmp_path / "c.json") as live:
        post = lambda path, body: httpx.post(f"{live.url}{path}", json=body, timeout=30)  # noqa: E731
        warm = post("/v1/warmup", {"draft_tokens": 8, "main_tokens": 1}).json()
        # other_cores: null when the warm-up was shorter than /proc's ticks can measure
        assert warm["seconds"] > 0 and (warm["other_cores"] or 0) >= 0 and "other_cores" in warm
        r = post("/v1/cache/resize", {"max_length": 32})
        assert r.status_code == 200 and r.json()["max_length"] == 32
        e = api_error(lambda: live.client().chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=30))
        assert "maximum context length 32" in e.message
        r = post("/v1/cache/resize", {"max_length": 2049})  # past what it was compiled for
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_length"
        r = post("/v1/cache/resize", {"max_length": 2048})
        assert r.status_code == 200 and r.json()["max_length"] == 2048
        stream = live.client().chat.completions.create(model=MODEL, messages=CHAT,
                                                       max_tokens=2000, stream=True)
        next(iter(stream))
        r = post("/v1/cache/resize", {"max_length": 64})
        assert r.status_code == 409 and r.json()["error"]["code"] == "conflict"
        stream.close()
        assert post("/v1/cache/resize", {"max_length": 10}).status_code == 400


def test_resize_refused_past_the_rotary_tables(tok_bundle):
    """The llama bundle's rotary tables cover its compiled max_seq_len (64), no more."""
    with LiveServer(tok_bundle, warmup=False) as live:
        r = httpx.post(f"{live.url}/v1/cache/resize", json={"max_length": 65}, timeout=30)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "max_length" and "rotary tables" in error["message"]
        r = httpx.post(f"{live.url}/v1/cache/resize", json={"max_length": 64}, timeout=30)
        assert r.status_code == 200 and r.json()["max_length"] == 64


def test_request_body_over_the_limit_is_413(tok_bundle):
    """Declared (Content-Length) or chunked, a body past --max-body-mb is refused in OpenAI's
    error shape before it is parsed; the server keeps serving."""
    with LiveServer(tok_bundle, max_body_bytes=4096, warmup=False) as live:
        url = f"{live.url}/v1/completions"
        big = {"model": MODEL, "prompt": "w1 " * 3000, "max_tokens": 2}
        r = httpx.post(url, json=big, timeout=30)
        assert r.status_code == 413, r.text
        assert r.json()["error"]["code"] == "request_too_large"

        def chunks():
            body = json.dumps(big).encode()
            for i in range(0, len(body), 1000):
                yield body[i:i + 1000]

        r = httpx.post(url, content=chunks(), timeout=30,
                       headers={"content-type": "application/json"})
        assert r.status_code == 413 and "limit of 4096 bytes" in r.json()["error"]["message"]
        ok = live.client().completions.create(model=MODEL, prompt="hello world", max_tokens=3)
        assert ok.usage.completion_tokens == 3


def test_api_key(tok_bundle):
    with LiveServer(tok_bundle, api_key="s3cret", warmup=False) as live:
        e = api_error(lambda: live.client().models.list())
        assert isinstance(e, openai.AuthenticationError)
        assert live.client("s3cret").models.list().data[0].id == MODEL
        assert httpx.get(f"{live.url}/health").status_code == 200
        assert httpx.get(f"{live.url}/metrics").status_code == 401


def test_queue_full_is_429(tok_bundle):
    """Event-driven: a blocking call holds the engine thread, so requests queue; past
    --max-queue waiting ones (the first of three takes the batch's free slot) the next gets a
    429 with Retry-After; once released, the queued complete."""
    with LiveServer(tok_bundle, max_batch=1, max_queue=2, warmup=False) as live:
        results = []

        def ask() -> None:
            r = live.client().completions.create(model=MODEL, prompt="hello world",
                                                 max_tokens=8, temperature=0)
            results.append(r.usage.completion_tokens)

        gate, threads = queued_behind_gate(live, ask, 3)
        r = httpx.post(f"{live.url}/v1/completions", timeout=30,
                       json={"model": MODEL, "prompt": "hello", "max_tokens": 2})
        gate.set()
        for t in threads:
            t.join()
        assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
        assert r.headers["retry-after-ms"] == "1000"  # no finish rate yet: a second
        assert r.json()["error"]["type"] == "rate_limit_error"
        assert results == [8, 8, 8]


def test_requests_the_engine_took_still_count_as_waiting(tok_bundle):
    """Requests the engine thread took from the commands sit in the engine's queue: until
    the next step's snapshot they were counted nowhere, and the queue overfilled."""
    import threading

    with LiveServer(tok_bundle, max_batch=1, max_queue=2, warmup=False) as live:
        service, results = live.state.service, []

        def ask() -> None:
            r = live.client().completions.create(model=MODEL, prompt="hello world",
                                                 max_tokens=8, temperature=0)
            results.append(r.usage.completion_tokens)

        gate, threads = queued_behind_gate(live, ask, 3)
        held, inside = threading.Event(), threading.Event()

        def hold(engine) -> None:  # after the submits, in the same drain: no step between
            inside.set()
            held.wait(30)
        service.commands.put(("call", (hold, None, None)))
        gate.set()
        assert inside.wait(30) and service.commands.qsize() == 0
        r = httpx.post(f"{live.url}/v1/completions", timeout=30,
                       json={"model": MODEL, "prompt": "hello", "max_tokens": 2})
        held.set()
        for t in threads:
            t.join()
        assert r.status_code == 429, r.text
        assert results == [8, 8, 8]


def test_a_request_a_freed_slot_takes_is_not_counted_as_waiting(tok_bundle):
    """Between steps the last snapshot still counts, as waiting, the request that the slot a
    finished one freed will take at the next step; the client that just finished and comes
    straight back is not refused for it."""
    import asyncio
    from dataclasses import replace

    from dspark.runtime.engine.loader import load_engine
    from dspark.runtime.errors import QueueFullError
    from dspark.runtime.sequence.request import GenerationRequest
    from dspark.runtime.server.service import EngineService

    engine, _ = load_engine(tok_bundle, max_batch=2, warmup=False, watch=False)
    service = EngineService(engine, max_queue=2)  # its thread not started: nothing admits

    async def submit(running: int, waiting: int) -> bool:
        service.snapshot = replace(service.snapshot, running=running, waiting=waiting)
        try:
            await service.submit(GenerationRequest((5, 6, 7), 2))
        except QueueFullError:
            return False
        while not service.commands.empty():
            service.commands.get_nowait()
        return True

    async def main() -> list[bool]:
        return [await submit(2, 2), await submit(1, 2), await submit(1, 3), await submit(0, 3)]

    assert asyncio.run(main()) == [False, True, False, True]


def test_the_finish_rate_leaves_out_idle_spells(tok_bundle):
    """Requests' ends are kept on the engine's busy clock: a second without requests between
    two of them does not lower the rate a burst's Retry-After is priced at."""
    import time

    from dspark.runtime.server.departures import retry_after

    with LiveServer(tok_bundle, warmup=False) as live:
        def ask() -> None:
            live.client().completions.create(model=MODEL, prompt="hello world", max_tokens=8,
                                             temperature=0)
        ask()
        ask()
        time.sleep(1.5)
        ask()
        ends = list(live.state.service.departures.finished)
    assert len(ends) == 3 and ends[0] < ends[1] < ends[2]
    assert ends[2] - ends[1] < 1.0  # one short request's steps, not the idle 1.5 s
    assert retry_after(ends, 2) < 1.0  # two places at the busy rate: not a second


def test_retry_after_follows_the_finish_rate():
    from dspark.runtime.server.departures import retry_after

    assert retry_after([], 1) == 1 and retry_after([3.0], 5) == 5  # no rate yet: 1/s
    every_half_second = [0.5 * i for i in range(9)]  # 2 requests a second
    assert retry_after(every_half_second, 1) == 0.5
    assert retry_after(every_half_second, 10) == 5
    assert retry_after([0.0, 100.0], 3) == 60  # capped
    assert retry_after([0.001 * i for i in range(9)], 1) == 0.1  # floored


def test_a_wait_follows_the_running_requests_not_the_average_rate():
    """Two requests running, 10 and 100 tokens left, a token 50 ms, a request 6.4 s: one
    place frees in 0.5 s, the second in 5 s (at the average rate of 4 requests a second, it
    was 0.5 s: a retry came back in the gap after the burst and was refused again), the
    third when the first one's successor ends, a whole request later. A slot no request
    holds is the queue's first's, and frees a request later."""
    from dspark.runtime.server.departures import MARGIN, Departures

    departures = Departures()
    assert departures.wait(1, (10, 100), 2) == 1.0  # nothing finished yet: the prior rate
    for i in range(4):  # 4 requests a second; each 129 tokens at 50 ms: 6.4 s
        departures.started(i, 0.25 * i)
        departures.ended(i, 0.25 * i + 6.4, 129)
    assert departures.token_s == pytest.approx(0.05) and departures.request_s == 6.4

    def expect(seconds: float) -> float:
        return seconds * MARGIN + 2 * 0.05

    assert departures.wait(1, (10, 100), 2) == pytest.approx(expect(0.5))
    assert departures.wait(2, (10, 100), 2) == pytest.approx(expect(5.0))
    assert departures.wait(3, (10, 100), 2) == pytest.approx(expect(0.5 + 6.4))
    assert departures.wait(2, (10,), 2) == pytest.approx(expect(6.4))  # a free slot
    assert departures.wait(1, (), 4) == pytest.approx(expect(6.4))  # an idle server's burst
    departures.started(9, 1.0)
    departures.forget(9)  # a cancelled request measures nothing
    assert 9 not in departures.first


def test_overload_is_queued_then_served_or_429(tok_bundle, fixture_pairs, tmp_path):
    """Four times the requests the KV arena can hold at once: with room in the queue all are
    queued and served; with a short queue the rest get 429 with Retry-After, and nothing
    else goes wrong (no 5xx, no stuck request, the arena empty after)."""
    from dspark.compiler.compile import CompileOptions
    from dspark.runtime.bundle.bundle import open_bundle

    from bundle_cache import compiled

    main, draft = fixture_pairs[("llama", "classic")]
    small = compiled(CompileOptions(main, draft, tmp_path / "small.dsmodel",
                                    tokenizer=tok_bundle / "tokenizer", max_seq_len=64,
                                    kv_budget_mb=0.12))
    plan = open_bundle(small).plan
    capacity = plan.num_blocks // (64 // plan.block_size)  # sequences of 64 at once
    assert 1 <= capacity <= 4
    body = {"model": "small", "messages": CHAT, "max_tokens": 40, "temperature": 0}
    for max_queue, allowed in ((64, {200}), (capacity, {200, 429})):
        with LiveServer(small, max_queue=max_queue, warmup=False) as live:
            codes: list[int] = []
            retry: list[str | None] = []

            def send(url=live.url, codes=codes, retry=retry) -> None:
                r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
                codes.append(r.status_code)
                if r.status_code == 429:
                    retry.append(r.headers.get("retry-after"))

            threads = [threading.Thread(target=send) for _ in range(4 * capacity)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert set(codes) <= allowed and codes.count(200) >= capacity, codes
            assert all(r is not None and 1 <= int(r) <= 60 for r in retry), retry
            assert live.wait_idle()
