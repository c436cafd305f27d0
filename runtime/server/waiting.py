"""An HTTP handler waiting on its request's Handle, polling whether the client is still there:
a client that leaves (or a handler that is cancelled: dsrun cluster's relay when its client
goes, a forced shutdown) cancels the request in the engine."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from fastapi import Request

from dspark.runtime.sequence.request import Sequence
from dspark.runtime.server import errors
from dspark.runtime.server.service import EngineService, Handle

DISCONNECT_POLL_S = 0.5


async def polled(service: EngineService, handle: Handle, request: Request,
                 wait: Callable[[], Awaitable]) -> tuple[bool, object]:
    """(True, what wait() gave), or (False, None) once the client left first."""
    while True:
        try:
            return True, await asyncio.wait_for(wait(), DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                service.cancel(handle)
                return False, None
        except asyncio.CancelledError:
            service.cancel(handle)
            raise


async def admitted(service: EngineService, handle: Handle, request: Request) -> bool:
    """The engine's door answered: True (Engine.submit validated it; a RequestError raises
    here), False (the client left first)."""
    ok, _ = await polled(service, handle, request, lambda: asyncio.shield(handle.admitted))
    return ok


async def finished(service: EngineService, handle: Handle, request: Request
                   ) -> list[Sequence] | None:
    """The finished sequences, one per choice; None: the client left first."""
    left = set(range(len(handle.seqs)))
    while True:
        ok, event = await polled(service, handle, request, handle.events.get)
        if not ok:
            return None
        if event[0] == "error":
            raise errors.server_error(event[1])
        if event[3] is not None:
            left.discard(event[1])
            if not left:
                return handle.seqs
