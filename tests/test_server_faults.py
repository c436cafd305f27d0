"""Faults: a failure inside one request ends that request alone (a 500 with an id, or an
error event in its stream); the others finish as they would have, and the server keeps
serving. A format the bundle's tokenizer cannot serve is the client's 400."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from server_helpers import CHAT, MODEL, LiveServer


@pytest.fixture(scope="module")
def server(tok_bundle):
    with LiveServer(tok_bundle) as live:
        yield live


def test_a_fault_in_one_request_spares_the_others(server):
    engine = server.engine
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 30, "temperature": 0}
    url = f"{server.url}/v1/chat/completions"
    want = httpx.post(url, json=body, timeout=30).json()["choices"][0]["message"]["content"]
    advance = engine._advance

    def faulty(slot, rows, seconds):
        if slot.seq.tenant == "faulty" and len(slot.seq.generated) >= 3:
            raise RuntimeError("injected fault")
        return advance(slot, rows, seconds)

    results: dict[str, object] = {}

    def normal(i: int) -> None:
        r = httpx.post(url, json=body, timeout=30)
        results[f"normal{i}"] = r.json()["choices"][0]["message"]["content"]

    def failing() -> None:
        results["faulty"] = httpx.post(url, json=body, headers={"X-Tenant-ID": "faulty"},
                                       timeout=30)

    def failing_stream() -> None:
        with httpx.stream("POST", url, json={**body, "stream": True},
                          headers={"X-Tenant-ID": "faulty"}, timeout=30) as r:
            results["stream"] = [line for line in r.iter_lines() if line.startswith("data: ")]

    engine._advance = faulty
    try:
        threads = [threading.Thread(target=normal, args=(i,)) for i in range(4)]
        threads += [threading.Thread(target=failing), threading.Thread(target=failing_stream)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        engine._advance = advance
    assert [results[f"normal{i}"] for i in range(4)] == [want] * 4
    r = results["faulty"]
    assert r.status_code == 500
    error = r.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "internal_error"
    assert "err-" in error["message"]
    lines = results["stream"]
    assert lines[-1] == "data: [DONE]" and "err-" in json.loads(lines[-2][6:])["error"]["message"]
    assert server.wait_idle()
    again = httpx.post(url, json=body, timeout=30).json()["choices"][0]["message"]["content"]
    assert again == want  # still serving


def test_a_tokenizer_no_grammar_can_drive_is_a_400(server):
    """The tok bundle's word-level tokenizer (no decoder) cannot drive a grammar: JSON mode
    is a 400 naming response_format, not a 500."""
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": CHAT, "max_tokens": 8,
        "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    assert server.wait_idle()
