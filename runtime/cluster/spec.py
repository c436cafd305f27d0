"""What a cluster deployment is: one frozen, validated spec, built from `dsrun cluster`'s
flags or from a Ray Serve config's `args` (KubeRay's serveConfigV2), so both paths refuse the
same mistakes with the same messages."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from dspark.runtime.errors import DSparkError

SHIPPED = "."  # the bundle travelled as the replicas' runtime_env working_dir


class ClusterSpecError(DSparkError):
    pass


@dataclass(frozen=True)
class ClusterSpec:
    model: str  # bundle path as the replicas see it (a shared filesystem), or SHIPPED
    name: str = ""  # the model id clients send (default: the bundle's name)
    replicas: int = 1
    autoscale: tuple[int, int] | None = None  # (min, max) replicas instead of a fixed count
    cpus_per_replica: float = 1.0  # also the size of each engine's onnxruntime thread pool
    gpus_per_replica: float = 0.0
    max_batch: int = 16
    max_queue: int = 256  # requests waiting per replica before 429s
    max_ongoing: int = 0  # requests a replica holds at once (0: 2 x max_batch)
    ingress_replicas: int = 1
    imbalance: int = 8  # queue gap at which tenant affinity yields to the least loaded
    api_key: str | None = None
    policy: str | None = None
    device: str = "auto"
    warmup: bool = True
    max_body_bytes: int = 8 * 2**20
    dflash_config: dict | None = field(default=None, compare=False)  # pushed, hot

    def __post_init__(self) -> None:
        _need(bool(self.model), "model", "a bundle path is required")
        _need(self.replicas >= 1, "replicas", f"must be >= 1, got {self.replicas}")
        if self.autoscale is not None:
            lo, hi = self.autoscale
            _need(0 <= lo <= hi and hi >= 1, "autoscale",
                  f"MIN:MAX with 0 <= MIN <= MAX and MAX >= 1, got {lo}:{hi}")
        _need(self.cpus_per_replica > 0, "cpus_per_replica",
              f"must be > 0, got {self.cpus_per_replica}")
        _need(self.gpus_per_replica >= 0, "gpus_per_replica",
              f"must be >= 0, got {self.gpus_per_replica}")
        for name in ("max_batch", "max_queue", "ingress_replicas"):
            _need(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        _need(self.max_ongoing >= 0, "max_ongoing", f"must be >= 0, got {self.max_ongoing}")
        _need(self.imbalance >= 0, "imbalance", f"must be >= 0, got {self.imbalance}")
        _need(self.device in ("auto", "cpu", "cuda"), "device",
              f"one of auto, cpu, cuda, got {self.device!r}")

    @property
    def ongoing(self) -> int:
        return self.max_ongoing or 2 * self.max_batch

    @property
    def threads(self) -> int:
        return max(1, int(self.cpus_per_replica))

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> ClusterSpec:
        """A Ray Serve application's `args` (JSON/YAML values) -> a spec; unknown keys and
        wrong types are errors naming the key."""
        known = {f.name: f for f in dataclasses.fields(cls)}
        if unknown := sorted(set(args) - set(known)):
            raise ClusterSpecError(f"args: unknown key(s) {', '.join(unknown)} (known: "
                                   f"{', '.join(sorted(known))})")
        values = dict(args)
        if isinstance(values.get("autoscale"), str):
            values["autoscale"] = parse_autoscale(values["autoscale"])
        elif isinstance(values.get("autoscale"), list):
            values["autoscale"] = tuple(values["autoscale"])
        for key, value in values.items():
            _check_type(key, value, known[key].type)
        return cls(**values)


def parse_autoscale(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return int(lo), int(hi)
    except ValueError:
        raise ClusterSpecError(f"autoscale: MIN:MAX expected (e.g. 1:4), got {text!r}") from None


_TYPES = {"str": str, "int": int, "float": (int, float), "bool": bool, "dict": dict}


def _check_type(key: str, value: Any, annotation: str) -> None:
    if value is None and "None" in annotation:
        return
    base = annotation.split(" | ")[0].split("[")[0]
    expected = _TYPES.get(base)
    if base == "tuple":
        ok = isinstance(value, tuple) and len(value) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value)
    else:
        ok = expected is None or (isinstance(value, expected) and not (
            base in ("int", "float") and isinstance(value, bool)))
    if not ok:
        raise ClusterSpecError(f"args.{key}: expected {annotation}, got {value!r}")


def _need(ok: bool, key: str, why: str) -> None:
    if not ok:
        raise ClusterSpecError(f"{key}: {why}")
