"""A CPU model as one onnxruntime session, its SpeculativeVerify nodes run by our custom op.

The bundle's whole graph (ModelSpec.graph_file) with each SpeculativeVerify node given the
arena and the batch's block tables as extra inputs:

    SpeculativeVerify(q, k, v, k_pool[layer], v_pool[layer], tables, starts, qoffs, news)
The pools are bound to the arena's own memory once (zero copy; the op appends to them in
place). So a step is one run() and no Python between layers: the
segmented executor (executor.py) hands each of ~31 segments to onnxruntime's pool and runs
the attention in between on one thread, which cost a decode step a seventh of its time.

Float32 arenas only (the op's arithmetic); anything else stays on the segments.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from dspark.kernels.cpu_op import ISA_PATHS, solo_ops
from dspark.runtime.bundle.bundle import Bundle
from dspark.runtime.bundle.spec import INPUT_IDS, LOGITS, LOGITS_INDEX, POSITION_IDS, VERIFY_OP
from dspark.runtime.cache.kv_arena import KVArena
from dspark.runtime.env import read_env
from dspark.runtime.model.batch import FlatBatch
from dspark.runtime.model.executor import StepClock, id_input_types
from dspark.runtime.model.int4_rows import GROUPS_SUFFIX, initializer_arrays, set_int4_paths
from dspark.runtime.model.load_gate import shared_gate
from dspark.runtime.model.quant_rows import rewrite_quantize
from dspark.runtime.model.row_ops import rewrite_rows
from dspark.runtime.model.sessions import EXTERNAL_FOLDER, make_session
from dspark.runtime.model.zero_points import split_float_zero_points

TABLES, STARTS, QOFFS, NEWS = "dspark_tables", "dspark_starts", "dspark_qoffs", "dspark_news"


def pool_inputs(layer: int) -> tuple[str, str]:
    return f"dspark_k_pool_{layer}", f"dspark_v_pool_{layer}"


def tables_input(group: str) -> str:
    """The block tables input of the SpeculativeVerify nodes of a KV group."""
    return TABLES if "@" not in group else f"{TABLES}_w{group.split('@')[1]}"


def fused_graph(bundle: Bundle, role: str, pool_shape: tuple[int, int, int],
                int4_path: str | None = None, few_rows=None,
                groups: dict[int, str] | None = None, kv_dtype: str = "float32"
                ) -> tuple[bytes, int]:
    """The role's whole graph with arena and batch inputs on every SpeculativeVerify node,
    and how many projections run as MatMulInt4. pool_shape: (kv_heads, block_size, row
    floats) of the pool the model reads (a row: one token's values of one KV head as
    `kv_dtype` stores them, cpu_kv.c). `int4_path`: run the bundle's MatMulInt4 graph
    (its projections packed by dsc compile, int4_rows.py) on that path (None: the
    MatMulNBits one); `few_rows`: set_int4_paths'. `groups`: each layer's KV group (its
    block tables; default: one). Only the graph is rewritten and serialized: the weights
    stay in the bundle's files, which onnxruntime reads."""
    groups = groups or {}
    spec = bundle.model(role)
    packed = int4_path is not None and spec.int4_graph_file is not None
    graph_path = bundle.path(spec.int4_graph_file if packed else spec.graph_file)
    model = onnx.load(str(graph_path), load_external_data=False)
    graph = model.graph
    # The compiler's value_info describes the segments' views (rotary's [T, 1, ...]), not
    # this op's outputs: onnxruntime infers what it needs.
    del graph.value_info[:]
    ops = {op.name: op for op in spec.verify_ops}
    for node in graph.node:
        if node.op_type == VERIFY_OP:
            op = ops[node.name]
            node.input.extend([*pool_inputs(op.layer), tables_input(groups.get(op.layer, "")),
                               STARTS, QOFFS, NEWS])
            # the manifest's layout is the one the runtime honours (absent: "heads")
            del node.attribute[:]
            node.attribute.extend([
                helper.make_attribute("num_heads", op.num_heads),
                helper.make_attribute("num_kv_heads", op.num_kv_heads),
                helper.make_attribute("head_dim", op.head_dim),
                helper.make_attribute("scale", float(op.scale)),
                helper.make_attribute("layout", op.layout),
                helper.make_attribute("window", op.window),
                helper.make_attribute("kv_dtype", kv_dtype),
                *([helper.make_attribute("softcap", float(op.softcap))] if op.softcap else [])])
    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    for layer in sorted({op.layer for op in spec.verify_ops}):
        for name in pool_inputs(layer):
            graph.input.append(helper.make_tensor_value_info(name, f32, ["blocks", *pool_shape]))
    for name in sorted({tables_input(groups.get(op.layer, "")) for op in spec.verify_ops}):
        graph.input.append(helper.make_tensor_value_info(name, i64, ["seqs", "max_blocks"]))
    for name in (STARTS, QOFFS, NEWS):
        graph.input.append(helper.make_tensor_value_info(name, i64, ["seqs"]))
    folder = graph_path.parent
    if read_env().cpu_rows:
        rewrite_rows(model, folder)
        rewrite_quantize(model, folder)
    rewritten = (set_int4_paths(model, folder, read_env().threads, ISA_PATHS.index(int4_path),
                                few_rows) if packed else 0)
    split_float_zero_points(model, folder)  # those MatMulInt4 did not take
    return model.SerializeToString(), rewritten


def packed_groups(bundle: Bundle, role: str) -> dict[str, np.ndarray]:
    """The role's packed int4 groups read into this process's memory, by initializer name
    (none without a MatMulInt4 graph). Mapped from the bundle's file instead, onnxruntime
    stepped slower (page-cache pages, not the huge pages glibc gives our buffers:
    bench/bench_bundles.py --mapped-groups); read here, they are held once, shared by every
    session of the model."""
    spec = bundle.model(role)
    if spec.int4_graph_file is None:
        return {}
    path = bundle.path(spec.int4_graph_file)
    graph = onnx.load(str(path), load_external_data=False).graph
    tensors = [t for t in graph.initializer if t.name.endswith(GROUPS_SUFFIX)]
    return dict(zip((t.name for t in tensors), initializer_arrays(tensors, path.parent)))


def block_tables(arena: KVArena, batch: FlatBatch, news: list[int], groups: tuple[str, ...],
                 dtype=np.int64) -> dict[str, np.ndarray]:
    """Per group, each sequence's blocks up to its last new token, [sequences, blocks]."""
    bs = arena.block_size
    counts = [-(-(start + n) // bs) for start, n in zip(batch.starts.tolist(), news)]
    out = {}
    for group in groups:
        tables = np.zeros((len(counts), max(counts)), dtype)
        for i, slot in enumerate(batch.slots.tolist()):
            blocks = arena.tables[slot].blocks[group][: counts[i]]
            tables[i, : len(blocks)] = blocks
        out[group] = tables
    return out


class FusedModel:
    def __init__(self, bundle: Bundle, role: str, arena: KVArena, pool: str, library: Path,
                 profile_prefix: str | None = None, int4_path: str | None = None,
                 few_rows=None):
        """`pool`: the arena pool the model's attention reads and writes (a draft that shares
        the main's cache reads the main's). `library`: kernels/cpu_op.py's build.
        `int4_path`: run its low-bit projections as MatMulInt4 on it, and `few_rows` picks
        an 8-bit one's path for one or two rows (see fused_graph).
        While other processes hold the cores the pool counts on (load_gate.py), its forwards
        run our ops' work on the calling thread (the library's solo switch); under
        DSPARK_THREADS=adaptive it has a session on its own pool and one without, and those
        forwards take the one without."""
        self.spec = bundle.model(role)
        self.arena = arena
        self.pool = pool
        self.library = library
        self.int4_path = int4_path
        self.groups = arena.pools[pool].group_of
        layout = arena.groups[self.groups[self.spec.verify_ops[0].layer]].layout
        graph, self.int4_projections = fused_graph(
            bundle, role, (layout.num_kv_heads, layout.block_size, layout.row_bytes // 4),
            int4_path, few_rows, {op.layer: self.groups[op.layer] for op in self.spec.verify_ops},
            layout.dtype)
        config = {EXTERNAL_FOLDER: str(bundle.path(self.spec.graph_file).parent)}
        adaptive = read_env().adaptive
        groups = packed_groups(bundle, role) if self.int4_projections else {}
        self.session = make_session(graph, custom_ops=library, profile_prefix=profile_prefix,
                                    config=config, initializers=groups)
        self.sessions = [self.session]
        self.layers = sorted({op.layer for op in self.spec.verify_ops})
        self.input_types = id_input_types(self.sessions)
        self.binding = self._bound(self.session)
        # forwards while other processes hold cores: our ops off the pool, or under
        # `adaptive` the same graph without a pool (None: every forward on the session above)
        self.gate = shared_gate() if read_env().follow_load else None
        self.solo_ops = solo_ops(library) if self.gate is not None else None
        self.solo, self.solo_binding = None, None
        if adaptive:
            self.solo = make_session(graph, custom_ops=library, config=config, solo=True,
                                     initializers=groups)
            self.solo_binding = self._bound(self.solo)
        self.solo_forwards = 0

    def _bound(self, session):
        """An IO binding of `session` with the arena's pools bound in place (zero copy)."""
        binding = session.io_binding()
        pool = self.arena.pools[self.pool]
        for layer in self.layers:
            rows = self.arena.groups[self.groups[layer]].layout.row_bytes // 4
            for name, tensor in zip(pool_inputs(layer), (pool.k[layer], pool.v[layer])):
                binding.bind_input(name, "cpu", 0, np.float32, [*tensor.shape[:3], rows],
                                   tensor.data_ptr())
        return binding

    def _tables(self, batch: FlatBatch, news: list[int]) -> dict[str, np.ndarray]:
        """Per KV group, [sequences, blocks]: the arena block of each sequence's logical
        blocks (reserved by the caller up to its last new token; -1 where a window group
        dropped one); `news`: each sequence's new tokens."""
        return block_tables(self.arena, batch, news, self.arena.pools[self.pool].groups)

    def forward(self, batch: FlatBatch, rows: np.ndarray | None = None,
                clock: StepClock | None = None) -> np.ndarray:
        """Logits [len(rows), vocab] for the chosen rows (default: every row), as
        SegmentedModel.forward."""
        solo = self.gate is not None and self.gate.check()
        if self.solo is not None and solo:
            session, io = self.solo, self.solo_binding
        else:
            session, io = self.session, self.binding
            if self.solo_ops is not None:
                self.solo_ops.set(solo)
        self.solo_forwards += solo
        # the batch's arrays are int64 already: asarray binds them without a copy (numpy
        # calls here are slow: the forward before left the caches cold)
        types = self.input_types
        io.bind_cpu_input(INPUT_IDS, np.asarray(batch.token_ids[None],
                                                types.get(INPUT_IDS, np.int64)))
        if POSITION_IDS in types:
            io.bind_cpu_input(POSITION_IDS, np.asarray(batch.positions[None],
                                                       types[POSITION_IDS]))
        selects = LOGITS_INDEX in self.spec.inputs
        if selects:
            io.bind_cpu_input(LOGITS_INDEX, np.arange(batch.num_tokens, dtype=np.int64)
                              if rows is None else np.asarray(rows, np.int64))
        cu = batch.cu_seqlens.tolist()
        news = [b - a for a, b in zip(cu, cu[1:])]
        for group, tables in self._tables(batch, news).items():
            io.bind_cpu_input(tables_input(group), tables)
        io.bind_cpu_input(STARTS, batch.starts)
        io.bind_cpu_input(QOFFS, batch.cu_seqlens[:-1])
        io.bind_cpu_input(NEWS, np.array(news, np.int64))
        io.bind_output(LOGITS, "cpu")  # a fresh output each run: its row count varies
        if clock is not None:
            clock.lap("feeds")
        session.run_with_iobinding(io)
        logits = io.copy_outputs_to_cpu()[0][0]
        if clock is not None:
            clock.lap("segment")
        return logits if rows is None or selects else logits[rows]
