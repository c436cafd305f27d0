"""What an engine is built from: which models keep a KV cache, which the prefix cache
keys, and the arena's layout for them."""

from __future__ import annotations

from dspark.runtime.bundle.bundle import Bundle
from dspark.runtime.bundle.config import ResourceConfig
from dspark.runtime.cache.layout import IN_FLIGHT, ArenaLayout, arena_layout
from dspark.runtime.dflash.ras import available_bytes, kv_budget
from dspark.runtime.errors import DSparkError


def shared_kv_roles(bundle: Bundle, enabled: bool) -> frozenset[str]:
    """The draft models that read the main's KV cache (config drafting.share_main_kv): same
    cache geometry as the main and the same token ids (no token map)."""
    main = bundle.model("main")
    return frozenset(r for r in bundle.draft_models if enabled and main.same_cache(
        bundle.model(r)) and not (r == "draft" and bundle.token_map is not None))


def cached_roles(bundle: Bundle, shared: frozenset[str]) -> tuple[str, ...]:
    """The models whose caches the prefix cache keeps, main first: those that keep their
    own cache at the main's token positions (no token map)."""
    drafts = [r for r in bundle.draft_models if r not in shared
              and not (r == "draft" and bundle.token_map is not None)]
    return ("main", *sorted(drafts))


def kv_layout(bundle: Bundle, shared: frozenset[str], budget: int | None,
              kv_dtype: str | None, max_seq_len: int | None = None, windowed: bool = True,
              flight: int = IN_FLIGHT) -> ArenaLayout:
    """The arena's groups for the models that keep a cache (a draft reading the main's
    keeps none: its share of the budget goes to the others)."""
    plan = bundle.plan
    if max_seq_len is not None and not 1 <= max_seq_len <= plan.max_seq_len:
        raise DSparkError(f"--max-seq-len {max_seq_len} must lie in [1, "
                          f"{plan.max_seq_len}] (the bundle's; dsc compile --max-seq-len)")
    specs = [bundle.model(p.role) for p in plan.pools if p.role not in shared]
    return arena_layout(specs, budget or plan.budget_bytes, plan.block_size,
                        max_seq_len or plan.max_seq_len, kv_dtype, windowed, flight)


def engine_layout(bundle: Bundle, shared: frozenset[str], resources: ResourceConfig, device,
                  max_batch: int, flight: int, budget: int | str | None,
                  kv_dtype: str | None, max_seq_len: int | None, windowed: bool
                  ) -> ArenaLayout:
    """The engine's arena: the bundle's budget, a given one, or ("auto") the one RAS sizes
    for `max_batch` sequences from the memory available (dflash/ras.py)."""
    if kv_dtype not in (None, "float32") and device.type == "cuda":
        raise DSparkError(f"--kv-cache-dtype {kv_dtype} runs on the CPU; on a GPU the "
                          "cache keeps the model's own dtype")
    layout = kv_layout(bundle, shared, None, kv_dtype, max_seq_len, windowed, flight)
    if budget == "auto":
        budget = kv_budget(resources, layout.bytes_per_seq, max_batch, available_bytes(device))
    if budget is None:
        return layout
    return kv_layout(bundle, shared, budget, kv_dtype, max_seq_len, windowed, flight)
