"""The warm-up's cost table, kept per machine: measured once for a bundle on this CPU, read
back at the next load instead of being measured again (the warm-up is ~60 forwards: 3.8 s of
the sample's 8 s load, 27 s of a 1.1B fp32 main's 42).

A table is filed under a key of everything it depends on: the bundle's manifest (its models
and flags), the CPU's model and flags (device.cpu_line), the intra-op threads, the device,
and dspark's version. Read back, it is only a starting point: every forward updates the
table as it runs (costs.py), so traffic keeps measuring it. A table older than MAX_AGE_S is
still read back (the load does not wait for a warm-up), and written again once REFRESH
forwards have measured it anew: remeasured in the background, by the traffic itself. Files
live in DSPARK_CACHE/costs (default build/costs), written to a temp name and renamed.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from dspark.runtime.bundle.bundle import MANIFEST_FILE, Bundle
from dspark.runtime.env import read_env
from dspark.runtime.model.costs import CostModel
from dspark.runtime.model.device import cpu_line
from dspark.runtime.version import __version__

MAX_AGE_S = 7 * 24 * 3600
REFRESH = 200  # forwards a stale table runs before it is written back


def cache_path(bundle: Bundle, device: str) -> Path:
    env = read_env()
    key = hashlib.sha256(json.dumps({
        "manifest": hashlib.sha256(bundle.path(MANIFEST_FILE).read_bytes()).hexdigest(),
        "cpu": cpu_line(), "threads": env.threads, "device": device,
        "version": __version__}, sort_keys=True).encode()).hexdigest()[:20]
    return Path(env.cache_dir) / "costs" / f"{key}.json"


def load(path: Path, costs: CostModel) -> bool:
    """Fill `costs` from the table at `path`; False (untouched) if none or unreadable. A
    stale table fills it too, and is saved again after REFRESH forwards refined it."""
    try:
        stale = time.time() - path.stat().st_mtime > MAX_AGE_S
        costs.restore(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if stale:
        costs.after(REFRESH, lambda table: save(path, table))
    return True


def save(path: Path, costs: CostModel) -> None:
    """Write the table (best effort: an unwritable cache only costs the next load a warm-up)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(costs.snapshot()))
        tmp.replace(path)
    except OSError:
        tmp.unlink(missing_ok=True)
