"""Run on one thread while other processes hold the cores the pool counts on, on every core
otherwise.

Onnxruntime's pool is fixed for the process and every session shares it, so a load that comes
after start cannot shrink it: with another process spinning on one of two cores, the pool's
second thread gets half a core and every parallel section waits for it (a step on the pool
then takes longer than on one thread: docs/performance.md). Each forward asks
the gate below, which judges by what the other processes were seen to take, read from /proc
(host_load.py) at most every `EVERY` seconds. By default (DSPARK_THREADS unset or auto) a solo
forward runs on the pool's session with our ops' work items in turn on the calling thread (the
op library's switch, kernels/cpu_op.py SoloOps): MatMulInt4, the attention, and the norms
and SiLU (row_ops.py; onnxruntime's own woke the pool on every verify, whose threads then spun
against the decodes after it). Onnxruntime's MatMuls keep the pool. Under `adaptive` each CPU
model also has a second session with no pool at all (one thread: the caller's), which solo
forwards take, so onnxruntime's MatMuls leave the pool too, at the cost of per-model pools
and the weights held twice. DSPARK_THREADS=N keeps N threads always. The decision is
measured, not tried: a mode never has to run to be judged, so it does not flip-flop the way
timed trials of both modes did.

Both sessions run the same graph with the same work items, so a forward's logits are the same
bits in either mode (tests/test_load_gate.py checks it), and speculation stays exact across a
switch.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time

from dspark.runtime.host_load import HostLoad

EVERY = 0.25  # seconds between load readings (a /proc read costs ~30 us)
ENTER = 0.5  # cores other work holds beyond cores - 2: above this, forwards go solo
LEAVE = 0.3  # ... and below this they return to the pool
# readings in a row that must agree before a switch: another onnxruntime process's pool
# spins on for a moment after each of its runs, which one reading would take for a load
STREAK = 2


class LoadGate:
    """Whether forwards run solo (one thread) now; hysteresis between ENTER and LEAVE in
    cores other processes hold beyond all but one (on 2 cores: solo above 0.5 of a core
    taken, back to the pool below 0.3)."""

    def __init__(self, cores: int, host: HostLoad | None = None, clock=time.monotonic,
                 every: float = EVERY):
        self.cores, self.host, self.clock, self.every = cores, host or HostLoad(), clock, every
        self.at = float("-inf")
        self.solo = False
        self.streak = 0
        self.switches = 0
        self.other: float | None = None
        self.pin: bool | None = None

    @contextlib.contextmanager
    def pinned(self, solo: bool):
        """Forwards run in `solo`'s mode meanwhile, whatever the load (the warm-up prices
        both modes, model/profile.py); the mode before comes back after."""
        before, self.pin, self.solo = self.solo, solo, solo
        try:
            yield
        finally:
            self.pin, self.solo = None, before

    def check(self) -> bool:
        """The mode for the next forward (reads the load when `every` has passed)."""
        if self.pin is not None:
            return self.pin
        now = self.clock()
        if now - self.at < self.every:
            return self.solo
        self.at = now
        other = self.host.sample()
        if other is None:
            return self.solo
        self.other = other
        taken = other - (self.cores - 2)  # of the cores beyond the last free one
        flip = taken <= LEAVE if self.solo else taken > ENTER
        self.streak = self.streak + 1 if flip else 0
        if self.streak >= STREAK:
            self.solo, self.streak = not self.solo, 0
            self.switches += 1
        return self.solo


@functools.cache
def shared_gate() -> LoadGate:
    """The process's gate (the pool it stands in for is the process's too)."""
    return LoadGate(os.cpu_count() or 1)
