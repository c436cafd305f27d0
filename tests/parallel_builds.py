"""Fixture builds on every core: an export traces Python on one thread, so the suite's
fixture families are built side by side instead of one after another (CI has two cores).

    in_processes(jobs)   fn(*args) per job, each in a spawned process (torch exports)
    in_threads(commands) subprocess.run per command, checked (exporters run as programs)
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor


def _workers(jobs: int) -> int:
    return max(1, min(jobs, os.cpu_count() or 1))


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)  # one job per core: a pool per job would fight the others


def in_processes(jobs: Sequence[tuple[Callable, tuple]]) -> list:
    """Each job's fn(*args) (fn at a module's top level), in order; a single job runs here."""
    if len(jobs) <= 1:
        return [fn(*args) for fn, args in jobs]
    with ProcessPoolExecutor(_workers(len(jobs)), mp_context=multiprocessing.get_context(
            "spawn"), initializer=_one_thread) as pool:
        futures = [pool.submit(fn, *args) for fn, args in jobs]
        return [f.result() for f in futures]


def in_threads(commands: Sequence[list]) -> None:
    """Run every command (raising CalledProcessError, with its output, for a failed one)."""
    with ThreadPoolExecutor(_workers(len(commands))) as pool:
        for future in [pool.submit(subprocess.run, [str(c) for c in cmd], check=True,
                                   capture_output=True) for cmd in commands]:
            future.result()
