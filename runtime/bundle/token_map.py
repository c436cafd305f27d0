"""Draft->main token map, for a draft whose tokenizer differs from the main model's.

    token_map.json  {"format": "dspark-token-map/1", "main_vocab": M, "draft_to_main": [...]}
draft_to_main[d] is the main id of draft token d, or -1 when the main vocabulary has no
token with its string; "expand" gives, for main tokens the draft lacks (the seed's "🛒"),
the draft's own tokens for the same text ("🛒" -> its byte tokens). The runtime feeds the
draft main tokens translated to draft ids, expanded where needed (so the draft's positions
can run ahead of the main's), and proposes only mapped draft tokens: an unmapped one ends
that draft window early. Only the main model decides the output, so a map can cost
acceptance, never correctness.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dspark.runtime.errors import DSparkError

FORMAT = "dspark-token-map/1"
TOKEN_MAP_FILE = "token_map.json"


@dataclass
class TokenMap:
    draft_to_main: np.ndarray  # [draft vocab] int64, -1 where unmapped
    main_vocab: int
    fallback: int = 0  # draft id fed for a main token the draft lacks and cannot spell
    expand: dict[int, list[int]] | None = None  # main id -> the draft's tokens for its text

    def __post_init__(self) -> None:
        self.main_to_draft = np.full(self.main_vocab, -1, dtype=np.int64)
        mapped = np.nonzero(self.draft_to_main >= 0)[0]
        self.main_to_draft[self.draft_to_main[mapped][::-1]] = mapped[::-1]
        self.expand = self.expand or {}

    @property
    def identity(self) -> bool:
        n = len(self.draft_to_main)
        return n == self.main_vocab and bool((self.draft_to_main == np.arange(n)).all())

    def pieces(self, main_id: int) -> list[int]:
        """The draft tokens standing for one main token (one, or its expansion)."""
        d = int(self.main_to_draft[main_id])
        return [d] if d >= 0 else self.expand.get(main_id) or [self.fallback]

    def to_draft(self, main_ids: list[int]) -> list[int]:
        return [d for m in main_ids for d in self.pieces(m)]

    def main_probabilities(self, q: np.ndarray) -> tuple[np.ndarray, float]:
        """A draft distribution over main ids, renormalised over the mapped draft tokens,
        and the mass those carry. Proposals are drawn from q restricted to mapped tokens and
        the acceptance test uses this same restricted distribution, so rejection sampling
        stays exact."""
        mapped = self.draft_to_main >= 0
        mass = float(q[mapped].sum())
        out = np.bincount(self.draft_to_main[mapped], weights=q[mapped],
                          minlength=self.main_vocab)
        return (out / mass if mass > 0 else out), mass

    def to_json(self) -> dict:
        return {"format": FORMAT, "main_vocab": self.main_vocab, "fallback": self.fallback,
                "draft_to_main": self.draft_to_main.tolist(),
                "expand": {str(k): v for k, v in sorted(self.expand.items())}}

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json()))

    @classmethod
    def load(cls, path: Path, draft_vocab: int | None = None,
             main_vocab: int | None = None) -> TokenMap:
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise DSparkError(f"{path}: no such token map") from None
        except (OSError, ValueError) as e:
            raise DSparkError(f"{path}: not a readable token map ({e})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise DSparkError(f"{path}: not a {FORMAT} file")
        table = np.asarray(data.get("draft_to_main", []), dtype=np.int64)
        vocab = int(data.get("main_vocab", 0))
        if main_vocab is not None and vocab > main_vocab:
            raise DSparkError(f"{path}: main_vocab {vocab} > the main model's {main_vocab}")
        if draft_vocab is not None and len(table) > draft_vocab:
            raise DSparkError(f"{path}: {len(table)} draft ids, the draft model has "
                              f"{draft_vocab}")
        if draft_vocab is not None:  # ids past the tokenizer (padding rows) are unmapped
            table = np.concatenate([table, np.full(draft_vocab - len(table), -1, np.int64)])
        if len(table) and (table.max() >= vocab or table.min() < -1):
            raise DSparkError(f"{path}: ids outside [-1, {vocab})")
        expand = {int(k): [int(x) for x in v] for k, v in data.get("expand", {}).items()}
        return cls(table, main_vocab or vocab, int(data.get("fallback", 0)), expand)
