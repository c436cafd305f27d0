"""Fixture builds on every core: an export traces Python on one thread, so the suite's
fixture families are built side by side instead of one after another (CI has two cores).

    in_processes(jobs)   fn(*args) per job, each in a spawned process (torch exports)

Exporters run as programs (optimum's, genai's builder) build all their models in one process
instead (arch_fixtures, model_fixtures): their imports cost more than a tiny model's export.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor


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
