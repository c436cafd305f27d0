"""Bundle path -> a ready engine and its tokenizer (what every dsrun command starts with)."""

from __future__ import annotations

from pathlib import Path

from dspark.runtime.bundle import open_bundle
from dspark.runtime.engine import Engine
from dspark.runtime.sessions import init_threads
from dspark.runtime.tokenizer import BundleTokenizer, load_tokenizer
from dspark.runtime.window import FixedWindow


def load_engine(model: Path, window: int | None = None, max_batch: int = 16
                ) -> tuple[Engine, BundleTokenizer | None]:
    init_threads()
    bundle = open_bundle(model)
    tokenizer = load_tokenizer(bundle.tokenizer_dir)
    policy = FixedWindow(window or bundle.config.window.initial)
    engine = Engine(bundle, policy, max_batch,
                    eos_ids=tuple(sorted(tokenizer.eos_ids)) if tokenizer else (),
                    decode=tokenizer.decode if tokenizer else None)
    return engine, tokenizer
