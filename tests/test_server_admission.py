"""Admission under overload: a request refused with a 429 has its place held until it comes
back (known by the OpenAI SDKs' x-stainless-retry-count header), so the clients that come
straight back do not take every free place; a retry back to a still-full queue waits in
line for its place; without the header nothing is held."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
from server_helpers import MODEL, LiveServer, queued_behind_gate

from dspark.runtime.server import admission
from dspark.runtime.server.admission import Admission, retry_count


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_header_is_read_as_a_count_or_not_at_all():
    assert [retry_count(v) for v in ("0", "2", " 1 ")] == [0, 2, 1]
    assert [retry_count(v) for v in (None, "", "-1", "1.5", "two")] == [None] * 5


def one_place_a_second(places: int) -> float:
    return float(places)


def test_a_refused_request_is_held_a_place_that_only_its_retry_takes():
    gate = Admission(max_queue=2, clock=Clock())
    assert gate.short(waiting=2, retry=0) == 1  # full: refused
    assert gate.refuse(0, 1, one_place_a_second) == 1.0
    assert gate.short(waiting=1, retry=0) == 1  # a place freed, but it is held
    assert gate.short(waiting=1, retry=None) == 1  # for a client without the header too
    assert gate.short(waiting=1, retry=1) == 0  # the retry takes it
    gate.admitted(1)
    assert gate.holds == [] and gate.short(waiting=1, retry=0) == 0


def test_a_new_request_waits_behind_the_held_places():
    gate = Admission(max_queue=4, clock=Clock())
    for _ in range(3):
        gate.refuse(0, gate.short(waiting=4, retry=0), one_place_a_second)
    assert [round(due - 100) for due, _ in gate.holds] == [1, 2, 3]


def test_nothing_is_held_for_a_client_that_cannot_be_told_again():
    gate = Admission(max_queue=1, clock=Clock())
    assert gate.refuse(None, 1, one_place_a_second) == 1.0
    assert gate.holds == [] and gate.short(waiting=0, retry=None) == 0


def test_a_retry_back_to_a_full_queue_waits_in_line_for_its_held_place():
    """Two refused, due back in 1 and 2 s. The first is back on time to a queue still full:
    it takes the first hold into the line, until that hold's end. A new request still
    counts both (one held, one in line); the second retry, back, goes after the first."""
    clock = Clock()
    gate = Admission(max_queue=4, clock=clock)
    for _ in range(2):
        gate.refuse(0, gate.short(waiting=4, retry=0), one_place_a_second)
    clock.now += 1.0
    assert gate.short(waiting=4, retry=1) == 1
    first = gate.claim(1)
    assert first.end == 101.0 + admission.HOLD_GRACE_S and len(gate.holds) == 1
    assert gate.short(waiting=3, retry=0) == 2  # a place freed: the line's, then the hold's
    clock.now += 1.0
    second = gate.claim(2)
    assert gate.short(waiting=3, retry=2, place=second) == 1  # behind the first
    assert gate.short(waiting=3, retry=1, place=first) == 0  # the first takes it
    gate.admitted(1, first)
    assert gate.line == [second] and gate.short(waiting=3, retry=2, place=second) == 0
    gate.leave(second)
    assert gate.line == [] and gate.holds == []
    assert gate.claim(0) is None and gate.claim(1) is None  # nothing held: refused outright


def test_a_retry_refused_again_goes_after_those_due_back_before_it():
    """Three refused, due back in 1, 2 and 3 s; the first is back at 1 s and finds no place
    before its hold runs out (the places freed more slowly than the rate said): it waits
    for the place it lacks and for those due back before that, not one place's time."""
    clock = Clock()
    gate = Admission(max_queue=4, clock=clock)
    for _ in range(3):
        gate.refuse(0, gate.short(waiting=4, retry=0), one_place_a_second)
    clock.now += 1.0
    place = gate.claim(1)
    clock.now = place.end
    assert gate.short(waiting=4, retry=1, place=place) == 1
    # due back by then: the two others (at 2 and 3 s)
    assert gate.refuse(1, 1, one_place_a_second) == 3.0
    gate.leave(place)
    assert len(gate.holds) == 3 and gate.line == []  # renewed, not doubled


def test_a_hold_that_is_never_claimed_runs_out():
    clock = Clock()
    gate = Admission(max_queue=1, clock=clock)
    gate.refuse(0, 1, one_place_a_second)
    assert gate.short(waiting=0, retry=0) == 1
    clock.now += 1.0 + admission.HOLD_GRACE_S + 0.01
    assert gate.short(waiting=0, retry=0) == 0 and gate.holds == []


def test_holds_never_outnumber_the_queue():
    gate = Admission(max_queue=3, clock=Clock())
    for _ in range(10):
        gate.refuse(0, 1, one_place_a_second)
    assert len(gate.holds) == 3


def test_a_refused_sdk_call_comes_back_ahead_of_a_new_one(tok_bundle, monkeypatch):
    """A live server, the official client: with the queue full, C's call is refused and a
    place held for it; once the queue has emptied, a new call (D) is still refused, naming
    the hold, C's retry is served, and after it new calls are too."""
    monkeypatch.setattr(admission, "HOLD_GRACE_S", 60.0)  # no hold runs out mid-test
    with LiveServer(tok_bundle, max_batch=1, max_queue=1, warmup=False) as live:
        client, done = live.client(), []

        def ask() -> None:
            r = client.completions.create(model=MODEL, prompt="hello world", max_tokens=4,
                                          temperature=0)
            done.append(r.usage.completion_tokens)

        gate, queued = queued_behind_gate(live, ask, 2)  # the slot and the queue
        with pytest.raises(openai.RateLimitError) as c_refused:
            ask()
        assert float(c_refused.value.response.headers["retry-after-ms"]) > 0
        gate.set()
        for t in queued:
            t.join()
        assert done == [4, 4] and live.wait_idle()

        with pytest.raises(openai.RateLimitError, match="held for refused requests"):
            ask()  # D: the queue is empty, but its one place is C's
        r = client.completions.create(model=MODEL, prompt="hello world", max_tokens=4,
                                      temperature=0,
                                      extra_headers={admission.RETRY_HEADER: "1"})
        assert r.usage.completion_tokens == 4  # C, back
        ask()
        assert done == [4, 4, 4]


def test_a_retry_back_before_its_place_frees_is_served_not_refused(tok_bundle, monkeypatch):
    """A live server, the official client: C's call is refused with the queue full; its
    retry comes back while the queue is still full, waits in line with its connection open,
    and is served once the queue moves. A new call meanwhile is refused."""
    monkeypatch.setattr(admission, "HOLD_GRACE_S", 60.0)
    with LiveServer(tok_bundle, max_batch=1, max_queue=1, warmup=False) as live:
        client, service, done = live.client(), live.state.service, []

        def ask(retry: str | None = None) -> None:
            headers = {admission.RETRY_HEADER: retry} if retry else None
            r = client.completions.create(model=MODEL, prompt="hello world", max_tokens=4,
                                          temperature=0, extra_headers=headers)
            done.append(r.usage.completion_tokens)

        gate, queued = queued_behind_gate(live, ask, 2)
        with pytest.raises(openai.RateLimitError):
            ask()  # C
        back = threading.Thread(target=ask, args=("1",))
        back.start()
        deadline = time.monotonic() + 30
        while not service.admission.line and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(service.admission.line) == 1 and service.admission.holds == []
        with pytest.raises(openai.RateLimitError):
            ask()  # a new call: the queue's place is C's
        gate.set()
        for t in (*queued, back):
            t.join()
        assert done == [4, 4, 4] and service.admission.line == []


def test_without_the_header_a_freed_place_goes_to_whoever_asks(tok_bundle):
    """Clients that do not say they are retrying are served as they come: a 429 holds
    nothing, and the next request after the queue empties is served."""
    with LiveServer(tok_bundle, max_batch=1, max_queue=1, warmup=False) as live:
        body = {"model": MODEL, "prompt": "hello world", "max_tokens": 4, "temperature": 0}
        results: list[int] = []

        def post() -> None:
            results.append(httpx.post(f"{live.url}/v1/completions", json=body,
                                      timeout=30).status_code)

        gate, queued = queued_behind_gate(live, post, 2)
        post()
        gate.set()
        for t in queued:
            t.join()
        assert sorted(results) == [200, 200, 429] and live.state.service.admission.holds == []
        post()
        assert results[-1] == 200


def test_a_retry_in_line_is_refused_when_its_hold_ends_and_leaves_it_if_cancelled(tok_bundle):
    """The service's side, its engine thread not started (the queue stays full): a retry in
    line waits no longer than its hold, then gets a 429 and a new hold; one whose client
    goes while it waits leaves the line."""
    import asyncio
    from dataclasses import replace

    from dspark.runtime.engine.loader import load_engine
    from dspark.runtime.errors import QueueFullError
    from dspark.runtime.sequence.request import GenerationRequest
    from dspark.runtime.server.service import EngineService

    engine, _ = load_engine(tok_bundle, max_batch=1, warmup=False, watch=False)
    service, clock = EngineService(engine, max_queue=1), Clock()
    service.admission = Admission(max_queue=1, clock=clock)
    service.snapshot = replace(service.snapshot, running=1, waiting=1)
    request = GenerationRequest((5, 6, 7), 2)

    async def in_line(retry: int) -> asyncio.Task:
        task = asyncio.create_task(service.submit(request, retry))
        await asyncio.sleep(0.2)
        assert len(service.admission.line) == 1 and not task.done()
        return task

    async def main() -> None:
        with pytest.raises(QueueFullError):
            await service.submit(request, 0)
        (due, end), = service.admission.holds
        clock.now = due
        task = await in_line(1)
        clock.now = end
        with pytest.raises(QueueFullError):
            await asyncio.wait_for(task, 5)
        assert service.admission.line == [] and len(service.admission.holds) == 1
        clock.now = service.admission.holds[0][0]
        task = await in_line(2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert service.admission.line == [] and service.admission.holds == []
        assert service.commands.empty()

    asyncio.run(main())
