"""Paged multi-token verify attention: launcher and pure-torch reference.

For a flattened batch of T new tokens from many sequences, each new token attends over its
sequence's cached positions in the head-tiled arena plus the new tokens before it:

    q [T, heads, d]        k/v arena [blocks, kv_heads, block_size, d] (one layer)
    per sequence s: its new tokens are q[qoff_s : qoff_s + new_s] at positions
    start_s .. start_s + new_s - 1, its keys the first start_s + new_s slots of its blocks
The kernel (templates/verify_attention.py.jinja) runs one program per (sequence, KV head,
window tile) and reads each (block, KV head) tile once for the whole head group and window.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dspark.kernels.render import load
from dspark.kernels.spec import KernelSpec


def verify_attention_reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                               block_tables: torch.Tensor, start: torch.Tensor,
                               new: torch.Tensor, qoff: torch.Tensor, scale: float
                               ) -> torch.Tensor:
    """Gather each sequence's keys, then SDPA with a causal window mask, in fp32."""
    out = torch.empty_like(q)
    bs = k_pool.shape[2]
    for s in range(len(start)):
        a, n, length = int(qoff[s]), int(new[s]), int(start[s] + new[s])
        blocks = block_tables[s, : -(-length // bs)].long()
        keys = k_pool[blocks].transpose(0, 1).reshape(k_pool.shape[1], -1, k_pool.shape[3])
        values = v_pool[blocks].transpose(0, 1).reshape(v_pool.shape[1], -1, v_pool.shape[3])
        mask = torch.arange(length)[None, :] <= (int(start[s]) + torch.arange(n))[:, None]
        o = F.scaled_dot_product_attention(
            q[a:a + n].transpose(0, 1)[None].float(), keys[:, :length][None].float(),
            values[:, :length][None].float(), attn_mask=mask.to(q.device), scale=scale,
            enable_gqa=True)
        out[a:a + n] = o[0].transpose(0, 1).to(q.dtype)
    return out


def verify_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     block_tables: torch.Tensor, start: torch.Tensor, new: torch.Tensor,
                     qoff: torch.Tensor, scale: float, spec: KernelSpec, cache_dir: str,
                     max_new: int | None = None, interpret: bool = False,
                     num_warps: int = 4) -> torch.Tensor:
    """Launch: grid (sequences, KV heads, window tiles). Index tensors are int32."""
    kernel = load("verify_attention", spec, cache_dir, interpret)._verify_attention_kernel
    out = torch.empty_like(q)
    max_new = int(new.max()) if max_new is None else max_new
    grid = (len(start), spec.num_kv_heads, -(-max_new // spec.q_tile))
    kernel[grid](q, k_pool, v_pool, out, block_tables, start, new, qoff, scale,
                 block_tables.stride(0), UPCAST=interpret and spec.dtype != "float32",
                 num_warps=num_warps)
    return out
