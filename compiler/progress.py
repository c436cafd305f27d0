"""Per-stage progress on stderr, with the timings kept for --json."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager


class Progress:
    def __init__(self, quiet: bool = False):
        self.quiet = quiet
        self.timings: dict[str, float] = {}

    def say(self, message: str) -> None:
        if not self.quiet:
            print(f"[dsc] {message}", file=sys.stderr, flush=True)

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        self.say(f"{name} ...")
        t0 = time.perf_counter()
        yield
        self.timings[name] = round(time.perf_counter() - t0, 3)
        self.say(f"{name} done in {self.timings[name]:.1f}s")
