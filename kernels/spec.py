"""What a DSpark kernel is specialised to: a hashable spec, from a model's constants."""

from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("float32", "float16", "bfloat16")
TRITON_PTR = {"float32": "*fp32", "float16": "*fp16", "bfloat16": "*bf16"}


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class KernelSpec:
    head_dim: int
    num_heads: int
    num_kv_heads: int
    block_size: int
    dtype: str = "float32"
    q_tile: int = 16  # window positions per program (a verify window fits in one tile)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} not in {DTYPES}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 16, got {self.block_size}")

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def d_pad(self) -> int:
        """head_dim rounded up to a power of two, at least 16 (tl.dot's minimum)."""
        return max(16, next_pow2(self.head_dim))

    @property
    def rows(self) -> int:
        """Query rows per program: the head group times the window tile, a power of two."""
        return max(16, next_pow2(self.group * self.q_tile))

    @property
    def dot_precision(self) -> str:
        # fp32 models get exact fp32 products (a tf32 dot would cost ~1e-3 of the logits)
        return "ieee" if self.dtype == "float32" else "tf32"

    @property
    def tag(self) -> str:
        return (f"d{self.head_dim}_h{self.num_heads}_kv{self.num_kv_heads}_b{self.block_size}"
                f"_{self.dtype}_q{self.q_tile}")

    def describe(self) -> str:
        return (f"head_dim {self.head_dim}, {self.num_heads} heads / {self.num_kv_heads} KV "
                f"heads (group {self.group}), block {self.block_size}, {self.dtype}, "
                f"window tile {self.q_tile}")
