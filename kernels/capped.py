"""Soft-capped attention in torch, the reference both CPU and GPU paths are checked against
(Gemma 2's eager attention): softmax(softcap * tanh(scale * q . k / softcap), masked) @ v."""

from __future__ import annotations

import torch


def capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float, softcap: float) -> torch.Tensor:
    """q [heads, n, d], k/v [kv, L, d] (query heads grouped per KV head), mask [n, L] bool
    (True: visible) -> [heads, n, d]."""
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    scores = torch.tanh(q @ k.transpose(1, 2) * scale / softcap) * softcap
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v
