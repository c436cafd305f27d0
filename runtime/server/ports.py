"""A port for a local server that a script starts (the tests, the benchmarks, the load-test
sample), picked where nothing else will take it first.

A port the kernel hands out for port 0 comes from its ephemeral range, and so do the ports
Ray's own processes bind while a cluster starts (and Ray's fixed defaults, such as its
dashboard agent's 52365, lie there too): a script that picks one, closes it and passes it on
can lose it to Ray, or to any outgoing connection, before its server binds. These ports come
from below the ephemeral range and above Ray's worker ports (10002-19999)."""

from __future__ import annotations

import random
import socket
from pathlib import Path

_FIRST = 20000


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port on 127.0.0.1 that is free now and outside the ephemeral range."""
    last = _ephemeral_start() - 1
    for _ in range(200):
        port = random.randint(_FIRST, last) if last > _FIRST else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError(f"no free port in {_FIRST}-{last}")
