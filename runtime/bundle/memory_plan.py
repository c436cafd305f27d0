"""The unified KV memory plan: one arena for main and draft, head-tiled blocks.

    arena (one allocation)
    +-- main  layer 0 K [num_blocks][kv_heads][block_size][head_dim]
    |         layer 0 V [num_blocks][kv_heads][block_size][head_dim]
    |         ... every layer
    +-- draft layer 0 K ...
This is the plan `dsc compile` writes (memory_plan.json): the bundle's default budget, block
size and longest sequence. At load the runtime carves the arena into KV groups from it
(runtime/cache/layout.py): a group per model and attention window, each with blocks and
block tables of its own, at the budget the server is given.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from dspark.runtime.bundle.spec import ModelSpec
from dspark.runtime.errors import DSparkError

LAYOUT = "[block][kv_head][block_size][head_dim]"
BLOCK_SIZES = (16, 32, 64, 128)


@dataclass(frozen=True)
class PoolLayout:
    role: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    bytes_per_token: int
    offset: int  # byte offset of this pool in the arena
    layer_bytes: int  # one of K or V for one layer: num_blocks*kv_heads*block_size*head_dim*dtype

    @property
    def nbytes(self) -> int:
        return 2 * self.num_layers * self.layer_bytes


@dataclass(frozen=True)
class MemoryPlan:
    block_size: int
    num_blocks: int
    max_seq_len: int
    max_seqs: int
    budget_bytes: int
    pools: tuple[PoolLayout, ...]
    layout: str = LAYOUT

    @property
    def bytes_per_block(self) -> int:
        return sum(p.bytes_per_token for p in self.pools) * self.block_size

    @property
    def total_bytes(self) -> int:
        return sum(p.nbytes for p in self.pools)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def blocks_per_seq(self) -> int:
        return math.ceil(self.max_seq_len / self.block_size)

    def pool(self, role: str) -> PoolLayout:
        return next(p for p in self.pools if p.role == role)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(bytes_per_block=self.bytes_per_block, total_bytes=self.total_bytes,
                 capacity_tokens=self.capacity_tokens)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> MemoryPlan:
        pools = tuple(PoolLayout(**p) for p in d["pools"])
        keep = ("block_size", "num_blocks", "max_seq_len", "max_seqs", "budget_bytes", "layout")
        return cls(pools=pools, **{k: d[k] for k in keep})


def plan_memory(specs: list[ModelSpec], budget_bytes: int, block_size: int,
                max_seq_len: int, seq_bytes: int | None = None) -> MemoryPlan:
    """Size the arena for a byte budget; refuse a budget that cannot hold one full sequence.
    `seq_bytes`: what one sequence of max_seq_len needs (default: every position of every
    layer; the runtime's window groups keep less, runtime/cache/layout.py)."""
    if block_size not in BLOCK_SIZES:
        raise DSparkError(f"--block-size must be one of {BLOCK_SIZES}, got {block_size}")
    if max_seq_len < 1:
        raise DSparkError(f"--max-seq-len must be >= 1, got {max_seq_len}")
    per_block = sum(s.kv_bytes_per_token for s in specs) * block_size
    num_blocks = budget_bytes // per_block
    blocks_per_seq = math.ceil(max_seq_len / block_size)
    need = seq_bytes if seq_bytes is not None else blocks_per_seq * per_block
    if need > budget_bytes:
        raise DSparkError(
            f"--kv-budget-mb {budget_bytes / 2**20:g} is too small: one sequence of "
            f"--max-seq-len {max_seq_len} needs {need / 2**20:.1f} MiB of KV cache"
        )
    pools, offset = [], 0
    for s in specs:
        layer_bytes = num_blocks * s.num_kv_heads * block_size * s.head_dim * s.dtype_bytes
        pool = PoolLayout(s.role, s.num_layers, s.num_kv_heads, s.head_dim, s.kv_dtype,
                          s.kv_bytes_per_token, offset, layer_bytes)
        pools.append(pool)
        offset += pool.nbytes
    return MemoryPlan(block_size, num_blocks, max_seq_len, budget_bytes // need,
                      budget_bytes, tuple(pools))
