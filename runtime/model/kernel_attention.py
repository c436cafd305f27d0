"""SpeculativeVerify with the DSpark Triton kernels over the arena, on the arena's device.

Per forward (shared by every layer), int32 metadata on the device: block tables
[sequences, max blocks], cached lengths, new lengths, query offsets, and each new token's
(block, offset) slot. Per layer:

    k/v [T, kv_heads, d] --kv_inject--> arena slots
    q   [T, heads, d]    --verify_attention--> [T, heads, d]
On a GPU the tensors are torch CUDA tensors (the CUDA executor); on the CPU this backend takes
numpy arrays and runs the kernels under Triton's interpreter, which is only for tests: the
same launches the GPU makes, proven lossless through the whole engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dspark.kernels.kv_cache import kv_inject, kv_zero
from dspark.kernels.library import KernelLibrary
from dspark.kernels.verify_attention import verify_attention
from dspark.runtime.bundle.spec import VerifyOp
from dspark.runtime.cache.kv_arena import KVArena
from dspark.runtime.model.batch import FlatBatch


@dataclass(frozen=True)
class LaunchMeta:
    tables: torch.Tensor  # [seqs, max blocks] int32
    start: torch.Tensor  # [seqs] int32
    new: torch.Tensor
    qoff: torch.Tensor
    slot_block: torch.Tensor  # [T] int32: each new token's arena block
    slot_offset: torch.Tensor  # [T] int32: and its offset inside it
    max_new: int
    max_len: int


def launch_meta(arena: KVArena, batch: FlatBatch, device: torch.device, group: str
                ) -> LaunchMeta:
    """The launches' metadata for `group`'s block tables (a window group's dropped blocks
    are -1: the kernel skips the blocks before a tile's first query's window)."""
    bs = arena.block_size
    lengths = batch.starts + np.diff(batch.cu_seqlens)
    width = int(-(-lengths.max() // bs))
    tables = np.zeros((batch.num_seqs, width), np.int32)
    slot_block = np.empty(batch.num_tokens, np.int32)
    for i in range(batch.num_seqs):
        blocks = arena.tables[int(batch.slots[i])].blocks[group][: -(-int(lengths[i]) // bs)]
        tables[i, : len(blocks)] = blocks
        a, b = batch.seq_range(i)
        slot_block[a:b] = tables[i, batch.positions[a:b] // bs]
    as_dev = lambda x: torch.from_numpy(np.ascontiguousarray(x, np.int32)).to(device)  # noqa: E731
    return LaunchMeta(as_dev(tables), as_dev(batch.starts), as_dev(np.diff(batch.cu_seqlens)),
                      as_dev(batch.cu_seqlens[:-1]), as_dev(slot_block),
                      as_dev(batch.positions % bs), int(np.diff(batch.cu_seqlens).max()),
                      int(lengths.max()))


class KernelAttention:
    """The kernel-backed attention of one model (`role`) over the shared arena."""

    def __init__(self, arena: KVArena, role: str, library: KernelLibrary):
        self.arena = arena
        self.role = role
        self.library = library
        self.device = arena.buffer.device
        self.group_of = arena.pools[role].group_of
        self._batch: FlatBatch | None = None
        self._meta: dict[str, LaunchMeta] = {}
        arena.zeroers[role] = self.zero

    def meta(self, batch: FlatBatch, group: str) -> LaunchMeta:
        if batch is not self._batch:
            self._batch, self._meta = batch, {}
        if group not in self._meta:
            self._meta[group] = launch_meta(self.arena, batch, self.device, group)
        return self._meta[group]

    def __call__(self, op: VerifyOp, q, k, v, batch: FlatBatch):
        host = isinstance(q, np.ndarray)
        if host:
            q, k, v = (torch.from_numpy(x) for x in (q, k, v))
        meta = self.meta(batch, self.group_of[op.layer])
        pool = self.arena.pools[self.role]
        k_pool, v_pool = pool.k[op.layer], pool.v[op.layer]
        q, k, v = (x.contiguous() for x in (q, k, v))
        kv_inject(k, v, k_pool, v_pool, meta.slot_block, meta.slot_offset, self.library)
        out = verify_attention(q, k_pool, v_pool, meta.tables, meta.start, meta.new,
                               meta.qoff, op.scale, self.library, meta.max_new, meta.max_len,
                               window=op.window, softcap=op.softcap)
        return out.numpy() if host else out

    def zero(self, group: str, blocks: torch.Tensor, offsets: torch.Tensor) -> None:
        """Clear rejected slots in every layer of `group` (the config's
        zero_rejected_slots)."""
        views = self.arena.groups[group]
        blocks, offsets = blocks.to(self.device), offsets.to(self.device)
        for k_pool, v_pool in zip(views.k, views.v):
            kv_zero(k_pool, v_pool, blocks, offsets, self.library)
