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
"""

from __future__ import annotations

import time
from collections.abc import Callable

RETRY_HEADER = "x-stainless-retry-count"
HOLD_GRACE_S = 2.0  # a hold outlives its Retry-After by this much (the SDKs wait it exactly)


def retry_count(value: str | None) -> int | None:
    """The header's count (None: absent or not a count, a client that cannot be told)."""
    if value is None or not value.strip().isdigit():
        return None
    return int(value)


class Admission:
    """The queue's limit and the places held for refused requests: each hold's (due, end),
    when its request was told to come back and when the hold runs out."""

    def __init__(self, max_queue: int, clock: Callable[[], float] = time.monotonic):
        self.max_queue = max_queue
        self.clock = clock
        self.holds: list[tuple[float, float]] = []

    def short(self, waiting: int, retry: int | None) -> int:
        """How many places the queue lacks for this request (0: admit it). A retry may take
        a held place; a new request may not: the holds are a line ahead of it."""
        now = self.clock()
        self.holds = [h for h in self.holds if h[1] > now]
        taken = waiting if retry else waiting + len(self.holds)
        return max(0, taken - self.max_queue + 1)

    def admitted(self, retry: int | None) -> None:
        if retry and self.holds:  # the place held for it: the line's first
            self.holds.remove(min(self.holds))

    def refuse(self, retry: int | None, short: int, wait_for: Callable[[int], float]) -> float:
        """The seconds a request refused `short` places short is told to wait
        (`wait_for(places)`: until that many places free up); a place is held for it. A
        retry refused again gives up its old hold, and goes after the refused requests due
        back before it would be: they wait for the same places."""
        now = self.clock()
        if retry and self.holds:
            self.holds.remove(min(self.holds))
            short += sum(due <= now + wait_for(short) for due, _ in self.holds)
        wait = wait_for(short)
        if retry is not None and len(self.holds) < self.max_queue:
            self.holds.append((now + wait, now + wait + HOLD_GRACE_S))
        return wait
