"""RAS, the resource-aware scheduler: device probe, a table of starting points, and elastic
degradation under memory pressure.

At start the device is probed (GPU name and memory through torch, else the CPU model, cores
and RAM); the KV arena's default size comes from the memory available then (`kv_budget`),
and the first matching row of the config's table gives the starting window (DWC
scales its rules to it), the window cap (twice the start, at most the config's max) and the
preferred draft. While KV arena use stays above `degrade_usage` for `degrade_after_s`, it
degrades: the smallest draft in the bundle, the window cap lowered to
`degraded_max_window`, no delta log. When use stays below the threshold (with 10% of
hysteresis) for as long, it recovers. Requests continue through every switch.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass

from dspark.runtime.bundle.config import ResourceConfig, ResourceRow

HYSTERESIS = 0.10
KV_SEQUENCES = 2  # worst-case sequences per max_batch slot the default arena holds
WARMUP_SEQUENCES = 10  # the warm-up's probe sequences (model/profile.py), each up to one


@dataclass(frozen=True)
class Device:
    kind: str  # "cuda" or "cpu"
    name: str
    memory_gb: float
    cores: int


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _ram_gb() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return 0.0


def probe_device(device=None) -> Device:
    """What `device` (a torch.device; default: the first GPU if any, else the CPU) is."""
    import torch

    if device is None and torch.cuda.is_available():
        device = torch.device("cuda", 0)
    if device is not None and device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return Device("cuda", props.name, props.total_memory / 2**30,
                      props.multi_processor_count)
    return Device("cpu", _cpu_name(), _ram_gb(), os.cpu_count() or 1)


def available_bytes(device=None) -> int:
    """Memory free for the KV arena now: a GPU's free memory, else the kernel's
    MemAvailable (RAM not counting reclaimable caches); 0 where unknown."""
    import torch

    if device is not None and device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def kv_budget(config: ResourceConfig, per_seq: int, max_batch: int, available: int) -> int:
    """The KV arena's bytes where no flag sets them: twice `max_batch` sequences of
    `per_seq` bytes (full length; the second half keeps cached prefixes), at least the
    warm-up's probes, within `kv_memory_fraction` of `available`, and never less than one
    sequence."""
    want = max(KV_SEQUENCES * max_batch, WARMUP_SEQUENCES) * per_seq
    if available > 0:
        want = min(want, int(config.kv_memory_fraction * available))
    return max(per_seq, want)


def match_row(config: ResourceConfig, device: Device) -> ResourceRow:
    for row in config.table:
        is_cpu_row = row.match == "cpu"
        if is_cpu_row and device.kind == "cpu":
            return row
        if not is_cpu_row and device.kind == "cuda" and row.match.lower() in device.name.lower():
            return row
    return ResourceRow("default", 4)


class ResourceManager:
    def __init__(self, config: ResourceConfig, device: Device, drafts: dict[str, int]):
        """drafts: the bundle's draft roles with their weight bytes."""
        self.config = config
        self.device = device
        self.row = match_row(config, device)
        self.draft_models = drafts
        self.preferred = self.row.draft if self.row.draft in drafts else "draft"
        self.smallest = min(drafts, key=lambda r: (drafts[r], r)) if drafts else None
        self.degraded = False
        self.since: float | None = None  # when use crossed the threshold (either way)
        self.switches = 0

    def configure(self, config) -> None:
        self.config = config.resources

    @property
    def window_cap(self) -> int:
        cap = 2 * self.row.window
        return min(cap, self.config.degraded_max_window) if self.degraded else cap

    @property
    def draft(self) -> str | None:
        """The draft model sequences use by default (None: the bundle has none)."""
        if not self.draft_models:
            return None
        return self.smallest if self.degraded else self.preferred

    def tick(self, now: float, usage: float) -> bool:
        """Feed the arena use (0..1); True when the mode just changed."""
        limit = self.config.degrade_usage
        pressed = usage > limit if not self.degraded else usage > limit - HYSTERESIS
        if pressed == self.degraded:  # the current mode is right: nothing pending
            self.since = None
            return False
        self.since = now if self.since is None else self.since
        if now - self.since < self.config.degrade_after_s:
            return False
        self.degraded, self.since = pressed, None
        self.switches += 1
        return True
