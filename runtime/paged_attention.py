"""SpeculativeVerify on the CPU over the paged arena, in place.

Per forward (shared by every layer) each sequence's block table becomes either a slice (its
blocks are consecutive, the common case) or an index array, and its causal window mask is
built once. Per layer, per sequence:

    arena K [block][kv_head][block_size][head_dim] --blocks of the sequence--> [kv, L, d]
    q [heads, n, d] -> [kv, group*n, d] --(q K^T * scale, causal mask, softmax, @ V)--> out
Query j of a sequence (position start+j) sees keys 0..start+j. Small numpy matmuls measured
~2x faster than one padded torch SDPA over the whole batch at these sizes (a 135M model's
3 KV heads x 64, contexts of hundreds) because they skip the padding and op dispatch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dspark.runtime.batch import FlatBatch
from dspark.runtime.kv_arena import KVArena
from dspark.runtime.spec import VerifyOp


@dataclass(frozen=True)
class SeqView:
    rows: slice  # the sequence's tokens in the flattened batch
    blocks: slice | np.ndarray  # its blocks in the arena
    length: int  # keys to attend: cached + new
    bias: np.ndarray | None  # [n, length]: 0 where query j may see key i, else -inf
    write_blocks: np.ndarray  # arena block of each new token
    write_offsets: np.ndarray  # offset of each new token inside its block


def _blocks(table: list[int]) -> slice | np.ndarray:
    if table[-1] - table[0] == len(table) - 1 and table == list(range(table[0], table[-1] + 1)):
        return slice(table[0], table[-1] + 1)
    return np.array(table, np.int64)


def build_views(arena: KVArena, batch: FlatBatch) -> list[SeqView]:
    bs, views = arena.block_size, []
    for i in range(batch.num_seqs):
        a, b = batch.seq_range(i)
        start, n = int(batch.starts[i]), b - a
        table = arena.tables[int(batch.slots[i])].blocks
        positions = batch.positions[a:b]
        bias = None
        if n > 1:
            visible = np.arange(start + n)[None, :] <= (start + np.arange(n))[:, None]
            bias = np.where(visible, 0.0, -np.inf).astype(np.float32)
        views.append(SeqView(slice(a, b), _blocks(table[: -(-(start + n) // bs)]), start + n,
                             bias, np.array([table[p // bs] for p in positions]), positions % bs))
    return views


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, bias: np.ndarray | None,
           scale: float) -> np.ndarray:
    """q [heads, n, d], k/v [kv_heads, L, d] -> [heads, n, d]; heads grouped per KV head."""
    heads, n, dim = q.shape
    kv = k.shape[0]
    qg = q.reshape(kv, heads // kv * n, dim)
    s = np.matmul(qg, k.transpose(0, 2, 1))
    s *= scale
    if bias is not None:
        s = s.reshape(kv, heads // kv, n, -1)
        s += bias
        s = s.reshape(kv, heads // kv * n, -1)
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return np.matmul(s, v).reshape(heads, n, dim)


class PagedAttention:
    """The CPU attention backend of one model (`role`) over the shared arena."""

    def __init__(self, arena: KVArena, role: str):
        self.arena = arena
        pool = arena.pools[role]
        self.k = [t.numpy() for t in pool.k]
        self.v = [t.numpy() for t in pool.v]
        self._batch: FlatBatch | None = None
        self._views: list[SeqView] = []

    def views(self, batch: FlatBatch) -> list[SeqView]:
        if batch is not self._batch:
            self._batch, self._views = batch, build_views(self.arena, batch)
        return self._views

    def __call__(self, op: VerifyOp, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                 batch: FlatBatch) -> np.ndarray:
        ka, va = self.k[op.layer], self.v[op.layer]
        out = np.empty_like(q[0])
        kv, dim = op.num_kv_heads, op.head_dim
        for s in self.views(batch):
            ka[s.write_blocks, :, s.write_offsets] = k[0, :, s.rows].transpose(1, 0, 2)
            va[s.write_blocks, :, s.write_offsets] = v[0, :, s.rows].transpose(1, 0, 2)
            keys = ka[s.blocks].transpose(1, 0, 2, 3).reshape(kv, -1, dim)[:, : s.length]
            values = va[s.blocks].transpose(1, 0, 2, 3).reshape(kv, -1, dim)[:, : s.length]
            out[:, s.rows] = attend(q[0, :, s.rows], keys, values, s.bias, op.scale)
        return out[None]
