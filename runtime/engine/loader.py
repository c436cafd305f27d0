"""Bundle path -> a ready engine and its tokenizer (what every dsrun command starts with)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dspark.runtime.bundle.bundle import open_bundle
from dspark.runtime.bundle.config import CONFIG_FILE, DFlashConfig
from dspark.runtime.bundle.tokenizer import BundleTokenizer, load_tokenizer
from dspark.runtime.engine.engine import Engine
from dspark.runtime.grammar.constraint import GrammarBook
from dspark.runtime.model.sessions import init_threads


@dataclass(frozen=True)
class KVOptions:
    """The KV cache a server or a command runs with (dsrun's --kv-cache-* flags)."""

    memory_mb: float | None = None  # the arena's size; None: RAS sizes it (dflash/ras.py)
    dtype: str | None = None  # float32, float16, int8; None: each model's own
    prefix_cache: bool = True
    max_seq_len: int | None = None  # None: the bundle's

    @property
    def budget(self) -> int | str:
        return "auto" if self.memory_mb is None else int(self.memory_mb * 2**20)


def load_engine(model: Path, window: int | None = None, max_batch: int = 16,
                policy: str | None = None, config: Path | DFlashConfig | None = None,
                warmup: bool = True, device: str = "auto", watch: bool = True,
                kv: KVOptions | None = None, say: Callable[[str], None] | None = None,
                cost_cache: bool = False) -> tuple[Engine, BundleTokenizer | None]:
    """`window` alone means the fixed policy at that window; `policy` picks one by name.
    `config` (a file, or a config already validated) replaces the bundle's
    dflash_config.json; the file is hot-reloaded unless `watch` is off (dsrun cluster pushes
    configs to its replicas instead). `device`: auto, cpu or cuda. `kv`: the KV cache's
    size, dtype, prefix caching and longest sequence. `say`: where each load phase's line
    goes (dsrun: stderr). `cost_cache`: the warm-up reads this machine's cost table for the
    bundle when it has one (dsrun's commands; model/cost_cache.py)."""
    kv = kv or KVOptions()
    phase = _Phases(say)
    init_threads()
    given = config if isinstance(config, DFlashConfig) else None
    config = None if given is not None else config
    phase("bundle opened, its files checked")
    bundle = open_bundle(model, config_path=config)
    tokenizer = load_tokenizer(bundle.tokenizer_dir)
    phase("sessions built, the KV cache allocated")
    policy = policy or ("fixed" if window else None)
    engine = Engine(bundle, policy, window, max_batch,
                    eos_ids=tuple(sorted(tokenizer.eos_ids)) if tokenizer else (),
                    decode=tokenizer.decode if tokenizer else None, device=device,
                    grammars=GrammarBook.of(bundle, tokenizer), config=given,
                    kv_budget=kv.budget, kv_dtype=kv.dtype, prefix_cache=kv.prefix_cache,
                    max_seq_len=kv.max_seq_len)
    if watch:
        engine.watch(config or bundle.path(CONFIG_FILE))
    if warmup:
        phase("warmed up")
        profile = engine.warmup(cached=cost_cache)
        phase.name += (" (the cost table read from this machine's last load)"
                       if "cached" in profile else " (the cost table measured)")
    phase(None)
    return engine, tokenizer


class _Phases:
    """Each call ends the phase before it: its line, with its seconds, goes to `say`."""

    def __init__(self, say: Callable[[str], None] | None):
        self.say, self.name, self.t0 = say, None, time.perf_counter()

    def __call__(self, name: str | None) -> None:
        now = time.perf_counter()
        if self.say is not None and self.name is not None:
            self.say(f"{self.name} in {now - self.t0:.1f}s")
        self.name, self.t0 = name, now
