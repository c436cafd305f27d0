"""The commit a benchmark measured (`git describe --always --dirty`), for its report."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def revision() -> str | None:
    """The checkout's commit, '-dirty' when it has uncommitted changes; None outside git."""
    try:
        done = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None
