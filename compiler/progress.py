"""Per-stage progress on stderr, with the timings kept for --json; `tick` for the steps of a
long loop (at most one line every TICK_S seconds). `--quiet` silences it."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from dspark.compiler.release import release

TICK_S = 2.0


class Progress:
    def __init__(self, quiet: bool = False, prefix: str = "dsc"):
        self.quiet, self.prefix = quiet, prefix
        self.timings: dict[str, float] = {}
        self.last = time.perf_counter()

    def say(self, message: str) -> None:
        self.last = time.perf_counter()
        if not self.quiet:
            print(f"[{self.prefix}] {message}", file=sys.stderr, flush=True)

    def tick(self, message: str) -> None:
        """A loop's step: said when TICK_S seconds have passed since the last line."""
        if time.perf_counter() - self.last >= TICK_S:
            self.say(message)

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        self.say(f"{name} ...")
        t0 = time.perf_counter()
        yield
        release()  # what the stage freed goes back to the system (release.py)
        self.timings[name] = round(time.perf_counter() - t0, 3)
        self.say(f"{name} done in {self.timings[name]:.1f}s")
