"""One model of the bundle over the shared arena: reserve slots, run the flattened batch."""

from __future__ import annotations

import logging
import time

import numpy as np

from dspark.kernels.cpu_op import int4_paths, op_library
from dspark.kernels.library import KernelLibrary, for_device
from dspark.runtime.bundle.bundle import Bundle
from dspark.runtime.cache.kv_arena import KVArena
from dspark.runtime.env import kernel_cache_dir, read_env
from dspark.runtime.model.batch import FlatBatch, SeqChunk
from dspark.runtime.model.costs import CostModel
from dspark.runtime.model.executor import SegmentedModel
from dspark.runtime.model.fused import FusedModel
from dspark.runtime.model.int4_rows import few_rows_chooser, int4_path
from dspark.runtime.model.kernel_attention import KernelAttention
from dspark.runtime.model.paged_attention import PagedAttention

log = logging.getLogger("dspark.runtime")
OP_DTYPES = ("float32", "float16", "int8")  # the KV rows the CPU op stores (cpu_kv.c)


def kernel_library(bundle: Bundle, role: str, arena: KVArena) -> KernelLibrary:
    """The DSpark kernels for `role`'s constants on the arena's device: the bundle's cubins
    when they match this GPU, else JIT (see kernels/library.py; it logs which)."""
    return for_device(bundle.kernel_spec(role), kernel_cache_dir(), arena.device,
                      bundle.kernels, bundle.root)


def cpu_model(bundle: Bundle, role: str, arena: KVArena, pool: str
              ) -> FusedModel | SegmentedModel:
    """One session with the CPU op inside when it can (a float32, float16 or int8 arena, the
    op built, not turned off by DSPARK_CPU_OP=0), else the segments with the numpy/numba
    attention.
    Low-bit projections run as MatMulInt4 on the best vector path the CPU has, or the one
    DSPARK_CPU_ISA names (int4_rows.py; DSPARK_CPU_INT4=0: not)."""
    env = read_env()
    group = arena.groups[arena.pools[pool].groups[0]].layout
    stored = group.dtype in OP_DTYPES and group.row_bytes % 4 == 0
    library = (op_library(kernel_cache_dir(), env.cc, env.cpu_march) if env.cpu_op and stored
               else None)
    if library is not None and library.path is not None:
        paths = int4_paths(library.path)
        path = int4_path(paths, env.cpu_int4, env.cpu_isa)
        # a forced path runs everywhere; else an 8-bit projection's one- and two-row calls
        # take the path measured faster there
        few = (few_rows_chooser(library.path, path, paths)
               if path is not None and env.cpu_isa is None else None)
        model = FusedModel(bundle, role, arena, pool, library.path, int4_path=path,
                           few_rows=few)
        if model.int4_projections:
            log.info("%s: %d int4 projections run as MatMulInt4 (%s)", role,
                     model.int4_projections, path)
        return model
    why = ("DSPARK_CPU_OP=0" if not env.cpu_op else f"a {group.dtype} KV cache of head_dim "
           f"{group.head_dim}" if not stored else library.reason)
    log.info("%s runs as segments: %s", role, why)
    return SegmentedModel(bundle, role, PagedAttention(arena, pool))


class ModelRunner:
    def __init__(self, bundle: Bundle, role: str, arena: KVArena, costs: CostModel | None = None,
                 pool: str | None = None, kernels: bool = False):
        """The arena's device decides the executor: onnxruntime on the CPU (one session with
        the CPU op, see cpu_model), or the CUDA executor with the DSpark kernels. `kernels`
        on the CPU runs those kernels under Triton's interpreter instead (tests)."""
        self.role = role
        self.pool = pool or role
        self.arena = arena
        self.costs = costs
        if arena.device.type == "cuda":
            from dspark.runtime.model.cuda_executor import CudaSegmentedModel

            attention = KernelAttention(arena, self.pool, kernel_library(bundle, role, arena))
            self.model = CudaSegmentedModel(bundle, role, attention, arena.device)
        elif kernels:
            attention = KernelAttention(arena, self.pool, kernel_library(bundle, role, arena))
            self.model = SegmentedModel(bundle, role, attention)
        else:
            self.model = cpu_model(bundle, role, arena, self.pool)
        self.busy_s = 0.0
        self.forwards = 0
        self.tokens = 0

    def forward(self, chunks: list[tuple[int, int, list[int]]], rows: list[int],
                cost_role: str | None = None, record: bool = True) -> list[np.ndarray]:
        """chunks: (seq_id, start, tokens); returns the last `rows[i]` logits of each (a
        chunk with 0 rows only fills the cache). `cost_role`: the cost table row to record
        the time in (default: main or draft by the model's role); `record=False`: the caller
        records a time that includes its own work on the logits."""
        t0 = time.perf_counter()
        index, end = [], 0
        for (seq_id, start, tokens), n in zip(chunks, rows):
            self.arena.reserve(seq_id, self.pool, start, len(tokens))
            end += len(tokens)
            index.extend(range(end - n, end))
        batch = FlatBatch.build([SeqChunk(i, s, tuple(t)) for i, s, t in chunks])
        logits = self.model.forward(batch, np.array(index or [end - 1], dtype=np.int64))
        elapsed = time.perf_counter() - t0
        self.busy_s += elapsed
        self.forwards += 1
        self.tokens += end
        if self.costs is not None and record:
            role = cost_role or ("main" if self.role == "main" else "draft")
            self.costs.record(role, end, elapsed, len(chunks))
        if not index:
            return [logits[:0]] * len(chunks)
        out, at = [], 0  # slices, not np.split: slow on cold caches (see FlatBatch.build)
        for n in rows:
            out.append(logits[at:at + n])
            at += n
        return out
