"""Thread safety: the event loop reads only the engine's published snapshots, so hammering
/metrics, /health, /v1/cache/resize and config reloads (valid and invalid) while 16 clients
stream changes nothing a client sees: every stream equals its reference, and nothing
answers with a 5xx."""

from __future__ import annotations

import json
import threading
import time

import httpx
from server_helpers import MODEL, LiveServer


def test_admin_traffic_while_streams_run(tok_bundle, tmp_path):
    config = json.loads((tok_bundle / "dflash_config.json").read_text())
    path = tmp_path / "dflash_config.json"
    path.write_text(json.dumps(config))
    prompts = [f"hello world w{i % 9} w{i}" for i in range(16)]
    with LiveServer(tok_bundle, config=path, warmup=False) as live:
        client = live.client()

        def complete(prompt: str, stream: bool):
            out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40,
                                            temperature=0, stream=stream)
            return "".join(c.choices[0].text for c in out if c.choices) if stream else (
                out.choices[0].text)

        want = [complete(p, False) for p in prompts]  # references, one at a time
        got: dict[int, str] = {}
        errors: list[Exception] = []

        def stream(i: int) -> None:
            try:  # three in a row, so the admin traffic below overlaps them for a while
                runs = {complete(prompts[i], True) for _ in range(3)}
                got[i] = runs.pop() if len(runs) == 1 else f"differs: {runs}"
            except Exception as e:  # noqa: BLE001 - collected and asserted below
                errors.append(e)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        statuses, n, t0 = [], 0, time.monotonic()
        while any(t.is_alive() for t in threads):
            n = int((time.monotonic() - t0) / 0.4)  # a new config every 0.4 s (polled 0.25)
            statuses.append(httpx.get(f"{live.url}/metrics").status_code)
            statuses.append(httpx.get(f"{live.url}/health").status_code)
            statuses.append(httpx.post(f"{live.url}/v1/cache/resize",
                                       json={"max_length": 64}, timeout=60).status_code)
            # a valid change (the window cap) and, every third time, an invalid config
            config["window"]["max_window"] = 6 if n % 2 else 8
            path.write_text("{not json" if n % 3 == 0 else json.dumps(config))
        for t in threads:
            t.join()
        path.write_text(json.dumps(config))
        assert not errors and [got[i] for i in range(16)] == want
        assert statuses and all(s < 500 for s in statuses), statuses
        assert set(statuses) <= {200, 409}
        assert live.wait_idle()
        assert httpx.get(f"{live.url}/health").status_code == 200
        deadline = time.monotonic() + 10  # the last, valid write: polled every 0.25 s
        while (reloads := dict(live.state.service.snapshot.reloads))["ok"] < 1 and (
                time.monotonic() < deadline):
            time.sleep(0.05)
        assert reloads["ok"] >= 1 and reloads["error"] >= 1, reloads
