"""Build and run the server: bundle -> engine -> service -> FastAPI app -> uvicorn."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from dspark.runtime.bundle.config import DFlashConfig
from dspark.runtime.engine.loader import KVOptions, load_engine
from dspark.runtime.env import read_env
from dspark.runtime.server.app import create_app
from dspark.runtime.server.metrics import Metrics
from dspark.runtime.server.service import EngineService
from dspark.runtime.server.state import ServerState


def model_id(bundle: Path) -> str:
    name = bundle.resolve().name
    return name.removesuffix(".dsmodel") or name


def build_app(model: Path, api_key: str | None = None, max_batch: int = 16,
              max_queue: int = 256, warmup: bool = True,
              config: Path | DFlashConfig | None = None,
              policy: str | None = None, name: str | None = None, device: str = "auto",
              max_body_bytes: int = 8 * 2**20, replica: str | None = None,
              watch: bool = True, kv: KVOptions | None = None,
              say: Callable[[str], None] | None = None, cost_cache: bool = False):
    """`say`: where the load's progress lines go (the warm-up's too, run by the engine
    thread once the server listens); `cost_cache`: the warm-up reads this machine's cost
    table for the bundle when it has one (model/cost_cache.py; dsrun serve does)."""
    engine, tokenizer = load_engine(model, max_batch=max_batch, policy=policy, config=config,
                                    warmup=False, device=device, watch=watch, kv=kv, say=say)
    served = name or model_id(model)
    metrics = Metrics(served, engine.resources.device.name, replica)
    service = EngineService(engine, max_queue, on_step=metrics.on_step,
                            on_cancel=metrics.forget, say=say, cost_cache=cost_cache)
    state = ServerState(service, tokenizer, served, metrics,
                        api_key or read_env().api_key, int(time.time()), max_body_bytes,
                        engine.grammars)
    return create_app(state, warmup), state


def serve(model: Path, host: str, port: int, drain_s: float = 30.0, **kwargs) -> None:
    import uvicorn

    app, state = build_app(model, cost_cache=True, **kwargs)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning",
                            timeout_graceful_shutdown=max(1, int(drain_s)))
    draining_server(uvicorn.Server, state, drain_s)(config).run()


def draining_server(base, state: ServerState, drain_s: float):
    """uvicorn's Server with a graceful drain: the first SIGTERM/SIGINT turns new generation
    requests into 503s (and /health into 503 "draining", so balancers stop routing), lets
    the requests in flight finish for up to `drain_s` seconds, then shuts down as uvicorn
    does; a second signal skips the wait."""

    class DrainingServer(base):
        def handle_exit(self, sig, frame) -> None:
            if state.draining:
                return super().handle_exit(sig, frame)
            state.draining = True
            threading.Thread(target=self._drain, args=(sig, frame), name="dspark-drain",
                             daemon=True).start()

        def _drain(self, sig, frame) -> None:
            service, deadline = state.service, time.monotonic() + drain_s
            while time.monotonic() < deadline and (service.commands.qsize() or
                                                    service.snapshot.waiting or
                                                    service.snapshot.running):
                time.sleep(0.05)
            super().handle_exit(sig, frame)

    return DrainingServer
