"""An engine's warm-up: every model profiled at the forward sizes its rounds use, filling the
cost table the policies read (model/profile.py), or that table read back from this machine's
last load of the bundle (model/cost_cache.py)."""

from __future__ import annotations

import logging
import os

from dspark.runtime.env import read_env
from dspark.runtime.host_load import HostLoad, thread_hint
from dspark.runtime.model import cost_cache
from dspark.runtime.model.profile import warmup as profile_models

log = logging.getLogger("dspark.runtime")
MAIN_SIZES = (*range(1, 10), 16, 32, 64)  # every verify of a window up to 8 drafts, prompts
DRAFT_SIZES = (1, 2, 3, 4, 8, 16)


def warm_up(engine, main_sizes=MAIN_SIZES, draft_sizes=DRAFT_SIZES,
            cached: bool = False) -> dict:
    """Profile `engine`'s models (the table keeps every verify size apart, costs.py).
    `cached`: read the table this machine measured for the bundle before, if any (each
    session still runs its first, allocating forwards, unmeasured), else measure it and keep
    it for the next load."""
    path = cost_cache.cache_path(engine.bundle, engine.arena.device.type) if cached else None
    if path is not None and path.exists():
        profile = _profile(engine, (1,), (1,), measure=False)
        if cost_cache.load(path, engine.costs):
            return {**profile, "cached": str(path)}
    profile = _profile(engine, main_sizes, draft_sizes)
    if path is not None:
        cost_cache.save(path, engine.costs)
    return profile


def _profile(engine, main_sizes, draft_sizes, measure: bool = True) -> dict:
    """Seconds, main ms per size, and the cores other processes kept busy meanwhile (with a
    warning when the thread count ignores them)."""
    limit = engine.plan.max_seq_len
    load = HostLoad()
    load.sample()
    gate = getattr(engine.main.model, "gate", None)
    profile = profile_models(
        engine.arena, engine.costs,
        {"main": [engine.main], "draft": list(engine.draft_models.values())},
        {"main": [t for t in main_sizes if t < limit],
         "draft": [t for t in draft_sizes if t < limit]},
        solo=gate.pinned if gate is not None else None, measure=measure)
    other = load.sample()
    env = read_env()  # adaptive threads follow the load themselves: no hint
    hint = (thread_hint(other, env.threads, os.cpu_count() or 1)
            if engine.arena.device.type == "cpu" and not env.adaptive else None)
    if hint is not None:
        log.warning(hint)
    return {**profile, "other_cores": other}
