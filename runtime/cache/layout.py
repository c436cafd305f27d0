"""The arena's geometry at run time: its KV groups, each a block space of its own.

    arena (one allocation)
    +-- group "main"        full-attention layers of main: [blocks][kv_head][block_size][row]
    +-- group "main@512"    main's sliding-window layers (window 512), blocks of their own
    +-- group "draft"       a draft model that keeps its own cache
A group is the layers of one model (role) that share a window. Each sequence has one block
table per group: logical block b holds positions [b*block_size, (b+1)*block_size) of every
layer of the group. Full-attention groups keep every block of a sequence; a window group
keeps only the blocks its window can still read (runtime/cache/kv_arena.py frees the
rest), so it is sized for a window's worth of blocks per sequence, not a whole sequence.

The budget is split so that every group runs out at the same number of worst-case
sequences. A row is one token's keys (or values) for one KV head: `head_dim` values of the
cache dtype, and for int8 a float32 scale after them (kernels/kv_quant.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dspark.runtime.bundle.memory_plan import BLOCK_SIZES, MemoryPlan
from dspark.runtime.bundle.spec import ModelSpec
from dspark.runtime.errors import DSparkError

KV_DTYPES = ("float32", "float16", "int8")
_VALUE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}
SCALE_BYTES = 4  # an int8 row's float32 scale
IN_FLIGHT = 321  # positions a window group may write past its oldest readable one in a step:
# a prefill chunk (256 by default) or a verify window (64 drafts and the main's token)


def row_bytes(head_dim: int, dtype: str) -> int:
    """Bytes of one (token, KV head) row of keys or values."""
    return head_dim * _VALUE_BYTES[dtype] + (SCALE_BYTES if dtype == "int8" else 0)


def group_name(role: str, window: int) -> str:
    return role if window == 0 else f"{role}@{window}"


@dataclass(frozen=True)
class GroupLayout:
    name: str
    role: str
    window: int  # 0: full attention
    layers: tuple[int, ...]  # the model's layer indices in this group
    num_kv_heads: int
    head_dim: int
    dtype: str  # float32, float16 (bfloat16: a float16 model's own cache), int8
    num_blocks: int
    offset: int  # byte offset of the group in the arena
    block_size: int

    @property
    def row_bytes(self) -> int:
        return row_bytes(self.head_dim, self.dtype)

    @property
    def block_bytes(self) -> int:
        """One block of every layer of the group, keys and values."""
        return 2 * len(self.layers) * self.num_kv_heads * self.block_size * self.row_bytes

    @property
    def layer_bytes(self) -> int:
        """Keys (or values) of one layer, all blocks."""
        return self.num_blocks * self.num_kv_heads * self.block_size * self.row_bytes

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def seq_blocks(self, tokens: int, in_flight: int = IN_FLIGHT) -> int:
        """Blocks one sequence of `tokens` positions holds at most in this group."""
        full = -(-tokens // self.block_size)
        if not self.window:
            return full
        return min(full, -(-(self.window + in_flight) // self.block_size) + 1)


@dataclass(frozen=True)
class ArenaLayout:
    block_size: int
    max_seq_len: int
    budget_bytes: int
    groups: tuple[GroupLayout, ...]
    in_flight: int = IN_FLIGHT  # what the window groups were sized for beyond their window

    @property
    def total_bytes(self) -> int:
        return sum(g.nbytes for g in self.groups)

    def group(self, name: str) -> GroupLayout:
        return next(g for g in self.groups if g.name == name)

    def role_groups(self, role: str) -> tuple[GroupLayout, ...]:
        return tuple(g for g in self.groups if g.role == role)

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(g.role for g in self.groups))

    @property
    def num_blocks(self) -> int:
        """Blocks of the main model's full-attention group (or its first group)."""
        return self.groups[0].num_blocks

    @property
    def bytes_per_seq(self) -> int:
        """What one sequence of max_seq_len positions holds at most, every group."""
        return sum(g.seq_blocks(self.max_seq_len, self.in_flight) * g.block_bytes
                   for g in self.groups)

    @property
    def max_seqs(self) -> int:
        """Sequences of max_seq_len the arena holds at once."""
        return min(g.num_blocks // g.seq_blocks(self.max_seq_len, self.in_flight)
                   for g in self.groups)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def to_dict(self) -> dict:
        return {"block_size": self.block_size, "max_seq_len": self.max_seq_len,
                "budget_bytes": self.budget_bytes, "total_bytes": self.total_bytes,
                "max_seqs": self.max_seqs, "groups": [
                    {"name": g.name, "window": g.window, "layers": len(g.layers),
                     "dtype": g.dtype, "num_blocks": g.num_blocks, "bytes": g.nbytes}
                    for g in self.groups]}

    def resized(self, max_seq_len: int) -> ArenaLayout:
        """The same groups at another max sequence length (one sequence of it must fit)."""
        for g in self.groups:
            if g.seq_blocks(max_seq_len, self.in_flight) > g.num_blocks:
                raise DSparkError(f"max_seq_len {max_seq_len} needs more blocks than the "
                                  f"arena's {g.num_blocks} in group {g.name}")
        return ArenaLayout(self.block_size, max_seq_len, self.budget_bytes, self.groups,
                           self.in_flight)


def _split(spec: ModelSpec, kv_dtype: str | None) -> list[tuple[int, tuple[int, ...], str]]:
    """(window, layers, dtype) of each of a model's groups, full attention first."""
    windows = spec.windows or (0,) * spec.num_layers
    dtype = kv_dtype or spec.kv_dtype
    return [(w, tuple(i for i, x in enumerate(windows) if x == w), dtype)
            for w in sorted(set(windows))]


def arena_layout(specs: list[ModelSpec], budget_bytes: int, block_size: int,
                 max_seq_len: int, kv_dtype: str | None = None,
                 windowed: bool = True, in_flight: int = IN_FLIGHT) -> ArenaLayout:
    """Size every group of `specs` (the models that keep a cache) for `budget_bytes`, each
    given the same number of worst-case sequences. `kv_dtype`: the cache's dtype (None: each
    model's own); `windowed=False` keeps sliding-window layers with the full ones (every
    position kept, as a sequence's whole history); `in_flight`: the most positions a
    sequence writes in a step (the scheduler's), which a window group holds beyond its
    window."""
    if block_size not in BLOCK_SIZES:
        raise DSparkError(f"--block-size must be one of {BLOCK_SIZES}, got {block_size}")
    if max_seq_len < 1:
        raise DSparkError(f"--max-seq-len must be >= 1, got {max_seq_len}")
    if kv_dtype is not None and kv_dtype not in KV_DTYPES:
        raise DSparkError(f"--kv-cache-dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
    shapes = []
    for spec in specs:
        parts = _split(spec, kv_dtype) if windowed else [
            (0, tuple(range(spec.num_layers)), kv_dtype or spec.kv_dtype)]
        for window, layers, dtype in parts:
            shapes.append(GroupLayout(group_name(spec.role, window), spec.role, window, layers,
                                      spec.num_kv_heads, spec.head_dim, dtype, 0, 0,
                                      block_size))
    per_seq = sum(g.seq_blocks(max_seq_len, in_flight) * g.block_bytes for g in shapes)
    if per_seq > budget_bytes:
        raise DSparkError(
            f"the KV budget {budget_bytes / 2**20:g} MiB is too small: one sequence of "
            f"{max_seq_len} positions needs {per_seq / 2**20:.1f} MiB of KV cache "
            "(--kv-cache-memory, --max-seq-len)")
    groups, offset = [], 0
    for g in shapes:
        need = g.seq_blocks(max_seq_len, in_flight)
        blocks = max(need, math.floor(budget_bytes * need * g.block_bytes / per_seq
                                      / g.block_bytes))
        groups.append(GroupLayout(g.name, g.role, g.window, g.layers, g.num_kv_heads,
                                  g.head_dim, g.dtype, blocks, offset, block_size))
        offset += groups[-1].nbytes
    return ArenaLayout(block_size, max_seq_len, budget_bytes, tuple(groups), in_flight)


def seq_bytes(specs: list[ModelSpec], block_size: int, max_seq_len: int) -> int:
    """What one sequence of `max_seq_len` positions holds at most in the arena of `specs`
    (their window groups trimmed)."""
    return arena_layout(specs, 1 << 62, block_size, max_seq_len).bytes_per_seq


def plan_layout(plan: MemoryPlan, specs: list[ModelSpec] | None = None,
                kv_dtype: str | None = None, budget_bytes: int | None = None,
                windowed: bool = True) -> ArenaLayout:
    """The layout for a compiled memory plan's pools (their models' `specs` give the
    windows; without them every layer is full attention), at its budget or another."""
    budget = budget_bytes or plan.budget_bytes
    if specs is None:
        specs = [ModelSpec(p.role, p.num_layers, 1, p.num_kv_heads, p.head_dim, 1, p.dtype, (),
                      "", "", (), ()) for p in plan.pools]
    by_role = {s.role: s for s in specs}
    return arena_layout([by_role[p.role] for p in plan.pools if p.role in by_role], budget,
                        plan.block_size, plan.max_seq_len, kv_dtype, windowed)
