"""What the HTTP handlers share: the engine service, tokenizer, metrics and settings."""

from __future__ import annotations

from dataclasses import dataclass

from dspark.runtime.bundle.tokenizer import BundleTokenizer
from dspark.runtime.grammar.constraint import GrammarBook
from dspark.runtime.server.metrics import Metrics
from dspark.runtime.server.service import EngineService


@dataclass
class ServerState:
    service: EngineService
    tokenizer: BundleTokenizer | None
    model_id: str
    metrics: Metrics
    api_key: str | None = None
    created: int = 0
    max_body_bytes: int = 8 * 2**20  # larger request bodies get a 413
    grammars: GrammarBook | None = None  # structured output (None: no tokenizer)
    draining: bool = False  # shutting down: new generation requests get a 503
