"""Reference SpeculativeVerify on the CPU: torch SDPA over a contiguous cache.

For each sequence in the flattened batch, its new tokens attend over the cached positions
plus the new tokens before them (causal inside the window):

    cache  [0 ............ start)      new tokens [start .. start+n)
    query j (position p = start+j) sees keys 0 .. p, or p-W+1 .. p in a layer of window W
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from dspark.kernels.capped import capped_attention
from dspark.runtime.bundle.spec import VerifyOp
from dspark.runtime.model.batch import FlatBatch
from dspark.runtime.model.contiguous_cache import ContiguousKVCache


def causal_window_mask(start: int, n: int, window: int = 0) -> torch.Tensor:
    """[n, start+n] bool, True where query j may attend key i (the last `window` keys up to
    itself when window > 0)."""
    keys = torch.arange(start + n)[None, :]
    queries = (start + torch.arange(n))[:, None]
    visible = keys <= queries
    return visible & (keys > queries - window) if window else visible


def verify_attention(q: torch.Tensor, cache: ContiguousKVCache, layer: int, batch: FlatBatch,
                     scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """q: [heads, T, head_dim] -> [heads, T, head_dim]; the cache already holds the new K/V.
    A float16 cache under a float32 q (a float16 model, its attention run in float32) is
    read up to q's type. `softcap` > 0: scores soft-capped before the mask (Gemma 2)."""
    out = torch.empty_like(q)
    for i in range(batch.num_seqs):
        a, b = batch.seq_range(i)
        start = int(batch.starts[i])
        k, v = cache.read(layer, int(batch.slots[i]), start + b - a)
        mask = causal_window_mask(start, b - a, window)
        if softcap:
            out[:, a:b] = capped_attention(q[:, a:b], k.to(q.dtype), v.to(q.dtype), mask,
                                           scale, softcap)
            continue
        out[:, a:b] = F.scaled_dot_product_attention(
            q[None, :, a:b], k[None].to(q.dtype), v[None].to(q.dtype), attn_mask=mask,
            scale=scale, enable_gqa=True
        )[0]
    return out


class ReferenceAttention:
    """The CPU reference backend: append to a contiguous cache, then attend."""

    def __init__(self, cache: ContiguousKVCache):
        self.cache = cache

    def __call__(self, op: VerifyOp, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                 batch: FlatBatch) -> np.ndarray:
        """q [T, heads, d], k/v [T, kv, d] -> [T, heads, d]."""
        k, v, q = (torch.from_numpy(np.ascontiguousarray(x)).transpose(0, 1) for x in (k, v, q))
        self.cache.append(op.layer, k, v, batch)
        return verify_attention(q, self.cache, op.layer, batch, op.scale, op.window,
                                op.softcap).transpose(0, 1).numpy()
