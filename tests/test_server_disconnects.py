"""Clients that go away: streams cut mid-way and abandoned non-streaming requests are
cancelled, and everything they held comes back."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import CHAT, MODEL, LiveServer


@pytest.fixture(scope="module")
def server(tok_bundle):
    with LiveServer(tok_bundle) as live:
        yield live


def _cancelled(server) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "dflash_requests_total" and s.labels.get("status") == "cancelled")


def test_disconnects_cancel_and_free_the_cache(server):
    """16 long streams closed after 2 chunks, and 4 non-streaming requests given up by their
    clients: every one is cancelled (the cancel counter moves by 20), none reaches its
    max_tokens, and every KV block and reservation comes back. Event-driven: the engine
    thread is held once every stream has its first token, until the server has seen every
    disconnect, so no stream can simply finish first."""
    streams, given_up, max_tokens = 16, 4, 50
    service, engine = server.state.service, server.engine
    handles, release = [], threading.Event()
    submit, step = service.submit, engine.step

    async def recording_submit(request, retry=None):
        handle = await submit(request, retry)
        handles.append(handle)
        return handle

    def held_step():
        first = handles[:streams]
        if (not release.is_set() and len(first) == streams
                and all(h.seq is not None and h.seq.generated for h in first)):
            release.wait(60)
        return step()

    body = {"model": MODEL, "messages": CHAT, "max_tokens": max_tokens, "temperature": 0}

    def cut_stream() -> None:
        with httpx.stream("POST", f"{server.url}/v1/chat/completions",
                          json={**body, "stream": True}, timeout=60) as r:
            chunks = 0
            for line in r.iter_lines():
                chunks += line.startswith("data: ")
                if chunks == 2:  # the role chunk and the first token's
                    break

    def give_up() -> None:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=1.0)

    before = _cancelled(server)
    service.submit, engine.step = recording_submit, held_step
    try:
        threads = [threading.Thread(target=cut_stream) for _ in range(streams)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        late = [threading.Thread(target=give_up) for _ in range(given_up)]
        for t in late:
            t.start()
        for t in late:
            t.join()
        deadline = time.monotonic() + 30
        while _cancelled(server) - before < streams + given_up and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        release.set()
        service.submit, engine.step = submit, step
    assert _cancelled(server) - before == streams + given_up
    assert server.wait_idle(), (engine.busy, engine.arena.free_blocks)
    assert len(handles) == streams + given_up
    for h in handles:
        assert h.seq.finish_reason == "cancelled" and len(h.seq.generated) < max_tokens
    assert all(h.seq.generated for h in handles[:streams])
    assert not any(h.seq.generated for h in handles[streams:])
    assert not engine.scheduler.running and not engine.arena.tables


@pytest.mark.slow
def test_disconnect_storm_leaks_nothing(server):
    """200 streams cut at random points (seeded: after 1-8 chunks, some before the first
    byte of the body): the arena empties, no sequence, handle or reservation is left."""
    import random

    rng = random.Random(200)
    cuts = [rng.randint(0, 8) for _ in range(200)]
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 50, "temperature": 0.7,
            "stream": True}

    def cut(after: int) -> None:
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body,
                          timeout=60) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i >= after:
                    break

    threads = [threading.Thread(target=cut, args=(n,)) for n in cuts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    engine = server.engine
    assert server.wait_idle(timeout=60), (engine.busy, engine.arena.free_blocks)
    assert not engine.arena.tables and not engine.scheduler.running
    assert not server.state.service.handles and not engine.drafting.states
