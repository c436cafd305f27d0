"""The engine in its own thread; requests reach it through a queue, tokens come back to the
event loop through each request's asyncio queue. Nothing here blocks the event loop.

    HTTP handler --submit()--> commands --engine thread: engine.submit(), engine.step()
                 <--await handle.admitted-- the engine's door: validated, or a RequestError
                 <--await handle.events.get()-- tokens (call_soon_threadsafe)

A request is validated once, by Engine.submit on the engine thread; the handler awaits that
answer (`admitted`) before it answers the client, so a bad request is still a 400.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from dspark.runtime.engine.engine import Engine
from dspark.runtime.engine.snapshot import EngineGauges, StepReport
from dspark.runtime.errors import QueueFullError
from dspark.runtime.sequence.request import GenerationRequest, Sequence

log = logging.getLogger("dspark.server")
IDLE_WAIT_S = 0.05
IDLE_REFRESH_S = 1.0  # while idle, metrics' rolling windows still move on


@dataclass
class Handle:
    """One request's channel from the engine thread back to its HTTP handler."""

    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    seq: Sequence | None = None
    sent: int = 0  # tokens already announced
    admitted: asyncio.Future | None = None  # the engine took it (its Sequence) or refused it

    def post(self, event: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # its event loop is closed: nobody is left to read the event
            pass


class EngineService:
    def __init__(self, engine: Engine, max_queue: int = 256,
                 on_step: Callable[[StepReport, EngineGauges, float], None] | None = None,
                 on_cancel: Callable[[int], None] | None = None):
        self.engine = engine
        self.max_queue = max_queue
        self.on_step = on_step
        self.on_cancel = on_cancel
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.handles: dict[int, Handle] = {}
        self.ready = threading.Event()
        self.stopping = threading.Event()
        self.snapshot = engine.gauges()  # replaced whole by the engine thread
        self.thread = threading.Thread(target=self._loop, name="dspark-engine", daemon=True)

    # -- called from the event loop ---------------------------------------------------
    def start(self, warmup: bool = True) -> None:
        """Start the engine thread; /health turns ready after the warm-up (if any)."""
        if warmup:
            self.commands.put(("call", (lambda e: e.warmup(), None, None)))
        self.commands.put(("call", (lambda e: self.ready.set(), None, None)))
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=10)
        while True:  # requests the engine never saw are refused, not left waiting
            try:
                kind, arg = self.commands.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                _admit(arg, None, RuntimeError("the engine stopped before taking the request"))

    def submit(self, request: GenerationRequest) -> Handle:
        """Queue a request; 429 when the queue is full. `await handle.admitted` tells whether
        the engine took it (Engine.submit validates it: a RequestError otherwise)."""
        waiting = self.commands.qsize() + self.snapshot.waiting
        if waiting >= self.max_queue:
            raise QueueFullError(f"{waiting} requests are waiting (limit {self.max_queue})")
        loop = asyncio.get_running_loop()
        handle = Handle(request, loop, admitted=loop.create_future())
        self.commands.put(("submit", handle))
        return handle

    def cancel(self, handle: Handle) -> None:
        self.commands.put(("cancel", handle))

    def call(self, fn: Callable[[Engine], object]) -> asyncio.Future:
        """Run fn(engine) in the engine thread between steps; a future of its result."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.commands.put(("call", (fn, future, loop)))
        return future

    # -- the engine thread ------------------------------------------------------------
    def _loop(self) -> None:
        last = time.perf_counter()
        while not self.stopping.is_set():
            self._drain(block=not self.engine.busy)
            if not self.engine.busy:
                self.engine.maintain()
                self.snapshot = self.engine.gauges()
                if self.on_step is not None and time.perf_counter() - last > IDLE_REFRESH_S:
                    self.on_step(StepReport(), self.snapshot, 0.0)
                    last = time.perf_counter()
                continue
            t0 = time.perf_counter()
            try:
                report = self.engine.step()
            except Exception as e:  # noqa: BLE001 - fail the requests, keep serving
                log.exception("engine step failed")
                self._fail_all(e)
                continue
            self.snapshot = self.engine.gauges()
            self._notify(report.advanced)
            if self.on_step is not None:
                self.on_step(report, self.snapshot, time.perf_counter() - t0)
                last = time.perf_counter()

    def _drain(self, block: bool) -> None:
        try:
            command = (self.commands.get(timeout=IDLE_WAIT_S) if block
                       else self.commands.get_nowait())
        except queue.Empty:
            return
        while True:
            self._run(*command)
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return

    def _run(self, kind: str, arg) -> None:
        if kind == "submit":
            try:
                arg.seq = self.engine.submit(arg.request)
                self.handles[arg.seq.id] = arg
            except Exception as e:  # noqa: BLE001 - reported to the handler
                _admit(arg, None, e)
            else:
                _admit(arg, arg.seq, None)
        elif kind == "cancel":
            if arg.seq is not None and not arg.seq.done:
                self.engine.cancel(arg.seq)
            if arg.seq is not None:
                self.handles.pop(arg.seq.id, None)
                if self.on_cancel is not None:
                    self.on_cancel(arg.seq.id)
        elif kind == "call":
            fn, future, loop = arg
            try:
                result, error = fn(self.engine), None
            except Exception as e:  # noqa: BLE001 - handed to the caller
                result, error = None, e
            if future is not None:
                loop.call_soon_threadsafe(_settle, future, result, error)

    def _notify(self, advanced: tuple[Sequence, ...]) -> None:
        for seq in advanced:
            handle = self.handles.get(seq.id)
            if handle is None:
                continue
            if seq.error is not None:
                log.error("request %d failed", seq.id, exc_info=seq.error)
                handle.post(("error", seq.error))
            elif len(seq.generated) > handle.sent or seq.done:
                handle.sent = len(seq.generated)
                handle.post(("tokens", handle.sent, seq.finish_reason))
            if seq.done:
                self.handles.pop(seq.id, None)

    def _fail_all(self, error: Exception) -> None:
        for handle in list(self.handles.values()):
            if handle.seq is not None:
                self.engine.cancel(handle.seq)
            handle.post(("error", error))
        self.handles.clear()


def _admit(handle: Handle, seq: Sequence | None, error: Exception | None) -> None:
    try:
        handle.loop.call_soon_threadsafe(_settle, handle.admitted, seq, error)
    except RuntimeError:  # its event loop is closed: nobody is left to read the answer
        pass


def _settle(future: asyncio.Future, result, error) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
