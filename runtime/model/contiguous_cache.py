"""A simple contiguous KV cache: one [slots, kv_heads, max_len, head_dim] tensor per layer.

The reference the paged arena and the kernels are checked against, and what `dsc verify` runs.
"""

from __future__ import annotations

import torch

from dspark.runtime.bundle.spec import ModelSpec
from dspark.runtime.cache import kv_rows
from dspark.runtime.model.batch import FlatBatch


class ContiguousKVCache:
    def __init__(self, spec: ModelSpec, slots: int, max_len: int, stored: str | None = None):
        """`stored`: hold keys and values as a cache of that dtype reads them back
        (cache/kv_rows.py: float16 or int8 rounding, in float32); None: as given."""
        self.stored = stored
        dtype = torch.float16 if spec.kv_dtype == "float16" else torch.float32
        shape = (slots, spec.num_kv_heads, max_len, spec.head_dim)
        self.max_len = max_len
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(spec.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(spec.num_layers)]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor, batch: FlatBatch) -> None:
        """k, v: [kv_heads, T, head_dim], written at each sequence's positions."""
        for i in range(batch.num_seqs):
            a, b = batch.seq_range(i)
            slot, start = int(batch.slots[i]), int(batch.starts[i])
            if start + (b - a) > self.max_len:
                raise ValueError(f"sequence in slot {slot} exceeds the cache length {self.max_len}")
            self.k[layer][slot, :, start:start + b - a] = self._rounded(k[:, a:b])
            self.v[layer][slot, :, start:start + b - a] = self._rounded(v[:, a:b])

    def _rounded(self, x: torch.Tensor) -> torch.Tensor:
        if self.stored in (None, "float32"):
            return x
        return torch.from_numpy(kv_rows.round_rows(x.float().numpy(), self.stored))

    def read(self, layer: int, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer][slot, :, :length], self.v[layer][slot, :, :length]
