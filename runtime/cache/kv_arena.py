"""The unified paged KV arena: one allocation for main and draft, block tables per sequence.

    buffer (one torch allocation, zeroed)
      pool "main":  layer l K -> [num_blocks, kv_heads, block_size, head_dim]  (views)
                    layer l V -> [num_blocks, kv_heads, block_size, head_dim]
      pool "draft": ...
A sequence's block table is shared by both pools: logical block b holds positions
[b*block_size, (b+1)*block_size) in main and draft alike. Rolling back is O(1): it sets a
length; rejected slots are never copied or cleared (the next append overwrites them) and
their blocks stay with the sequence as slack, reused by its next drafts. Cache health
(dflash/che.py) releases slack and moves blocks to close holes, between engine steps.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dspark.runtime.bundle.memory_plan import MemoryPlan, PoolLayout
from dspark.runtime.errors import DSparkError

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DELTA_LOG_ENTRIES = 64


class ArenaFullError(DSparkError):
    """No free block: the caller admitted more than the arena holds."""


@dataclass(frozen=True)
class Delta:
    """One step of one sequence in one pool: positions written, then how many were kept."""

    role: str
    start: int
    written: int
    kept: int


@dataclass
class BlockTable:
    blocks: list[int] = field(default_factory=list)
    lengths: dict[str, int] = field(default_factory=dict)
    log: deque = field(default_factory=lambda: deque(maxlen=DELTA_LOG_ENTRIES))

    def length(self, role: str) -> int:
        return self.lengths.get(role, 0)


class Pool:
    """One model's K/V views into the arena buffer."""

    def __init__(self, buffer: torch.Tensor, layout: PoolLayout, plan: MemoryPlan):
        dtype = _TORCH_DTYPES[layout.dtype]
        shape = (plan.num_blocks, layout.num_kv_heads, plan.block_size, layout.head_dim)
        size = layout.layer_bytes
        def view(i: int) -> torch.Tensor:
            start = layout.offset + i * size
            return buffer[start:start + size].view(dtype).view(shape)
        self.k = [view(2 * layer) for layer in range(layout.num_layers)]
        self.v = [view(2 * layer + 1) for layer in range(layout.num_layers)]


class KVArena:
    def __init__(self, plan: MemoryPlan, delta_log: bool = True,
                 device: torch.device | None = None):
        self.plan = plan
        self.block_size = plan.block_size
        self.device = device or torch.device("cpu")
        self.buffer = torch.zeros(plan.total_bytes, dtype=torch.uint8, device=self.device)
        self.pools = {p.role: Pool(self.buffer, p, plan) for p in plan.pools}
        self.free: list[int] = list(range(plan.num_blocks))  # a heap: lowest ids first
        self.owner: dict[int, int] = {}  # block -> sequence
        self.tables: dict[int, BlockTable] = {}
        self.delta_log = delta_log
        # rollback clears the rejected slots when set (CacheHealthConfig.zero_rejected_slots);
        # a pool's attention backend may register a faster way to clear them (a kernel)
        self.zero_rejected = False
        self.zeroers: dict[str, Callable[[torch.Tensor, torch.Tensor], None]] = {}

    @property
    def free_blocks(self) -> int:
        return len(self.free)

    @property
    def used_blocks(self) -> int:
        return self.plan.num_blocks - len(self.free)

    def add_sequence(self, seq_id: int) -> None:
        self.tables[seq_id] = BlockTable()

    def release(self, seq_id: int) -> None:
        """The sequence is done (finished or cancelled): all its blocks go back."""
        for b in self.tables.pop(seq_id).blocks:
            self._free(b)

    def _free(self, block: int) -> None:
        del self.owner[block]
        heapq.heappush(self.free, block)

    def needed_blocks(self, seq_id: int) -> int:
        table = self.tables[seq_id]
        return -(-max(table.lengths.values(), default=0) // self.block_size)

    def release_slack(self, seq_id: int) -> int:
        """Return the blocks past both lengths (left by rejected drafts); how many."""
        table, keep = self.tables[seq_id], self.needed_blocks(seq_id)
        freed = len(table.blocks) - keep
        while len(table.blocks) > keep:
            self._free(table.blocks.pop())
        return freed

    def move_block(self, src: int, dst: int) -> None:
        """Copy block `src` to the free block `dst` in every pool and layer; retarget its
        owner's table. Only between forwards (nothing may be reading the arena)."""
        self.free.remove(dst)
        heapq.heapify(self.free)
        for pool in self.pools.values():
            for layer in range(len(pool.k)):
                pool.k[layer][dst] = pool.k[layer][src]
                pool.v[layer][dst] = pool.v[layer][src]
        seq = self.owner[src]
        blocks = self.tables[seq].blocks
        blocks[blocks.index(src)] = dst
        self.owner[dst] = seq
        self._free(src)

    def reserve(self, seq_id: int, role: str, start: int, count: int) -> None:
        """Make room for positions [start, start+count) of `role`; logs the write."""
        table = self.tables[seq_id]
        need = -(-(start + count) // self.block_size)
        while len(table.blocks) < need:
            if not self.free:
                raise ArenaFullError("KV arena full: no free block (raise --kv-budget-mb)")
            block = heapq.heappop(self.free)
            self.owner[block] = seq_id
            table.blocks.append(block)
        table.lengths[role] = start + count
        if self.delta_log:
            table.log.append(Delta(role, start, count, count))

    def rollback(self, seq_id: int, role: str, length: int) -> None:
        """Keep the first `length` positions of `role`: O(1), a length and a log entry."""
        table = self.tables[seq_id]
        old = table.length(role)
        table.lengths[role] = min(length, old)
        if self.zero_rejected and length < old:
            self.zero_slots(seq_id, role, length, old)
        if self.delta_log and table.log and table.log[-1].role == role:
            last = table.log[-1]
            table.log[-1] = Delta(role, last.start, last.written, max(0, length - last.start))

    def zero_slots(self, seq_id: int, role: str, start: int, end: int) -> None:
        """Clear positions [start, end) of `role` in every layer."""
        positions = torch.arange(start, end)
        table = torch.tensor(self.tables[seq_id].blocks, dtype=torch.int32)
        blocks = table[positions // self.block_size]
        offsets = (positions % self.block_size).to(torch.int32)
        zeroer = self.zeroers.get(role)
        if zeroer is not None:
            zeroer(blocks, offsets)
            return
        pool = self.pools[role]
        for k, v in zip(pool.k, pool.v):
            k[blocks.long(), :, offsets.long()] = 0
            v[blocks.long(), :, offsets.long()] = 0
