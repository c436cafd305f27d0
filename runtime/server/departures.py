"""When queue places free up: the wait a 429 tells the client (Retry-After).

A queue place frees when a running request finishes and the queue's first takes its slot.
Priced at the average rate requests finish, a wait was wrong in both directions: a batch's
requests, admitted together, finish in bursts, so a retry told "one place: 0.4 s" came back
in the gap after a burst and was refused again. At 64 clients on the fp32 sample, 29-34%
of the first retries that came back on time and two thirds of second ones were refused, and
7-9% of calls failed after the OpenAI SDK's two retries.

So the wait follows the running requests themselves: the engine publishes the tokens each
still has to generate (`EngineGauges.remaining`, fewest first), and the service measures a
token's time per sequence and a whole request's time on the engine's busy clock, from the
requests that finished. The k-th place frees when the k-th running request finishes; past
the n running, when the request that took the (k - n)-th one's slot finishes, a whole
request later; a free place to run in is the queue's first's at the next step, and frees a
whole request later (a burst at an idle server: everything it admitted ends together). A
retry that comes back a little late finds its place held (admission.py); one that comes
back early waits in line for it, its connection open, at most its hold's grace, and is then
refused again, so the wait leans late by MARGIN: at 1.1 the first batch's end, its 16
prompts fed in its first steps, came 0.5 s after the 5.7 s told. Until a
request has finished the average rate decides (`retry_after`).
"""

from __future__ import annotations

from collections import deque

FINISHED_WINDOW = 64  # recent finishes the average rate is taken over
MIN_RETRY_AFTER_S, MAX_RETRY_AFTER_S = 0.1, 60.0
PRIOR_FINISH_RATE = 1.0  # requests a second, until two have finished
SMOOTHING = 0.2
MARGIN = 1.2  # a wait's share over its estimate, plus two tokens' time


class Departures:
    """Recorded by the engine thread (on its busy clock), read by the event loop."""

    def __init__(self):
        self.finished: deque[float] = deque(maxlen=FINISHED_WINDOW)  # when requests ended
        self.first: dict[int, float] = {}  # sequence id -> when its first token came
        self.token_s: float | None = None  # one sequence's seconds a token, EWMA
        self.request_s: float | None = None  # a request's seconds, first token to end, EWMA

    def started(self, seq_id: int, now: float) -> None:
        self.first.setdefault(seq_id, now)

    def ended(self, seq_id: int, now: float, tokens: int) -> None:
        self.finished.append(now)
        first = self.first.pop(seq_id, None)
        if first is None or tokens < 2 or now <= first:
            return
        token, request = (now - first) / (tokens - 1), now - first
        self.token_s = _ewma(self.token_s, token)
        self.request_s = _ewma(self.request_s, request)

    def forget(self, seq_id: int) -> None:
        self.first.pop(seq_id, None)

    def wait(self, places: int, remaining: tuple[int, ...], slots: int) -> float:
        """Seconds until `places` queue places free up, the running requests having
        `remaining` tokens to generate (fewest first) and the engine `slots` places to run
        requests in: those no request holds now are the queue's first ones' at the next
        step, each freed a whole request later."""
        if self.token_s is None or self.request_s is None or places < 1:
            return retry_after(self.finished, places)
        ends = sorted([r * self.token_s for r in remaining[:slots]]
                      + [self.request_s] * max(0, slots - len(remaining)))
        laps, k = divmod(places - 1, len(ends))
        return _clamp((ends[k] + laps * self.request_s) * MARGIN + 2 * self.token_s)


def retry_after(finished: deque[float] | list[float], places: int) -> float:
    """A 429's wait at the average rate requests have been finishing (`finished`: their end
    times on the engine's busy clock, oldest first: requests that finished before an idle
    spell do not stretch the span the rate is measured over, as wall time would when a burst
    arrives at an idle server). Before two have, one request a second: a first burst's
    refused requests come back spread out, in line."""
    rate = PRIOR_FINISH_RATE
    if len(finished) >= 2 and finished[-1] > finished[0]:
        rate = (len(finished) - 1) / (finished[-1] - finished[0])
    return _clamp(places / rate)


def _clamp(seconds: float) -> float:
    return max(MIN_RETRY_AFTER_S, min(MAX_RETRY_AFTER_S, seconds))


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else old + SMOOTHING * (new - old)
