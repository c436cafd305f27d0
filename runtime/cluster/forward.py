"""An HTTP request carried from the ingress to an engine replica, and the replica's side:
run it through the replica's own FastAPI app (the one `dsrun serve` runs) and stream the
response back as a Head then body chunks.

    ingress: Forwarded(method, path, headers, body, route_key) --Serve handle, stream-->
    replica: serve_forwarded(app, fwd) -> Head(status, headers), bytes, bytes, ...

A cancelled stream (the client went away at the ingress) reads as `http.disconnect` to the
app, which cancels the generation and frees its KV blocks, as it does behind uvicorn.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

REPLICA_HEADER = b"x-dspark-replica"  # which replica served a response
APP_EXIT_WAIT_S = 2.0  # after a disconnect, how long the handler may take to clean up
_DONE = object()


@dataclass(frozen=True)
class Forwarded:
    method: str
    path: str
    query: bytes
    headers: tuple[tuple[bytes, bytes], ...]  # lower-case names, as ASGI has them
    body: bytes
    route_key: str | None = None  # read by router.TenantAffinityRouter


@dataclass(frozen=True)
class Head:
    status: int
    headers: tuple[tuple[bytes, bytes], ...]

    @property
    def streaming(self) -> bool:
        return any(k == b"content-type" and v.startswith(b"text/event-stream")
                   for k, v in self.headers)


def asgi_scope(fwd: Forwarded) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1", "method": fwd.method, "scheme": "http",
            "path": fwd.path, "raw_path": fwd.path.encode(), "query_string": fwd.query,
            "root_path": "", "headers": list(fwd.headers), "client": None,
            "server": None, "state": {}}


async def serve_forwarded(app, fwd: Forwarded, replica: str = "") -> AsyncIterator:
    """Run one request through an ASGI app: yields a Head, then body chunks (bytes)."""
    sent: asyncio.Queue = asyncio.Queue()
    disconnected = asyncio.Event()
    body_given = False

    async def receive() -> dict:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": fwd.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def run() -> None:
        try:
            await app(asgi_scope(fwd), receive, sent.put)
        finally:
            sent.put_nowait(_DONE)

    task, complete = asyncio.create_task(run()), False
    try:
        while (message := await sent.get()) is not _DONE:
            if message["type"] == "http.response.start":
                headers = tuple(message.get("headers") or ())
                yield Head(message["status"], (*headers, (REPLICA_HEADER, replica.encode())))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    complete = True
                    break
        if not complete and task.done() and task.exception() is not None:
            raise task.exception()  # the app failed before it answered (it reports the rest)
    finally:
        disconnected.set()
        if not task.done():  # the client went away: stop the handler, let it clean up
            task.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(task), APP_EXIT_WAIT_S)
