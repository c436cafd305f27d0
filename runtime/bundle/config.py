"""dflash_config.json: the DFlash scheduler's parameters, the bundle's one mutable file.

Frozen dataclasses with their defaults (docs/drafting.md); `load_config` validates a
file strictly: an unknown field, a wrong type or a value out of range names its JSON path.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path

from dspark.runtime.errors import DSparkError

CONFIG_FILE = "dflash_config.json"
CONFIG_SCHEMA_FILE = "dflash_config.schema.json"
WINDOW_POLICIES = ("dflash", "fixed", "goodput")
DRAFT_METHODS = ("hybrid", "lookup", "draft")
METHOD_CHOICES = ("auto", *DRAFT_METHODS)


class ConfigError(DSparkError):
    """dflash_config.json is not valid; the message names the field path."""


def _check(ok: bool, path: str, why: str) -> None:
    if not ok:
        raise ConfigError(f"{path}: {why}")


@dataclass(frozen=True)
class WindowConfig:
    """DWC: the dynamic draft window."""

    policy: str = "dflash"
    initial: int = 4
    min_window: int = 1
    max_window: int = 8
    plnp_low: float = 0.3  # generated/prompt below this: keep `initial`
    plnp_high: float = 0.7  # above this: shrink to `late_window`
    mid_window: int = 6  # PLNP in [low, high]: 6, +1 on a flat slope, +1 more on low entropy
    late_window: int = 3
    slope_threshold: float = 0.15
    entropy_threshold: float = 0.85
    reject_ewma_rounds: int = 10
    degrade_reject_rate: float = 0.25
    degrade_window: int = 2
    recover_clean_rounds: int = 5

    def validate(self, path: str) -> None:
        _check(self.policy in WINDOW_POLICIES, f"{path}.policy",
               f"must be one of {WINDOW_POLICIES}")
        _check(1 <= self.min_window <= self.max_window <= 64, f"{path}.max_window",
               "need 1 <= min_window <= max_window <= 64")
        _check(self.min_window <= self.initial <= self.max_window, f"{path}.initial",
               "must lie in [min_window, max_window]")
        _check(0 < self.plnp_low < self.plnp_high, f"{path}.plnp_high",
               "need 0 < plnp_low < plnp_high")
        _check(0 < self.degrade_reject_rate < 1, f"{path}.degrade_reject_rate",
               "must lie in (0, 1)")
        _check(self.reject_ewma_rounds >= 1, f"{path}.reject_ewma_rounds", "must be >= 1")


@dataclass(frozen=True)
class LookupConfig:
    """The lookup drafter: n-gram matches in the sequence's own prompt + output."""

    min_ngram: int = 1
    max_ngram: int = 4
    max_occurrences: int = 16  # recent occurrences of an n-gram that vote on its continuation
    max_tokens: int = 8  # drafts per round at most (the request's and tenant's caps apply too)
    min_survival: float = 0.05  # stop drafting below this estimated survival
    tenant_corpus_size: int = 0  # finished requests per tenant also searched (0: off)
    use_store: bool = True  # the bundle's datastore (dsc datastore) where the context has none

    def validate(self, path: str) -> None:
        _check(1 <= self.min_ngram <= self.max_ngram <= 16, f"{path}.max_ngram",
               "need 1 <= min_ngram <= max_ngram <= 16")
        _check(1 <= self.max_occurrences <= 1024, f"{path}.max_occurrences",
               "must lie in [1, 1024]")
        _check(1 <= self.max_tokens <= 64, f"{path}.max_tokens", "must lie in [1, 64]")
        _check(0 <= self.min_survival < 1, f"{path}.min_survival", "must lie in [0, 1)")
        _check(0 <= self.tenant_corpus_size <= 1024, f"{path}.tenant_corpus_size",
               "must lie in [0, 1024]")


@dataclass(frozen=True)
class DraftingConfig:
    """Which drafter proposes: `hybrid` picks per sequence and round between the lookup,
    the draft model and plain decoding by expected tokens per second; `lookup` and `draft`
    use one source; `auto` takes the method of the device's resources row (RAS). A bundle
    without a draft model runs `hybrid` as `lookup`."""

    method: str = "auto"
    lookup: LookupConfig = field(default_factory=LookupConfig)
    explore_every: int = 8  # rounds without the model, at least, between re-trials (source.py)
    lookup_trust: float = 0.5  # hybrid: a lookup whose first draft is this likely runs alone
    # hybrid: the model window offered is at least this (within every cap) whatever an
    # adaptive window policy says; its cost model still picks how many (0 included)
    hybrid_min_window: int = 8
    # a draft model with the main's cache geometry and token ids (a quantized copy) reads
    # the main's KV cache instead of its own: no prompt prefill, no catch-up (engine start)
    share_main_kv: bool = True

    def validate(self, path: str) -> None:
        _check(self.method in METHOD_CHOICES, f"{path}.method",
               f"must be one of {METHOD_CHOICES}")
        _check(self.explore_every >= 1, f"{path}.explore_every", "must be >= 1")
        _check(0 <= self.lookup_trust <= 1, f"{path}.lookup_trust", "must lie in [0, 1]")
        _check(0 <= self.hybrid_min_window <= 64, f"{path}.hybrid_min_window",
               "must lie in [0, 64]")
        self.lookup.validate(f"{path}.lookup")


@dataclass(frozen=True)
class CacheHealthConfig:
    """CHE: KV cache health checks, off the hot path."""

    interval_ms: int = 200
    kdr_min: float = 0.75
    vfi_max: float = 0.12
    clca_max: float = 0.08
    repair_budget_ms: int = 20
    zero_rejected_slots: bool = False

    def validate(self, path: str) -> None:
        _check(self.interval_ms >= 10, f"{path}.interval_ms", "must be >= 10")
        _check(0 < self.kdr_min <= 1, f"{path}.kdr_min", "must lie in (0, 1]")
        _check(0 < self.vfi_max <= 1, f"{path}.vfi_max", "must lie in (0, 1]")
        _check(self.repair_budget_ms >= 1, f"{path}.repair_budget_ms", "must be >= 1")


@dataclass(frozen=True)
class VerifyBalanceConfig:
    """VLB: steady-lane draft tokens admitted per round by executor utilisation."""

    low_utilisation: float = 0.60
    high_utilisation: float = 0.85
    # The seed's 2 per round measured below the whole window at one request on a 2-core
    # CPU (bench/bench_vlb.py): holding drafts wastes the draft work when verify tokens are
    # nearly free. Under heavy batching the gate suspends drafting.
    steady_tokens_low: int = 8
    steady_tokens_mid: int = 2
    batch_cap: bool = True  # cap the batch's window by measured cost (0: plain decoding)
    # steps of 2+ sequences speculate only where, at their batch size, speculating steps
    # have realized more tokens per second than plain ones (dflash/batch_modes.py); the
    # slower mode is tried again (a trial: five steps) after `mode_explore_every` trials'
    # time in the faster
    batch_modes: bool = True
    mode_explore_every: int = 24
    # a step that feeds a prompt chunk does not speculate: the chunk waits for the decode
    # tokens beside it, not for drafts and their verify (false: speculate there too)
    plain_prompt_steps: bool = True

    def validate(self, path: str) -> None:
        _check(0 < self.low_utilisation < self.high_utilisation <= 1, f"{path}.high_utilisation",
               "need 0 < low_utilisation < high_utilisation <= 1")
        _check(self.mode_explore_every >= 1, f"{path}.mode_explore_every", "must be >= 1")


@dataclass(frozen=True)
class SchedulingConfig:
    """TAS: how prompts are fed. A request arriving while a long prompt is fed waits for the
    chunk in flight, so when several tenants are active long prompts go in small chunks
    and never share a step with a prompt that fits whole."""

    prefill_chunk_tokens: int = 256
    shared_prefill_chunk_tokens: int = 32

    def validate(self, path: str) -> None:
        _check(self.prefill_chunk_tokens >= 1, f"{path}.prefill_chunk_tokens", "must be >= 1")
        _check(1 <= self.shared_prefill_chunk_tokens <= self.prefill_chunk_tokens,
               f"{path}.shared_prefill_chunk_tokens", "must lie in [1, prefill_chunk_tokens]")


@dataclass(frozen=True)
class TenantConfig:
    name: str = "default"
    max_window: int = 8
    weight: float = 1.0

    def validate(self, path: str) -> None:
        _check(bool(self.name), f"{path}.name", "must not be empty")
        _check(1 <= self.max_window <= 64, f"{path}.max_window", "must lie in [1, 64]")
        _check(self.weight > 0, f"{path}.weight", "must be > 0")


@dataclass(frozen=True)
class ResourceRow:
    match: str  # substring of the device name, or "cpu"
    window: int
    draft: str = "draft"
    method: str = "hybrid"  # drafting method where drafting.method is "auto"

    def validate(self, path: str) -> None:
        _check(1 <= self.window <= 64, f"{path}.window", "must lie in [1, 64]")
        _check(self.method in DRAFT_METHODS, f"{path}.method", f"must be one of {DRAFT_METHODS}")


@dataclass(frozen=True)
class ResourceConfig:
    """RAS: device table and elastic degradation under memory pressure."""

    table: tuple[ResourceRow, ...] = (
        ResourceRow("A10G", 4), ResourceRow("A100", 6), ResourceRow("H100", 8),
        # cpu: on a 2-core machine short fixed windows measured best and long ones below
        # plain decoding; the hybrid beat lookup and the draft model alone across chat, code
        # and edit prompts; with a draft that holds the main's weights exactly, a cap of 8
        # (twice the row's 4) offered whole beat a cap of 6 offered 4 (dsrun bench
        # --policies; the figures: docs/experiments.md, "Figures behind the source's
        # choices")
        ResourceRow("H200", 8), ResourceRow("cpu", 4, method="hybrid"),
    )
    degrade_usage: float = 0.85
    degrade_after_s: float = 300.0
    degraded_max_window: int = 6
    # the KV arena where no --kv-cache-memory is given: room for twice max_batch full-length
    # sequences (the running ones, and as much again of cached prefixes), within this share
    # of the memory available at start (MemAvailable; a GPU's free memory)
    kv_memory_fraction: float = 0.4

    def validate(self, path: str) -> None:
        _check(0 < self.degrade_usage <= 1, f"{path}.degrade_usage", "must lie in (0, 1]")
        _check(0 < self.kv_memory_fraction <= 0.95, f"{path}.kv_memory_fraction",
               "must lie in (0, 0.95]")
        _check(self.degrade_after_s >= 0, f"{path}.degrade_after_s", "must be >= 0")
        for i, row in enumerate(self.table):
            row.validate(f"{path}.table[{i}]")


@dataclass(frozen=True)
class DFlashConfig:
    window: WindowConfig = field(default_factory=WindowConfig)
    drafting: DraftingConfig = field(default_factory=DraftingConfig)
    cache_health: CacheHealthConfig = field(default_factory=CacheHealthConfig)
    verify_balance: VerifyBalanceConfig = field(default_factory=VerifyBalanceConfig)
    tenants: tuple[TenantConfig, ...] = (TenantConfig(),)
    scheduling: SchedulingConfig = field(default_factory=SchedulingConfig)
    resources: ResourceConfig = field(default_factory=ResourceConfig)
    cache_resize_grace_period_sec: float = 30.0

    def __post_init__(self) -> None:
        self.window.validate("window")
        self.drafting.validate("drafting")
        self.cache_health.validate("cache_health")
        self.verify_balance.validate("verify_balance")
        self.resources.validate("resources")
        self.scheduling.validate("scheduling")
        for i, t in enumerate(self.tenants):
            t.validate(f"tenants[{i}]")
        names = [t.name for t in self.tenants]
        _check(len(set(names)) == len(names), "tenants", "tenant names must be unique")
        _check(self.cache_resize_grace_period_sec >= 0, "cache_resize_grace_period_sec",
               "must be >= 0")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _build(cls: type, data: object, path: str) -> object:
    _check(isinstance(data, dict), path or "<root>",
           f"expected an object, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        _check(key in names, f"{path}.{key}".lstrip("."), f"unknown field (known: {sorted(names)})")
    kwargs = {k: _value(hints[k], v, f"{path}.{k}".lstrip(".")) for k, v in data.items()}
    return cls(**kwargs)


def _value(tp: object, v: object, path: str) -> object:
    if dataclasses.is_dataclass(tp):
        return _build(tp, v, path)
    if typing.get_origin(tp) is tuple:
        _check(isinstance(v, (list, tuple)), path, f"expected a list, got {type(v).__name__}")
        item = typing.get_args(tp)[0]
        return tuple(_value(item, x, f"{path}[{i}]") for i, x in enumerate(v))
    if tp is bool:
        _check(isinstance(v, bool), path, f"expected true/false, got {v!r}")
    elif tp is int:
        _check(isinstance(v, int) and not isinstance(v, bool), path,
               f"expected an integer, got {v!r}")
    elif tp is float:
        _check(isinstance(v, (int, float)) and not isinstance(v, bool), path,
               f"expected a number, got {v!r}")
        return float(v)
    elif tp is str:
        _check(isinstance(v, str), path, f"expected a string, got {v!r}")
    return v


def config_from_dict(data: dict) -> DFlashConfig:
    return _build(DFlashConfig, data, "")  # type: ignore[return-value]


def load_config(path: str | Path) -> DFlashConfig:
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{p}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p}: cannot read: {e}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p}: not valid JSON: {e}") from None
    try:
        return config_from_dict(data)
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None
