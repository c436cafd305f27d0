"""SIGTERM drains: `dsrun serve` as users run it (a process), a long stream in flight. After
the signal /health and new requests get 503, the stream runs to its end, and the process
exits on its own well within the drain timeout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx

from dspark.runtime.server.ports import free_port


def test_sigterm_finishes_requests_in_flight_and_refuses_new_ones(json_bundle):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    dsrun = os.path.join(os.path.dirname(sys.executable), "dsrun")
    proc = subprocess.Popen([dsrun, "serve", "--model", str(json_bundle), "--port", str(port),
                             "--no-warmup", "--drain-timeout", "60"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": [5, 6, 7], "max_tokens": 1020, "temperature": 0,
                "stream": True, "speculative_decoding": False}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            # asked at once (a tiny model streams its 1020 tokens in about a second): the
            # stream had not finished when the signal came, so no completion counted ok yet
            while httpx.get(f"{url}/health").json() != {"status": "draining"}:
                time.sleep(0.005)
            metrics = httpx.get(f"{url}/metrics").text
            assert not any(line.startswith("dflash_requests_total") and
                           'endpoint="completions"' in line and 'status="ok"' in line
                           and not line.endswith(" 0.0") for line in metrics.splitlines())
            refused = httpx.post(f"{url}/v1/completions", json={**body, "stream": False})
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "shutting_down"
            assert refused.headers["retry-after"] == "1"
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        last = json.loads(rest[-2][6:])["choices"][0]
        assert last["finish_reason"] == "length"  # all 1020 tokens, not cut
        text = json.loads(first[6:])["choices"][0]["text"] + "".join(
            json.loads(line[6:])["choices"][0]["text"] for line in rest[:-1])
        assert text
        proc.wait(timeout=30)  # exits on its own once drained
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode in (0, -signal.SIGTERM, 128 + signal.SIGTERM), proc.stderr.read()
