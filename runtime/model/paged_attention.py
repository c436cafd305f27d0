"""SpeculativeVerify on the CPU over the paged arena, in place.

Per forward (shared by every layer) each sequence's block table and window are read once.
Per layer, decode and verify windows (most steps) go to one compiled call for the whole
batch (kernels/cpu_verify.py: append k/v, attend straight from the arena blocks). A long
window (prefill) is gathered by head and runs as matmuls, on onnxruntime's threads when big:

    arena K [block][kv_head][block_size][head_dim] --its blocks, by head--> [kv, L, d]
    q [heads, n, d] -> [kv, group*n, d] --(q*scale K^T, causal bias, softmax, @ V)--> out
Query j of a sequence (position p = start+j) sees keys 0..p, or p-W+1..p in a layer of
window W. The numpy path also serves arenas that are not float32 (the compiled kernel is
float32 only): their rows stored and read as the CPU op does (cache/kv_rows.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dspark.runtime.bundle.spec import VerifyOp
from dspark.runtime.cache import kv_rows
from dspark.runtime.cache.kv_arena import KVArena
from dspark.runtime.model.batch import FlatBatch
from dspark.runtime.model.ort_attention import ort_attend

# Windows with at least this many (query, key) pairs go to onnxruntime's threads.
ORT_WINDOW = 64 * 64


@dataclass(frozen=True)
class SeqView:
    rows: slice  # the sequence's tokens in the flattened batch
    blocks: slice | np.ndarray  # its blocks in the arena (a slice when consecutive)
    start: int  # cached positions before this step
    length: int  # keys to attend: cached + new
    write_blocks: np.ndarray  # arena block of each new token
    write_offsets: np.ndarray  # offset of each new token inside its block
    base: int = 0  # the position of the first key in `blocks`

    @property
    def pairs(self) -> int:
        """(query, key) pairs of its window, the size of its attention."""
        return (self.length - self.start) * self.length


def visible_bias(start: int, n: int, window: int, base: int = 0) -> np.ndarray | None:
    """[n, start+n-base]: 0 where query j may see key base+i, else -inf; None when one
    query sees every key (a decode step outside any window's cut)."""
    if n == 1 and (not window or start - base < window):
        return None
    keys, queries = np.arange(base, start + n)[None, :], (start + np.arange(n))[:, None]
    visible = keys <= queries
    if window:
        visible &= keys > queries - window
    return np.where(visible, 0.0, -np.inf).astype(np.float32)


def _blocks(table: list[int]) -> slice | np.ndarray:
    if table[-1] - table[0] == len(table) - 1 and table == list(range(table[0], table[-1] + 1)):
        return slice(table[0], table[-1] + 1)
    return np.array(table, np.int64)


def build_views(arena: KVArena, batch: FlatBatch, group: str, window: int = 0
                ) -> list[SeqView]:
    """Each sequence's view of `group`'s blocks; a window group's from the first block its
    earliest query reads (the ones before it may have been dropped)."""
    bs, views = arena.block_size, []
    for i in range(batch.num_seqs):
        a, b = batch.seq_range(i)
        start, n = int(batch.starts[i]), b - a
        table = arena.tables[int(batch.slots[i])].blocks[group][: -(-(start + n) // bs)]
        first = max(0, start - window + 1) // bs if window else 0
        positions = batch.positions[a:b]
        views.append(SeqView(slice(a, b), _blocks(table[first:]), start, start + n,
                             np.array([table[p // bs] for p in positions]), positions % bs,
                             first * bs))
    return views


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, bias: np.ndarray | None,
           scale: float, softcap: float = 0.0) -> np.ndarray:
    """q [heads, n, d]; k/v [kv_heads, L, d]; bias [n, L] (None for one query); `softcap`
    > 0: scores soft-capped before the bias (Gemma 2).

    Query heads are grouped per KV head (head h reads KV head h // group), as GQA exports
    repeat them."""
    heads, n, dim = q.shape
    kv, length = k.shape[0], k.shape[1]
    group = heads // kv
    s = np.matmul(q.reshape(kv, group * n, dim) * np.float32(scale), k.transpose(0, 2, 1))
    if softcap:
        s = np.tanh(s / np.float32(softcap)) * np.float32(softcap)
    if bias is not None:
        s = s.reshape(kv, group, n, length)
        s += bias
        s = s.reshape(kv, group * n, length)
    s = np.exp(s - s.max(axis=-1, keepdims=True))
    s /= s.sum(axis=-1, keepdims=True)
    return np.matmul(s, v).reshape(heads, n, dim)


def by_head(pool: np.ndarray, blocks: slice | np.ndarray, length: int) -> np.ndarray:
    """[blocks, kv, block_size, d] -> [kv, length, d] (one copy of the sequence's keys, from
    its first block's first position)."""
    tiles = pool[blocks]
    return tiles.transpose(1, 0, 2, 3).reshape(tiles.shape[1], -1, tiles.shape[3])[:, :length]


@dataclass(frozen=True)
class BatchMeta:
    """The compiled kernel's view of a batch: every sequence's block table and window."""

    tables: np.ndarray  # [sequences, max blocks] int64
    starts: np.ndarray
    qoffs: np.ndarray
    news: np.ndarray
    compiled: np.ndarray  # the sequences the compiled kernel takes
    windows: list[SeqView]  # the others: numpy or onnxruntime, gathered by head
    biases: dict = field(default_factory=dict)  # (view index, layer window) -> visible_bias

    def bias(self, index: int, window: int) -> np.ndarray | None:
        key = (index, window)
        if key not in self.biases:
            view = self.windows[index]
            self.biases[key] = visible_bias(view.start, view.length - view.start, window,
                                            view.base)
        return self.biases[key]


def batch_meta(arena: KVArena, batch: FlatBatch, views: list[SeqView], float32: bool,
               group: str) -> BatchMeta:
    bs = arena.block_size
    news = np.diff(batch.cu_seqlens)
    tables = np.zeros((batch.num_seqs, int(-(-(batch.starts + news).max() // bs))), np.int64)
    compiled, windows = [], []
    for i, view in enumerate(views):
        blocks = arena.tables[int(batch.slots[i])].blocks[group][: -(-view.length // bs)]
        tables[i, : len(blocks)] = blocks
        small = view.length == view.start + 1 or view.pairs < ORT_WINDOW
        (compiled.append(i) if float32 and small else windows.append(view))
    return BatchMeta(tables, batch.starts.astype(np.int64), batch.cu_seqlens[:-1].astype(np.int64),
                     news.astype(np.int64), np.array(compiled, np.int64), windows)


class PagedAttention:
    """The CPU attention backend of one model (`role`) over the shared arena.

    Decode and verify windows go to the compiled kernel (kernels/cpu_verify.py) in one call
    per layer; long windows (prefill) and non-float32 arenas to `attend` / onnxruntime."""

    def __init__(self, arena: KVArena, role: str):
        # numba is imported with the kernel, here: a model on the fused op never needs it,
        # and the import costs a load ~0.5 s
        from dspark.kernels.cpu_verify import cpu_verify_attention

        self.kernel = cpu_verify_attention
        self.arena = arena
        self.role = role
        pool = arena.pools[role]
        self.k = [t.numpy() for t in pool.k]
        self.v = [t.numpy() for t in pool.v]
        self.group_of = pool.group_of
        self._batch: FlatBatch | None = None
        self._meta: dict[str, BatchMeta] = {}

    def meta(self, batch: FlatBatch, group: str) -> BatchMeta:
        if batch is not self._batch:
            self._batch, self._meta = batch, {}
        if group not in self._meta:
            float32 = self.k[0].dtype == np.float32
            window = self.arena.groups[group].layout.window
            self._meta[group] = batch_meta(self.arena, batch, build_views(
                self.arena, batch, group, window), float32, group)
        return self._meta[group]

    def __call__(self, op: VerifyOp, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                 batch: FlatBatch) -> np.ndarray:
        """q [T, heads, d], k/v [T, kv, d] -> [T, heads, d]."""
        m = self.meta(batch, self.group_of[op.layer])
        ka, va = self.k[op.layer], self.v[op.layer]
        out = np.empty(q.shape, np.float32 if len(m.compiled) else q.dtype)
        if len(m.compiled):
            q, k, v = (np.ascontiguousarray(x, np.float32) for x in (q, k, v))
            self.kernel(q, k, v, ka, va, m.tables, m.starts, m.qoffs, m.news, m.compiled,
                        op.scale, out, op.window, op.softcap)
        dtype = self.arena.groups[self.group_of[op.layer]].layout.dtype
        for i, s in enumerate(m.windows):
            ka[s.write_blocks, :, s.write_offsets] = kv_rows.store(k[s.rows], dtype)
            va[s.write_blocks, :, s.write_offsets] = kv_rows.store(v[s.rows], dtype)
            bias = m.bias(i, op.window)
            keys = s.length - s.base
            args = (q[s.rows].swapaxes(0, 1), kv_rows.load(by_head(ka, s.blocks, keys), dtype),
                    kv_rows.load(by_head(va, s.blocks, keys), dtype), bias, op.scale)
            if bias is not None and s.pairs >= ORT_WINDOW and not op.softcap:
                out[s.rows] = ort_attend(*args).swapaxes(0, 1)
            else:  # a soft-capped layer's long windows too: the onnxruntime graph has no cap
                out[s.rows] = attend(*args, op.softcap).swapaxes(0, 1)
        return out
