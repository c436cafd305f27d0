"""Admission under overload: a request refused with a 429 has its place held until it comes
back (known by the OpenAI SDKs' x-stainless-retry-count header), so the clients that come
straight back do not take every free place; without the header nothing is held."""

from __future__ import annotations

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


def test_a_retry_refused_again_goes_after_those_due_back_before_it():
    """Three refused, due back in 1, 2 and 3 s; the first is back at 1 s and finds no place
    yet (the places freed more slowly than the rate said): it gives up its hold and waits
    for the place it lacks and for the two due back before that, not one place's time."""
    clock = Clock()
    gate = Admission(max_queue=4, clock=clock)
    for _ in range(3):
        gate.refuse(0, gate.short(waiting=4, retry=0), one_place_a_second)
    clock.now += 1.0
    assert gate.short(waiting=4, retry=1) == 1
    assert gate.refuse(1, 1, one_place_a_second) == 2.0  # its place, and the one due at 2 s
    assert len(gate.holds) == 3  # renewed, not doubled


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
