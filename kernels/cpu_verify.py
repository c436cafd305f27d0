"""Paged verify attention on the CPU: one compiled call per layer for the whole batch.

The same contract as the Triton kernel (verify_attention.py, whose torch reference checks
both), plus the append of the new keys and values, for float32 arenas:

    for each sequence s (qoff, new, start): write k/v rows qoff..qoff+new-1 to the slots of
    positions start..start+new-1, then for each KV head g, over its keys 0..start+new-1:
        scores[j*group+u, i] = scale * q[qoff+j, g*group+u] . K[i]   (lo(p) <= i <= p)
            (soft-capped where softcap > 0: softcap * tanh(score / softcap))
        out[qoff+j, g*group+u] = softmax(scores[j*group+u]) @ V
    where p = start+j and lo(p) = 0, or p-window+1 in a sliding-window layer.
Each key and value row is read once per KV head for the whole head group and window,
straight from its arena block: nothing is gathered. Why compiled: a decode step's attention
is ~60 KFLOP per layer, and the dozen numpy calls that did it cost several times that in
place (after a segment run has pushed the interpreter's working set out of cache), a tenth
of a small model's step; one numba call does it in a fraction. Single-threaded on purpose:
onnxruntime's pool owns the cores, and long windows (prefill) go to its threads instead
(runtime/model/ort_attention.py).
"""

from __future__ import annotations

import math

import numba
import numpy as np


@numba.njit(cache=True, fastmath=True, nogil=True, boundscheck=False)
def _append(k_new, v_new, k_pool, v_pool, table, start, qoff, new):  # pragma: no cover
    bs = k_pool.shape[2]
    for j in range(new):
        p = start + j
        blk, off = table[p // bs], p % bs
        k_pool[blk, :, off, :] = k_new[qoff + j]
        v_pool[blk, :, off, :] = v_new[qoff + j]


@numba.njit(cache=True, inline="always")
def _first_key(position, window):  # pragma: no cover
    return max(0, position - window + 1) if window > 0 else 0


@numba.njit(cache=True, fastmath=True, nogil=True, boundscheck=False)
def _attend(q, k_pool, v_pool, table, start, qoff, new, scale, window, softcap,
            out):  # pragma: no cover
    kv, bs, dim = k_pool.shape[1], k_pool.shape[2], k_pool.shape[3]
    group = q.shape[1] // kv
    length = start + new
    rows = new * group
    first = _first_key(start, window)  # no query of the window reads a key before this
    scores = np.empty((rows, length), np.float32)
    acc = np.empty((rows, dim), np.float32)
    inv = np.empty(rows, np.float32)
    for g in range(kv):
        for i in range(first, length):
            key = k_pool[table[i // bs], g, i % bs]
            # query j sees key i when i <= start + j (and i > start + j - window)
            last = new if window == 0 else min(new, i - start + window)
            for j in range(max(0, i - start), last):
                for u in range(group):
                    head = q[qoff + j, g * group + u]
                    s = np.float32(0.0)
                    for x in range(dim):
                        s += head[x] * key[x]
                    s *= scale
                    if softcap > 0:
                        s = softcap * np.float32(math.tanh(s / softcap))
                    scores[j * group + u, i] = s
        for r in range(rows):
            limit = start + r // group + 1
            lo = _first_key(limit - 1, window)
            top = scores[r, lo]
            for i in range(lo + 1, limit):
                top = max(top, scores[r, i])
            total = np.float32(0.0)
            for i in range(lo, limit):
                p = np.float32(math.exp(scores[r, i] - top))
                scores[r, i] = p
                total += p
            inv[r] = np.float32(1.0) / total
        acc[:] = 0.0
        for i in range(first, length):
            value = v_pool[table[i // bs], g, i % bs]
            last = rows if window == 0 else min(rows, (i - start + window) * group)
            for r in range(max(0, i - start) * group, last):
                p = scores[r, i]
                for x in range(dim):
                    acc[r, x] += p * value[x]
        for r in range(rows):
            head = out[qoff + r // group, g * group + r % group]
            for x in range(dim):
                head[x] = acc[r, x] * inv[r]


@numba.njit(cache=True, fastmath=True, nogil=True, boundscheck=False)
def _verify_kernel(q, k_new, v_new, k_pool, v_pool, tables, starts, qoffs, news, seqs, scale,
                   window, softcap, out):  # pragma: no cover
    for s in seqs:
        _append(k_new, v_new, k_pool, v_pool, tables[s], starts[s], qoffs[s], news[s])
        _attend(q, k_pool, v_pool, tables[s], starts[s], qoffs[s], news[s], scale, window,
                softcap, out)


def cpu_verify_attention(q: np.ndarray, k_new: np.ndarray, v_new: np.ndarray,
                         k_pool: np.ndarray, v_pool: np.ndarray, tables: np.ndarray,
                         starts: np.ndarray, qoffs: np.ndarray, news: np.ndarray,
                         seqs: np.ndarray, scale: float, out: np.ndarray, window: int = 0,
                         softcap: float = 0.0) -> None:
    """Append and attend the sequences `seqs` of the batch into `out` (their rows).

    q [T, heads, d], k_new/v_new [T, kv, d], pools [blocks, kv, block_size, d], all float32
    and C-contiguous; tables [sequences, max blocks], starts, qoffs, news, seqs int64.
    `window`: the layer's attention window (0: every earlier position); `softcap`: its
    scores' soft-cap (0: none)."""
    _verify_kernel(q, k_new, v_new, k_pool, v_pool, tables, starts, qoffs, news, seqs,
                   np.float32(scale), np.int64(window), np.float32(softcap), out)
