"""The unified paged KV arena: one allocation, carved into KV groups (layout.py), a block
table per sequence and group.

    buffer (one torch allocation, zeroed)
      group "main":     layer l K -> [num_blocks, kv_heads, block_size, row]  (views)
                        layer l V -> ...
      group "main@512": the sliding-window layers, blocks of their own
      group "draft":    a draft model with a cache of its own
Logical block b of a sequence holds its positions [b*block_size, (b+1)*block_size) in
every layer of a group. Blocks may be shared between sequences (a cached prefix, forked
choices): a shared block is never written; a write into one copies it to a block of the
sequence's own first. Rolling back is O(1): it sets a length; rejected slots are neither
copied nor cleared (the next append overwrites them), and their blocks stay with the
sequence as slack until cache health (dflash/che.py) releases them. A window group drops
the blocks its window can no longer reach (`trim`), so its blocks track a window's worth
of positions per sequence, not the whole history.
"""

from __future__ import annotations

import mmap
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dspark.runtime.bundle.memory_plan import MemoryPlan
from dspark.runtime.cache.block_pool import ArenaFullError, BlockPool
from dspark.runtime.cache.layout import ArenaLayout, GroupLayout, plan_layout

__all__ = ["ArenaFullError", "Delta", "KVArena", "SeqTable"]

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16,
                 "bfloat16": torch.bfloat16, "int8": torch.uint8}
DELTA_LOG_ENTRIES = 64
NO_BLOCK = -1  # a table entry whose block left the group's window
UNBOUNDED = 1 << 30


@dataclass(frozen=True)
class Delta:
    """One step of one sequence in one pool: positions written, then how many were kept."""

    role: str
    start: int
    written: int
    kept: int


@dataclass
class SeqTable:
    """One sequence's blocks per group, lengths per model (role)."""

    blocks: dict[str, list[int]] = field(default_factory=dict)
    lengths: dict[str, int] = field(default_factory=dict)
    log: deque = field(default_factory=lambda: deque(maxlen=DELTA_LOG_ENTRIES))
    keys: list[bytes] = field(default_factory=list)  # prefix keys of its full blocks
    sealed: dict[str, int] = field(default_factory=dict)  # group -> blocks registered
    promised: int = UNBOUNDED  # positions it may fill (its reservation)

    def length(self, role: str) -> int:
        return self.lengths.get(role, 0)


def _zeroed(nbytes: int, device: torch.device) -> torch.Tensor:
    """`nbytes` of zeros. On the CPU an anonymous mapping: its pages are the kernel's zero
    page until first written, so a large arena costs neither start-up time nor resident
    memory for the blocks no sequence has used yet."""
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(nbytes, dtype=torch.uint8, device=device)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)


class Group:
    """One group's views into the arena buffer and its blocks."""

    def __init__(self, buffer: torch.Tensor, layout: GroupLayout):
        self.layout = layout
        self.blocks = BlockPool(layout.num_blocks)
        dtype = _TORCH_DTYPES[layout.dtype]
        width = layout.head_dim if layout.dtype != "int8" else layout.row_bytes
        shape = (layout.num_blocks, layout.num_kv_heads, layout.block_size, width)
        size = layout.layer_bytes

        def view(i: int) -> torch.Tensor:
            start = layout.offset + i * size
            return buffer[start:start + size].view(dtype).view(shape)
        self.k = [view(2 * i) for i in range(len(layout.layers))]
        self.v = [view(2 * i + 1) for i in range(len(layout.layers))]


class Pool:
    """One model's K/V views by layer, whichever group a layer is in."""

    def __init__(self, groups: list[Group]):
        count = 1 + max(layer for g in groups for layer in g.layout.layers)
        self.k: list[torch.Tensor] = [None] * count  # type: ignore[list-item]
        self.v: list[torch.Tensor] = [None] * count  # type: ignore[list-item]
        self.group_of: list[str] = [""] * count
        for g in groups:
            for i, layer in enumerate(g.layout.layers):
                self.k[layer], self.v[layer] = g.k[i], g.v[i]
                self.group_of[layer] = g.layout.name
        self.groups = tuple(g.layout.name for g in groups)


class KVArena:
    def __init__(self, layout: ArenaLayout | MemoryPlan, delta_log: bool = True,
                 device: torch.device | None = None):
        """`layout`: the arena's groups (a compiled MemoryPlan: one full group per pool)."""
        if isinstance(layout, MemoryPlan):
            layout = plan_layout(layout)
        self.layout = layout
        self.block_size = layout.block_size
        self.device = device or torch.device("cpu")
        self.buffer = _zeroed(layout.total_bytes, self.device)
        self.groups = {g.name: Group(self.buffer, g) for g in layout.groups}
        self.pools = {role: Pool([self.groups[g.name] for g in layout.role_groups(role)])
                      for role in layout.roles}
        self.tables: dict[int, SeqTable] = {}
        self.delta_log = delta_log
        # rollback clears the rejected slots when set (CacheHealthConfig.zero_rejected_slots);
        # a pool's attention backend may register a faster way to clear them (a kernel)
        self.zero_rejected = False
        self.zeroers: dict[str, Callable[[str, torch.Tensor, torch.Tensor], None]] = {}
        self.copies = 0  # shared blocks copied before a write

    # -- what the scheduler and the metrics read ---------------------------------------
    @property
    def main(self) -> Group:
        return next(iter(self.groups.values()))

    @property
    def free_blocks(self) -> int:
        return self.main.blocks.available

    @property
    def used_blocks(self) -> int:
        return self.main.blocks.held

    def usage(self) -> float:
        """The fullest group's held fraction."""
        return max(g.blocks.held / g.layout.num_blocks for g in self.groups.values())

    def role_groups(self, role: str) -> tuple[str, ...]:
        return self.pools[role].groups

    # -- sequences ------------------------------------------------------------------------
    def add_sequence(self, seq_id: int, promised: int = UNBOUNDED) -> SeqTable:
        table = self.tables[seq_id] = SeqTable(
            blocks={name: [] for name in self.groups}, promised=promised)
        return table

    def attach(self, seq_id: int, group: str, blocks: list[int]) -> None:
        """Start `group`'s table with cached blocks (NO_BLOCK: one a window no longer
        needs), held from now on."""
        pool = self.groups[group].blocks
        for b in blocks:
            if b != NO_BLOCK:
                pool.hold(b)
        self.tables[seq_id].blocks[group] = list(blocks)

    def fork(self, parent: int, child: int, promised: int = UNBOUNDED) -> None:
        """`child` starts with `parent`'s blocks and lengths, every block shared."""
        src = self.tables[parent]
        table = self.add_sequence(child, promised)
        for name, blocks in src.blocks.items():
            keep = blocks[:-(-max(src.lengths.values(), default=0) // self.block_size)]
            self.attach(child, name, keep)
        table.lengths = dict(src.lengths)
        table.keys = list(src.keys)
        table.sealed = dict(src.sealed)

    def release(self, seq_id: int) -> None:
        """The sequence is done (finished or cancelled): its blocks go back, its last ones
        first (a cached prefix's head is evicted last)."""
        table = self.tables.pop(seq_id)
        for name, blocks in table.blocks.items():
            pool = self.groups[name].blocks
            for b in reversed(blocks):
                if b != NO_BLOCK:
                    pool.drop(b)

    def needed_blocks(self, seq_id: int) -> int:
        table = self.tables[seq_id]
        return -(-max(table.lengths.values(), default=0) // self.block_size)

    def release_slack(self, seq_id: int) -> int:
        """Return the blocks past every length (left by rejected drafts); how many."""
        table, keep = self.tables[seq_id], self.needed_blocks(seq_id)
        freed = 0
        for name, blocks in table.blocks.items():
            pool = self.groups[name].blocks
            while len(blocks) > keep:
                b = blocks.pop()
                if b != NO_BLOCK:
                    pool.drop(b)
                    freed += 1
        return freed

    def reserve(self, seq_id: int, role: str, start: int, count: int) -> None:
        """Make room for positions [start, start+count) of `role` in each of its groups
        (a shared block in the range is copied first); logs the write."""
        table = self.tables[seq_id]
        first, end = start // self.block_size, -(-(start + count) // self.block_size)
        for name in self.pools[role].groups:
            blocks, pool = table.blocks[name], self.groups[name].blocks
            while len(blocks) < end:
                blocks.append(NO_BLOCK)
            for i in range(first, end):
                b = blocks[i]
                if b == NO_BLOCK:
                    blocks[i] = pool.take()
                elif pool.refs[b] > 1 or b in pool.key_of:
                    blocks[i] = self._copy(name, b)
        table.lengths[role] = start + count
        if self.delta_log:
            table.log.append(Delta(role, start, count, count))

    def _copy(self, name: str, block: int) -> int:
        """A private copy of `block` for the writer (copy on write): a shared block keeps
        its other holders, a registered one its key and content."""
        group = self.groups[name]
        pool = group.blocks
        fresh = pool.take()  # `block` is held: never the one evicted
        for k, v in zip(group.k, group.v):
            k[fresh] = k[block]
            v[fresh] = v[block]
        pool.drop(block)
        self.copies += 1
        return fresh

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

    def trim(self, seq_id: int, role: str, final: int) -> int:
        """Positions below `final` of `role` are final and no later query of it starts
        before `final` - 1: each window group drops the blocks its window cannot reach
        any more (they stay cached where registered). How many it dropped."""
        table, dropped = self.tables[seq_id], 0
        for name in self.pools[role].groups:
            window = self.groups[name].layout.window
            if not window:
                continue
            # the query at final-1 (a re-read of the last token) sees final-window onward
            reach = max(0, final - window - 1) // self.block_size
            blocks, pool = table.blocks[name], self.groups[name].blocks
            for i in range(min(reach, len(blocks))):
                if blocks[i] != NO_BLOCK:
                    pool.drop(blocks[i])
                    blocks[i] = NO_BLOCK
                    dropped += 1
        return dropped

    def move_block(self, name: str, src: int, dst: int) -> None:
        """Copy block `src` of group `name` to the free block `dst` in every layer and
        retarget every table holding it. Only between forwards (nothing reads the arena)."""
        group = self.groups[name]
        for k, v in zip(group.k, group.v):
            k[dst] = k[src]
            v[dst] = v[src]
        group.blocks.move(src, dst)
        for table in self.tables.values():
            blocks = table.blocks[name]
            for i, b in enumerate(blocks):
                if b == src:
                    blocks[i] = dst

    def zero_slots(self, seq_id: int, role: str, start: int, end: int) -> None:
        """Clear positions [start, end) of `role` in every layer."""
        positions = torch.arange(start, end)
        for name in self.pools[role].groups:
            table = torch.tensor(self.tables[seq_id].blocks[name], dtype=torch.int32)
            blocks = table[positions // self.block_size]
            offsets = (positions % self.block_size).to(torch.int32)
            zeroer = self.zeroers.get(role)
            if zeroer is not None:
                zeroer(name, blocks, offsets)
                continue
            group = self.groups[name]
            for k, v in zip(group.k, group.v):
                k[blocks.long(), :, offsets.long()] = 0
                v[blocks.long(), :, offsets.long()] = 0
