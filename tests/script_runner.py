"""Run a repository script as a user does, `python <folder>/<script>.py`: its own folder first
on sys.path, so its siblings import (the tests' PYTHONSAFEPATH, conftest.py, is for the
`python -m` children, whose working directory is the root)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_script(script: str, *args, env: dict[str, str] | None = None,
               **kwargs) -> subprocess.CompletedProcess:
    """`script`: its path from the root (e.g. "bench/peer_setup.py"); `env`: variables set on
    top of this process's (the others as they are, PYTHONSAFEPATH dropped)."""
    full = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"} | (env or {})
    return subprocess.run([sys.executable, str(ROOT / script), *map(str, args)], env=full,
                          **kwargs)
