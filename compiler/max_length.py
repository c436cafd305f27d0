"""The bundle's max_seq_len when --max-seq-len is not given: the smaller of DEFAULT and what
the models run, as vLLM derives max_model_len from a model's config.

Two sources, cheapest first. A config.json beside a model (optimum's and the HF exports')
names its position limit (`max_position_embeddings`, GPT-2's `n_positions`, ...). Without
one the compile itself finds it: the span pass runs the model at the length asked for, and a
model that fails there (a learned position table of 1024 rows) raises LengthLimitError with
the longest length it runs; the compile starts again at that length.
"""

from __future__ import annotations

import json
from pathlib import Path

from dspark.runtime.errors import ModelInputError

DEFAULT = 2048
CONFIG_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length",
               "n_ctx")


class LengthLimitError(ModelInputError):
    """The model does not run at the length asked for; `runs`: the longest it does."""

    def __init__(self, message: str, runs: int):
        super().__init__(message)
        self.runs = runs


def config_limit(model: Path) -> tuple[int, str] | None:
    """(limit, "config.json key") from the config.json beside `model`, if it names one."""
    path = model.parent / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    for key in CONFIG_KEYS:
        value = config.get(key) if isinstance(config, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value, f"{path} {key}"
    return None


def default_length(models: list[Path]) -> tuple[int, str]:
    """The length to compile at and why (the line `dsc compile` prints)."""
    length, why = DEFAULT, f"the default, {DEFAULT}"
    for model in models:
        found = config_limit(model)
        if found is not None and found[0] < length:
            length, why = found[0], f"{found[1]} = {found[0]}"
    return length, why
