"""The original ONNX model run as its exporter meant: one sequence, KV cache through run().

The ground truth `dsc verify` (and the lossless tests) compare the bundle against.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dspark.compiler.contract import (
    ATTENTION_MASK,
    NUMPY_TYPES,
    check_contract,
    load_header,
    model_file,
    past_name,
)
from dspark.compiler.passes.token_quant import per_token_quantized
from dspark.runtime.bundle.spec import INPUT_IDS, LOGITS, POSITION_IDS
from dspark.runtime.model.sessions import make_session


class Past(list):
    """The original's cache tensors (its present, fed back) and how many positions they
    hold: a window-sized cache holds fewer rows than positions."""

    def __init__(self, tensors: list[np.ndarray], positions: int = 0):
        super().__init__(tensors)
        self.positions = positions


class OriginalModel:
    def __init__(self, path: Path, session=None, token_by_token: bool | None = None):
        """`session`: an onnxruntime session of `path` made elsewhere (default: shared pool);
        `token_by_token`: run every chunk a token at a time (default: where the model
        quantizes activations per tensor)."""
        self.path = path = model_file(path)
        header = load_header(path)
        self.contract = check_contract(path, header)
        # activations quantized per tensor: causal only a token at a time, which is the
        # function the bundle computes for any chunk (passes/token_quant.py)
        self.token_by_token = (per_token_quantized(header) if token_by_token is None
                               else token_by_token)
        self._session = session  # made at the first forward (dsc verify runs the bundle first)
        c = self.contract
        self.present = [f"present.{i}.{k}" for i in range(c.num_layers) for k in ("key", "value")]

    @property
    def session(self):
        if self._session is None:
            self._session = make_session(self.path, level="all")
        return self._session

    def empty_past(self) -> Past:
        """Nothing cached (a window-sized cache: its rows, none of them holding a position)."""
        c = self.contract
        return Past([np.zeros((1, c.num_kv_heads, c.cache_rows(i // 2, 0), c.head_dim),
                              NUMPY_TYPES[c.kv_dtype]) for i in range(2 * c.num_layers)])

    def forward(self, ids: list[int], past: Past) -> tuple[np.ndarray, Past]:
        """Logits [len(ids), vocab] and the new past, for one sequence."""
        if self.token_by_token and len(ids) > 1:
            rows = []
            for token in ids:
                row, past = self._forward([token], past)
                rows.append(row)
            return np.concatenate(rows), past
        return self._forward(ids, past)

    def _forward(self, ids: list[int], past: Past) -> tuple[np.ndarray, Past]:
        c = self.contract
        cached, n = past.positions, len(ids)
        feeds = {INPUT_IDS: np.array([ids], dtype=NUMPY_TYPES.get(c.input_ids_dtype, np.int64))}
        if c.has_attention_mask:
            feeds[ATTENTION_MASK] = np.ones((1, cached + n), np.int64)
        if c.has_position_ids:
            feeds[POSITION_IDS] = (cached + np.arange(n, dtype=np.int64))[None]
        for i in range(c.num_layers):
            feeds[past_name(i, "key")], feeds[past_name(i, "value")] = past[2 * i], past[2 * i + 1]
        out = self.session.run([LOGITS, *self.present], feeds)
        return out[0][0], Past(out[1:], cached + n)

    def greedy(self, prompt: list[int], max_new: int) -> list[int]:
        """The model's own greedy loop: prefill, then one token per step."""
        logits, past = self.forward(prompt, self.empty_past())
        tokens = [int(np.argmax(logits[-1]))]
        while len(tokens) < max_new:
            logits, past = self.forward(tokens[-1:], past)
            tokens.append(int(np.argmax(logits[-1])))
        return tokens
