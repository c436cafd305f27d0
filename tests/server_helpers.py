"""A real uvicorn server on 127.0.0.1 and a random port, in a thread of the test process."""

from __future__ import annotations

import threading
import time

import httpx
import uvicorn

from dspark.runtime.server.ports import free_port
from dspark.runtime.server.run import build_app

MODEL = "tok"  # the tok bundles' served name
CHAT = [{"role": "user", "content": "hello world w5 w9"}]


def api_error(call):
    """The openai client's error raised by `call` (a 4xx or 5xx answer)."""
    import openai
    import pytest

    with pytest.raises(openai.APIStatusError) as info:
        call()
    return info.value


def queued_behind_gate(live, call, n: int) -> tuple[threading.Event, list[threading.Thread]]:
    """Hold the engine thread in a call until the returned gate is set, and start `n`
    threads running `call`; returns once all `n` requests wait in the service's queue."""
    service, gate = live.state.service, threading.Event()
    service.commands.put(("call", (lambda e: gate.wait(30), None, None)))
    threads = [threading.Thread(target=call) for _ in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while service.commands.qsize() < n and time.monotonic() < deadline:
        time.sleep(0.01)
    return gate, threads


class LiveServer:
    def __init__(self, bundle, **kwargs):
        self.app, self.state = build_app(bundle, **kwargs)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def engine(self):
        return self.state.service.engine

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError("server did not become ready")

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)

    def client(self, api_key: str = "none"):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0)

    def wait_idle(self, timeout: float = 15) -> bool:
        """True once no sequence runs and every KV block is free again."""
        deadline = time.monotonic() + timeout
        engine = self.engine
        while time.monotonic() < deadline:
            if not engine.busy and engine.arena.free_blocks == engine.plan.num_blocks:
                return True
            time.sleep(0.05)
        return False
