"""How many cores other processes keep busy on this machine (Linux /proc).

Onnxruntime's pool has a thread per core by default, fixed for the process. With another
process busy on one of two cores, a step waits for the thread that shares that core: every
bundle decoded faster at one thread than at two (docs/performance.md). The pool
cannot follow a load that comes and goes, so the engine reports what it sees: a warning when
its warm-up ran beside such a load, and the `dspar_host_other_cores` gauge.
`DSPARK_THREADS=auto` (env.py) sizes the pool at start to the cores other work leaves free;
`DSPARK_THREADS=adaptive` follows the load as it comes and goes (model/load_gate.py).

Other processes' share = (all CPUs' busy time, steal included: a hypervisor's other guests)
- (this process's own CPU time), over the wall time between two samples.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

PROC = Path("/proc")
BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system irq softirq steal (after "cpu")
BUSY_ENOUGH = 0.5  # cores other work holds before a fewer-threads hint is given
MIN_SPAN = 0.2  # seconds: /proc counts in ticks (10 ms), a shorter span reads as noise


class HostLoad:
    def __init__(self, proc: Path = PROC, clock=time.monotonic):
        self.proc = proc
        self.clock = clock
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.last: tuple[float, float, float] | None = None

    def _read(self) -> tuple[float, float, float] | None:
        """(wall seconds, all CPUs' busy seconds, this process's CPU seconds)."""
        try:
            cpu = (self.proc / "stat").read_text().split("\n", 1)[0].split()
            mine = (self.proc / "self" / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return None
        if not cpu or cpu[0] != "cpu":
            return None
        try:
            busy = sum(int(cpu[1 + i]) for i in BUSY_FIELDS if 1 + i < len(cpu))
            own = int(mine[11]) + int(mine[12])  # utime, stime (fields 14 and 15)
        except (ValueError, IndexError):
            return None
        return self.clock(), busy / self.tick, own / self.tick

    def sample(self) -> float | None:
        """Cores other processes kept busy since the previous sample (None on the first,
        within MIN_SPAN of it, or without /proc)."""
        now, last = self._read(), self.last
        if now is not None and last is not None and now[0] - last[0] < MIN_SPAN:
            return None  # keep the earlier sample until the span can be measured
        self.last = now
        if now is None or last is None:
            return None
        other = (now[1] - last[1]) - (now[2] - last[2])
        return max(0.0, other / (now[0] - last[0]))


def free_cores(other: float | None, cores: int) -> int:
    """The cores other work leaves free (all of them when the load is unknown)."""
    return cores if other is None else max(1, cores - round(other))


def thread_hint(other: float | None, threads: int, cores: int) -> str | None:
    """A warning when other work held cores the pool's threads count on, else None."""
    if other is None or other < BUSY_ENOUGH:
        return None
    free = free_cores(other, cores)
    if threads <= free:
        return None
    return (f"other processes kept {other:.1f} of {cores} cores busy during the warm-up; "
            f"with such a load DSPARK_THREADS={free} (the cores they leave free) decodes "
            f"faster than {threads} threads; DSPARK_THREADS=auto measures this at start, "
            "DSPARK_THREADS=adaptive follows it (docs/performance.md)")
