"""One engine replica of a Ray Serve deployment: the same bundle -> engine -> FastAPI app
that `dsrun serve` runs, reached through `handle()` instead of a socket.

Config: replicas do not watch files. A dflash_config validated once arrives either from the
ClusterBoard (`dsrun cluster` publishes the changed file) or as Ray Serve's user_config (a
Serve config file, KubeRay's serveConfigV2); either is applied between steps (ConfigInbox).
Metrics: rendered with a `replica` label, reported to the ClusterBoard every second.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

from ray import serve

from dspark.runtime.bundle.config import config_from_dict
from dspark.runtime.cluster.board import PUSH_S, board_handle
from dspark.runtime.cluster.forward import Forwarded, serve_forwarded
from dspark.runtime.cluster.spec import SHIPPED, ClusterSpec
from dspark.runtime.dflash.reload import ConfigInbox
from dspark.runtime.server.run import build_app

log = logging.getLogger("dspark.cluster")
READY_WAIT_S = 900.0


class EngineReplica:
    async def __init__(self, spec: ClusterSpec) -> None:
        context = serve.get_replica_context()
        self.replica = context.replica_id.unique_id
        bundle = Path.cwd() if spec.model == SHIPPED else Path(spec.model)
        config = (config_from_dict(spec.dflash_config) if spec.dflash_config is not None
                  else None)
        self.app, self.state = await asyncio.to_thread(
            build_app, bundle, api_key=spec.api_key, max_batch=spec.max_batch,
            max_queue=spec.max_queue, warmup=spec.warmup, config=config, policy=spec.policy,
            name=spec.name or None, device=spec.device, max_body_bytes=spec.max_body_bytes,
            replica=self.replica, watch=False)
        engine = self.state.service.engine
        self.inbox = engine.watch(ConfigInbox(engine.config))
        self.board, self.seen = board_handle(context.app_name), 0
        self.state.service.start(spec.warmup)
        if not await asyncio.to_thread(self.state.service.ready.wait, READY_WAIT_S):
            raise RuntimeError(f"replica {self.replica}: engine not ready after {READY_WAIT_S} s")
        self.reporter = asyncio.get_running_loop().create_task(self._report())
        log.info("replica %s serving %s", self.replica, bundle)

    async def handle(self, fwd: Forwarded):
        async for part in serve_forwarded(self.app, fwd, self.replica):
            yield part

    def reconfigure(self, user_config: dict) -> None:
        """Ray Serve calls this on every replica when the deployment's user_config changes
        (and once after __init__)."""
        if (data := (user_config or {}).get("dflash_config")) is not None:
            self.inbox.push(config_from_dict(data))

    async def check_health(self) -> None:
        if not self.state.service.thread.is_alive():
            raise RuntimeError(f"replica {self.replica}: the engine thread stopped")

    async def _report(self) -> None:
        while True:
            with contextlib.suppress(Exception):  # a board restart must not stop serving
                news = await self.board.report.remote(
                    self.replica, self.state.metrics.render().decode(), self.seen)
                if news is not None:
                    self.seen, data = news
                    self.inbox.push(config_from_dict(data))
            await asyncio.sleep(PUSH_S)

    async def __del__(self) -> None:
        self.reporter.cancel()
        with contextlib.suppress(Exception):
            await self.board.forget.remote(self.replica)
        await asyncio.to_thread(self.state.service.stop)
