"""Paged multi-token verify attention: launcher and pure-torch reference.

For a flattened batch of T new tokens from many sequences, each new token attends over its
sequence's cached positions in the head-tiled arena plus the new tokens before it:

    q [T, heads, d]        k/v arena [blocks, kv_heads, block_size, d] (one layer)
    per sequence s: its new tokens are q[qoff_s : qoff_s + new_s] at positions
    start_s .. start_s + new_s - 1, its keys the first start_s + new_s slots of its blocks
    (a layer of window W: the query at position p sees p-W+1 .. p, earlier blocks skipped)
The kernel (templates/verify_attention.py.jinja) runs one program per (sequence, KV head,
window tile) and reads each (block, KV head) tile once for the whole head group and window.
On a GPU with few sequences it also splits each sequence's blocks over programs and
combines their partial results (flash-decoding), so batch 1 at a long context still fills
the device.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from dspark.kernels.capped import capped_attention
from dspark.kernels.library import KernelLibrary

MAX_SPLITS = 32
MIN_SPLIT_BLOCKS = 4


def verify_attention_reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                               block_tables: torch.Tensor, start: torch.Tensor,
                               new: torch.Tensor, qoff: torch.Tensor, scale: float,
                               window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Gather each sequence's keys, then SDPA with a causal window mask, in fp32 (the
    soft-capped scores' own attention where softcap > 0)."""
    out = torch.empty_like(q)
    bs = k_pool.shape[2]
    for s in range(len(start)):
        a, n, length = int(qoff[s]), int(new[s]), int(start[s] + new[s])
        blocks = block_tables[s, : -(-length // bs)].long()
        keys = k_pool[blocks].transpose(0, 1).reshape(k_pool.shape[1], -1, k_pool.shape[3])
        values = v_pool[blocks].transpose(0, 1).reshape(v_pool.shape[1], -1, v_pool.shape[3])
        kpos, qpos = torch.arange(length)[None, :], (int(start[s]) + torch.arange(n))[:, None]
        mask = (kpos <= qpos) & ((kpos > qpos - window) if window else True)
        if softcap:
            o = capped_attention(q[a:a + n].transpose(0, 1).float(), keys[:, :length].float(),
                                 values[:, :length].float(), mask.to(q.device), scale,
                                 softcap)[None]
        else:
            o = F.scaled_dot_product_attention(
                q[a:a + n].transpose(0, 1)[None].float(), keys[:, :length][None].float(),
                values[:, :length][None].float(), attn_mask=mask.to(q.device), scale=scale,
                enable_gqa=True)
        out[a:a + n] = o[0].transpose(0, 1).to(q.dtype)
    return out


def num_splits(programs: int, max_blocks: int, multiprocessors: int) -> int:
    """KV splits per sequence: enough programs to fill the GPU twice over, each split at
    least MIN_SPLIT_BLOCKS blocks long, at most MAX_SPLITS (the reduce reads them all)."""
    if programs >= multiprocessors:
        return 1
    want = -(-2 * multiprocessors // programs)
    return max(1, min(want, MAX_SPLITS, max_blocks // MIN_SPLIT_BLOCKS))


def verify_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     block_tables: torch.Tensor, start: torch.Tensor, new: torch.Tensor,
                     qoff: torch.Tensor, scale: float, library: KernelLibrary,
                     max_new: int | None = None, max_len: int | None = None,
                     splits: int | None = None, out: torch.Tensor | None = None,
                     window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Launch: grid (sequences, KV heads, window tiles x KV splits), then the reduce when
    split. `max_new`/`max_len` (longest window, longest cached + new) spare a device sync
    when given; `splits` overrides the heuristic (1 on the CPU). Index tensors are int32."""
    spec = library.spec
    out = torch.empty_like(q) if out is None else out
    max_new = int(new.max()) if max_new is None else max_new
    max_blocks = -(-(int((start + new).max()) if max_len is None else max_len)
                   // spec.block_size)
    tiles = -(-max_new // spec.q_tile)
    programs = len(start) * spec.num_kv_heads * tiles
    if splits is None:
        splits = 1 if q.device.type != "cuda" else num_splits(
            programs, max_blocks, multiprocessors(q.device))
    per_split = -(-max_blocks // splits)
    splits = -(-max_blocks // per_split)  # no split left without blocks
    upcast = library.interpret and spec.dtype != "float32"
    grid = (len(start), spec.num_kv_heads, tiles * splits)
    if splits == 1:
        library.launch("verify_attention", grid, q, k_pool, v_pool, out, out, out,
                       block_tables, start, new, qoff, scale, window, softcap,
                       block_tables.stride(0), 1, per_split, upcast, False)
        return out
    part_o = torch.empty(q.shape[0], spec.num_heads, splits, spec.d_pad, dtype=torch.float32,
                         device=q.device)
    part_lse = torch.empty(q.shape[0], spec.num_heads, splits, dtype=torch.float32,
                           device=q.device)
    library.launch("verify_attention_split", grid, q, k_pool, v_pool, out, part_o, part_lse,
                   block_tables, start, new, qoff, scale, window, softcap,
                   block_tables.stride(0), splits, per_split, upcast, True)
    library.launch("verify_reduce", (q.shape[0], spec.num_heads), part_o, part_lse, out, splits)
    return out


@functools.cache
def multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count
