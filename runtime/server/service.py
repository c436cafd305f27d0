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
from dspark.runtime.server.admission import Admission
from dspark.runtime.server.departures import Departures

log = logging.getLogger("dspark.server")
IDLE_WAIT_S = 0.05
IDLE_REFRESH_S = 1.0  # while idle, metrics' rolling windows still move on
LINE_POLL_S = 0.05  # how often a retry in line for its held place looks for it


@dataclass
class Handle:
    """One request's channel from the engine thread back to its HTTP handler: its choices
    (`n` of them: one sequence each), events ("tokens", choice, count, finish) and
    ("error", exception)."""

    requests: list[GenerationRequest]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    seqs: list[Sequence] = field(default_factory=list)
    sent: list[int] = field(default_factory=list)  # tokens already announced, per choice
    admitted: asyncio.Future | None = None  # the engine took it (its Sequences) or refused it

    @property
    def request(self) -> GenerationRequest:
        return self.requests[0]

    @property
    def seq(self) -> Sequence | None:
        return self.seqs[0] if self.seqs else None

    def post(self, event: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # its event loop is closed: nobody is left to read the event
            pass


class EngineService:
    def __init__(self, engine: Engine, max_queue: int = 256,
                 on_step: Callable[[StepReport, EngineGauges, float], None] | None = None,
                 on_cancel: Callable[[int], None] | None = None,
                 say: Callable[[str], None] | None = None, cost_cache: bool = False):
        self.engine = engine
        self.say = say  # where the warm-up's line goes
        self.cost_cache = cost_cache  # the warm-up may read the machine's cost table
        self.max_queue = max_queue
        self.admission = Admission(max_queue)  # used on the event loop only
        self.on_step = on_step
        self.on_cancel = on_cancel
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.handles: dict[int, tuple[Handle, int]] = {}  # sequence id -> handle, choice
        self.ready = threading.Event()
        self.stopping = threading.Event()
        self.snapshot = engine.gauges()  # replaced whole by the engine thread
        # a clock that runs only while the engine steps: the requests' times a 429's
        # Retry-After is priced from are the busy engine's, an idle spell left out
        self.busy_s = 0.0
        self.departures = Departures()
        self.thread = threading.Thread(target=self._loop, name="dspark-engine", daemon=True)

    # -- called from the event loop ---------------------------------------------------
    def start(self, warmup: bool = True) -> None:
        """Start the engine thread; /health turns ready after the warm-up (if any)."""
        if warmup:
            self.commands.put(("call", (self._warmup, None, None)))
        self.commands.put(("call", (lambda e: self.ready.set(), None, None)))
        self.thread.start()

    def _warmup(self, engine: Engine) -> None:
        t0 = time.perf_counter()
        profile = engine.warmup(cached=self.cost_cache)
        how = "read from this machine's last load" if "cached" in profile else "measured"
        if self.say is not None:
            self.say(f"warmed up (the cost table {how}) in {time.perf_counter() - t0:.1f}s; "
                     "ready")

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

    async def submit(self, request: GenerationRequest | list[GenerationRequest],
                     retry: int | None = None) -> Handle:
        """Queue a request (a list: its choices); 429 when the queue is full (`retry`: its
        attempt's retry count, None if the client does not say). A retry that comes back to
        a full queue while a place is held for it waits in line for that place, for as long
        as the hold lasts (admission.py). `await handle.admitted` tells whether the engine
        took it (Engine.submit validates it: a RequestError otherwise)."""
        place = None
        try:
            while short := self.admission.short(self._waiting(), retry, place):
                place = place or self.admission.claim(retry)
                if place is None or self.admission.clock() >= place.end:
                    self._refuse(retry, short)
                await asyncio.sleep(min(LINE_POLL_S, place.end - self.admission.clock()))
            self.admission.admitted(retry, place)
            place = None
        finally:
            if place is not None:  # refused, or its client left while in line
                self.admission.leave(place)
        loop = asyncio.get_running_loop()
        requests = request if isinstance(request, list) else [request]
        handle = Handle(requests, loop, admitted=loop.create_future())
        self.commands.put(("submit", handle))
        return handle

    def _waiting(self) -> int:
        """Requests waiting for a slot. As the last step left it: the request that a slot
        it freed takes at the next step still counts as waiting, and it waits for no one
        (a full KV arena can hold it back: then up to max_batch more than max_queue wait)."""
        snap = self.snapshot
        free = max(0, self.engine.scheduler.max_batch - snap.running)
        return max(0, self.commands.qsize() + snap.waiting - free)

    def _refuse(self, retry: int | None, short: int) -> None:
        held = len(self.admission.holds)
        remaining = self.snapshot.remaining
        wait = self.admission.refuse(retry, short, lambda n: self.departures.wait(
            n, remaining, self.engine.scheduler.max_batch))
        raise QueueFullError(
            f"{self._waiting()} requests are waiting (limit {self.max_queue}"
            + (f", {held} places held for refused requests coming back)" if held else ")"),
            wait)

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
            self.busy_s += time.perf_counter() - t0
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
                arg.seqs = self.engine.submit_group(arg.requests)
            except Exception as e:  # noqa: BLE001 - reported to the handler
                _admit(arg, None, e)
            else:
                arg.sent = [0] * len(arg.seqs)
                for i, seq in enumerate(arg.seqs):
                    self.handles[seq.id] = (arg, i)
                _admit(arg, arg.seqs, None)
            # out of the commands, into the engine's queue: counted in neither until the
            # step's snapshot, such requests let `submit` admit past the queue's limit (37
            # waiting of 32 at 64 clients, and retries told a place had freed found none)
            self.snapshot = self.engine.gauges()
        elif kind == "cancel":
            for seq in arg.seqs:
                if not seq.done:
                    self.engine.cancel(seq)
                self.handles.pop(seq.id, None)
                self.departures.forget(seq.id)
                if self.on_cancel is not None:
                    self.on_cancel(seq.id)
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
            handle, choice = self.handles.get(seq.id, (None, 0))
            if handle is None:
                continue
            if seq.error is not None:
                log.error("request %d failed", seq.id, exc_info=seq.error)
                handle.post(("error", seq.error))
            elif len(seq.generated) > handle.sent[choice] or seq.done:
                if not handle.sent[choice]:
                    self.departures.started(seq.id, self.busy_s)
                handle.sent[choice] = len(seq.generated)
                handle.post(("tokens", choice, handle.sent[choice], seq.finish_reason))
            if seq.done:
                self.handles.pop(seq.id, None)
                self.departures.ended(seq.id, self.busy_s, len(seq.generated))

    def _fail_all(self, error: Exception) -> None:
        failed = {id(h): h for h, _ in self.handles.values()}
        for handle in failed.values():
            for seq in handle.seqs:
                if not seq.done:
                    self.engine.cancel(seq)
            handle.post(("error", error))
        self.handles.clear()
        self.departures.first.clear()


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
