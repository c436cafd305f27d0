"""The attention backends' tensors: token rows, whatever layout the bundle's graph uses.

Backends take q [T, heads, dim], k/v [T, kv_heads, dim] and return [T, heads, dim]: the
kernels' own layout. A "heads" op ([1, heads, T, dim], as exported) is a swapped view of
that; a "tokens" op (any shape, token-major) a reshaped one. Works on numpy arrays and torch
tensors alike; what goes back to onnxruntime is contiguous.
"""

from __future__ import annotations

import numpy as np

from dspark.runtime.bundle.spec import VerifyOp


def rows(x, op: VerifyOp, heads: int):
    """One of q/k/v as [T, heads, dim] (a view)."""
    if op.layout == "tokens":
        return x.reshape(-1, heads, op.head_dim)
    return x[0].swapaxes(0, 1)


def from_rows(out, op: VerifyOp):
    """The backend's [T, heads, dim] as the graph's `out`, contiguous."""
    if op.layout == "tokens":
        out = out.reshape(1, -1, op.num_heads * op.head_dim)
    else:
        out = out.swapaxes(0, 1)[None]
    return np.ascontiguousarray(out) if isinstance(out, np.ndarray) else out.contiguous()


def attend_rows(attention, op: VerifyOp, q, k, v, batch):
    """Run a token-row backend on the graph's tensors."""
    heads, kv = op.num_heads, op.num_kv_heads
    return from_rows(attention(op, rows(q, op, heads), rows(k, op, kv), rows(v, op, kv), batch),
                     op)
