"""The flattened batch: T new tokens from many sequences in one forward.

Prefill, drafting and verification are all this one shape: each sequence contributes the
tokens it appends this step, starting at its cached length.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SeqChunk:
    slot: int  # the sequence's cache slot
    start: int  # tokens already cached for it (= position of tokens[0])
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class FlatBatch:
    token_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slots: np.ndarray  # [n] cache slot per sequence
    starts: np.ndarray  # [n] cached length before this step
    cu_seqlens: np.ndarray  # [n + 1] offsets of each sequence's tokens in token_ids

    @classmethod
    def build(cls, chunks: list[SeqChunk]) -> FlatBatch:
        """From Python lists, one numpy array per field: a decode step builds one of these
        per forward, and after the forward's weights have left the caches each numpy call
        is slow, so the fewer the better."""
        if not chunks or any(len(c.tokens) == 0 for c in chunks):
            raise ValueError("a batch needs at least one token per sequence")
        tokens, positions, cu = [], [], [0]
        for c in chunks:
            tokens.extend(c.tokens)
            positions.extend(range(c.start, c.start + len(c.tokens)))
            cu.append(cu[-1] + len(c.tokens))
        return cls(
            token_ids=np.array(tokens, dtype=np.int64),
            positions=np.array(positions, dtype=np.int64),
            slots=np.array([c.slot for c in chunks], dtype=np.int64),
            starts=np.array([c.start for c in chunks], dtype=np.int64),
            cu_seqlens=np.array(cu, dtype=np.int64),
        )

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    @property
    def num_seqs(self) -> int:
        return len(self.slots)

    def seq_range(self, i: int) -> tuple[int, int]:
        return int(self.cu_seqlens[i]), int(self.cu_seqlens[i + 1])
