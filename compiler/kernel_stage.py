"""The kernel seam of stage 2: model constants in, kernel artifacts (path -> bytes) out.

DSpark kernels register renderers in `dspark.kernels.registry.RENDERERS`; each receives the
constants of one model and returns files for the bundle's kernels/ folder.
"""

from __future__ import annotations

from dataclasses import dataclass

from dspark.kernels.registry import RENDERERS
from dspark.runtime.memory_plan import MemoryPlan
from dspark.runtime.spec import ModelSpec


@dataclass(frozen=True)
class KernelConstants:
    role: str
    head_dim: int
    num_heads: int
    num_kv_heads: int
    block_size: int
    dtype: str

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads


def kernel_constants(spec: ModelSpec, plan: MemoryPlan) -> KernelConstants:
    return KernelConstants(spec.role, spec.head_dim, spec.num_heads, spec.num_kv_heads,
                           plan.block_size, spec.kv_dtype)


def render_kernels(constants: list[KernelConstants]) -> dict[str, bytes]:
    """Files for kernels/, from every registered renderer; empty while none is registered."""
    files: dict[str, bytes] = {}
    for name in sorted(RENDERERS):
        files.update(RENDERERS[name](constants))
    return files
