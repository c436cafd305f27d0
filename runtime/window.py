"""Window policies: how many tokens to draft for a sequence this round.

A policy sees only statistics (the sequence's SeqStats and its lengths), never the executor.
Policies are looked up by name; an unknown name lists the known ones.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from dspark.runtime.errors import DSparkError
from dspark.runtime.request import SeqStats


class WindowPolicy(Protocol):
    def window(self, stats: SeqStats, prompt_len: int, generated: int) -> int: ...


class FixedWindow:
    def __init__(self, window: int = 4):
        if window < 1:
            raise DSparkError(f"window must be >= 1, got {window}")
        self.size = window

    def window(self, stats: SeqStats, prompt_len: int, generated: int) -> int:
        return self.size


POLICIES: dict[str, Callable[..., WindowPolicy]] = {"fixed": FixedWindow}


def make_policy(name: str, **kwargs) -> WindowPolicy:
    if name not in POLICIES:
        raise DSparkError(f"unknown window policy {name!r} (known: {', '.join(sorted(POLICIES))})")
    return POLICIES[name](**kwargs)
