"""Who takes a free queue place: a refused request that comes back goes before a new one.

Under a steady overload a place frees whenever a running request finishes, and the client
whose request finished sends its next one at once; a client refused with a 429 is still
waiting out its Retry-After. Counted alone, the free places go to whoever asks first, so the
same clients lose every time (in one 60 s run at 64 clients, 2 had no request served). So
each 429 holds a place for the request it refused: until that request is back, or its hold
runs out, a new request does not take it.

A retry is known by the header the OpenAI SDKs send with every attempt,
`x-stainless-retry-count`: 0 on a call's first, n on its n-th retry. A request without it
is counted as before: each attempt new, and nothing held for it (its return could not be
told from a new request, and a hold it never claims would only turn others away).

A retry that comes back on time can still find the queue full: its wait is an estimate of
when places free (departures.py), and a place frees only when a running request ends. In
four minutes at 64 clients on the fp32 sample, 59 retries came back 0.03-0.18 s after they
were due, to a queue whose places had not freed yet, and 18 calls failed after the SDK's
two retries. So such a retry takes its hold into a line (`claim`) and waits there, its
connection open, until a place frees or the hold would have run out; first back, first in.
The same run after: 5 first retries refused again (of ~600), no call failed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

RETRY_HEADER = "x-stainless-retry-count"
HOLD_GRACE_S = 2.0  # a hold outlives its Retry-After by this much (the SDKs wait it exactly)


def retry_count(value: str | None) -> int | None:
    """The header's count (None: absent or not a count, a client that cannot be told)."""
    if value is None or not value.strip().isdigit():
        return None
    return int(value)


@dataclass(eq=False)
class Place:
    """A retry in line for the place held for it, until `end` (its hold's end)."""

    end: float


class Admission:
    """The queue's limit, the places held for refused requests (each hold's (due, end): when
    its request was told to come back and when the hold runs out) and the line of retries
    back to a full queue, waiting for theirs."""

    def __init__(self, max_queue: int, clock: Callable[[], float] = time.monotonic):
        self.max_queue = max_queue
        self.clock = clock
        self.holds: list[tuple[float, float]] = []
        self.line: list[Place] = []

    def short(self, waiting: int, retry: int | None, place: Place | None = None) -> int:
        """How many places the queue lacks for this request (0: admit it). A retry in line
        goes after those back before it; one just back, after the whole line; a new request
        also after the held places: the holds are a line ahead of it."""
        now = self.clock()
        self.holds = [h for h in self.holds if h[1] > now]
        if place is not None:
            taken = waiting + self.line.index(place)
        else:
            taken = waiting + len(self.line) + (0 if retry else len(self.holds))
        return max(0, taken - self.max_queue + 1)

    def claim(self, retry: int | None) -> Place | None:
        """A retry back to a full queue takes the first hold into the line, and waits there
        until that hold would have run out (None: nothing is held, or not a retry)."""
        if not retry or not self.holds:
            return None
        hold = min(self.holds)
        self.holds.remove(hold)
        self.line.append(Place(hold[1]))
        return self.line[-1]

    def leave(self, place: Place) -> None:
        if place in self.line:
            self.line.remove(place)

    def admitted(self, retry: int | None, place: Place | None = None) -> None:
        if place is not None:  # it waited in line: its hold was taken then
            self.leave(place)
        elif retry and self.holds:  # the place held for it: the line's first
            self.holds.remove(min(self.holds))

    def refuse(self, retry: int | None, short: int, wait_for: Callable[[int], float]) -> float:
        """The seconds a request refused `short` places short is told to wait
        (`wait_for(places)`: until that many places free up); a place is held for it. A
        retry refused again (its old hold given up in line, or run out) goes after the
        refused requests due back before it would be: they wait for the same places."""
        now = self.clock()
        if retry:
            short += sum(due <= now + wait_for(short) for due, _ in self.holds)
        wait = wait_for(short)
        if retry is not None and len(self.holds) < self.max_queue:
            self.holds.append((now + wait, now + wait + HOLD_GRACE_S))
        return wait
