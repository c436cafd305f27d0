"""Hot reload of dflash_config.json: on change (mtime, polled between steps) and on SIGHUP.

A new file is validated in full before anything changes; the engine swaps it in between two
steps. An invalid file (bad JSON, unknown field, value out of range) keeps the running config,
logs the field path and the problem, and counts an error.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path
from typing import Protocol

from dspark.runtime.bundle.config import ConfigError, DFlashConfig, load_config

log = logging.getLogger("dspark.reload")
POLL_S = 0.25


class ConfigSource(Protocol):
    """Where an engine takes new configs from between steps (Engine.watch)."""

    reloads: dict[str, int]  # by result: ok, error

    def poll(self) -> DFlashConfig | None: ...


class ConfigWatcher:
    def __init__(self, path: Path, config: DFlashConfig):
        self.path = Path(path)
        self.config = config
        self.stamp = self._stamp()
        self.requested = False
        self.last_poll = 0.0
        self.reloads = {"ok": 0, "error": 0}
        self.last_error: str | None = None
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGHUP, self._on_sighup)

    def _on_sighup(self, *_) -> None:
        self.requested = True

    def _stamp(self) -> tuple[int, int] | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size)

    def poll(self, force: bool = False) -> DFlashConfig | None:
        """A newly validated config if the file changed (or SIGHUP came), else None."""
        now = time.perf_counter()
        if not (force or self.requested) and now - self.last_poll < POLL_S:
            return None
        self.last_poll = now
        stamp = self._stamp()
        if not (force or self.requested) and stamp == self.stamp:
            return None
        self.requested, self.stamp = False, stamp
        try:
            config = load_config(self.path)
        except ConfigError as e:
            self.reloads["error"] += 1
            self.last_error = str(e)
            log.error("config reload rejected, keeping the running config: %s", e)
            return None
        self.reloads["ok"] += 1
        self.last_error = None
        if config == self.config:
            return None
        self.config = config
        log.info("config reloaded from %s", self.path)
        return config


class ConfigInbox:
    """Configs pushed from outside instead of a watched file: dsrun cluster validates a
    changed dflash_config.json once and broadcasts it to every replica (Ray Serve's
    user_config); the engine applies the latest between steps, as it would a file's."""

    def __init__(self, config: DFlashConfig):
        self.config = config
        self.pending: DFlashConfig | None = None
        self.lock = threading.Lock()
        self.reloads = {"ok": 0, "error": 0}
        self.last_error: str | None = None

    def push(self, config: DFlashConfig) -> None:
        """Any thread."""
        with self.lock:
            self.pending = config

    def poll(self, force: bool = False) -> DFlashConfig | None:
        with self.lock:
            config, self.pending = self.pending, None
        if config is None:
            return None
        self.reloads["ok"] += 1
        if config == self.config:
            return None
        self.config = config
        log.info("config pushed by the cluster applied")
        return config
