"""Rotary position embedding as one onnxruntime `RotaryEmbedding` op per q and per k.

Classic exports spell Hugging Face's rotate_half rotary in eight ops per tensor:

    x --Slice[..., :h]---------------------+
    x --Slice[..., h:]--Neg--Concat(-x2, x1)--Mul(sin)--+
    x ----------------------------------------Mul(cos)--+--Add--> y       (h = head_dim / 2)
cos and sin are [..., T, head_dim] functions of position_ids (each half repeated). They
become tables [max_positions, h] that the contrib op (com.microsoft, CPU and CUDA) reads at
position_ids, one token per batch row (see _emit for why):

    x_pre [1, T, heads, head_dim] -> [T, 1, heads * head_dim]
        --RotaryEmbedding(position_ids [T, 1], cos_table, sin_table)--> back to y
The tables come from running the graph's own cos/sin subgraph over every position. They are
used only if each position's row is the same whichever other positions are in the batch
(dynamic rope scaling, where they are not, stays unfused), and only for a y that
SpeculativeVerify reads as q or k, whose shape the probes proved [1, heads, T, head_dim].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from dspark.compiler.passes.graph_util import cast_to, producer
from dspark.runtime.bundle.spec import POSITION_IDS, VERIFY_OP

CONTRIB = "com.microsoft"


@dataclass(frozen=True)
class RotaryMatch:
    add: gs.Node
    x: gs.Variable
    cos: gs.Variable
    sin: gs.Variable
    half: int


def _const_ints(t: gs.Tensor) -> list[int] | None:
    if isinstance(t, gs.Constant) and t.values.dtype.kind == "i" and t.values.ndim <= 1:
        return [int(v) for v in np.atleast_1d(t.values)]
    return None


def _last_axis_slice(node: gs.Node | None) -> tuple[gs.Tensor, int, int] | None:
    """(data, start, end) of a Slice of the last axis (rank 4) with step 1."""
    if node is None or len(node.inputs) < 4:
        return None
    starts, ends, axes = (_const_ints(t) for t in node.inputs[1:4])
    steps = _const_ints(node.inputs[4]) if len(node.inputs) > 4 else [1]
    if None in (starts, ends, axes, steps) or not (len(starts) == len(ends) == len(axes) == 1):
        return None
    if axes[0] not in (-1, 3) or steps != [1]:
        return None
    return node.inputs[0], starts[0], ends[0]


def uncast(t: gs.Tensor) -> gs.Tensor:
    """t before a Cast up to float32 (a float16 model's: onnxruntime slices in float16 and
    computes in float32, passes/attention.py `widening`)."""
    node = producer(t, "Cast")
    return node.inputs[0] if node is not None and node.attrs.get("to") == 1 else t


def _rotate_half(rot: gs.Tensor) -> tuple[gs.Tensor, int] | None:
    """x and h if rot == Concat(-x[..., h:], x[..., :h]) on the last axis."""
    concat = producer(rot, "Concat")
    if concat is None or concat.attrs.get("axis") not in (-1, 3) or len(concat.inputs) != 2:
        return None
    neg = producer(concat.inputs[0], "Neg")
    upper = _last_axis_slice(producer(uncast(neg.inputs[0]), "Slice")) if neg else None
    lower = _last_axis_slice(producer(uncast(concat.inputs[1]), "Slice"))
    if upper is None or lower is None or upper[0] is not lower[0]:
        return None
    (x, hi_start, hi_end), (_, lo_start, lo_end) = upper, lower
    if lo_start != 0 or hi_start != lo_end or hi_start <= 0 or hi_end < 2 * hi_start:
        return None
    return x, hi_start


def _match(add: gs.Node) -> RotaryMatch | None:
    muls = [producer(t, "Mul") for t in add.inputs]
    if len(muls) != 2 or any(m is None for m in muls):
        return None
    for plain, rotated in (muls, muls[::-1]):
        for a, b in (rotated.inputs, rotated.inputs[::-1]):
            found = _rotate_half(a)
            if found is None or all(uncast(t) is not found[0] for t in plain.inputs):
                continue
            x, half = found
            cos = plain.inputs[1] if uncast(plain.inputs[0]) is x else plain.inputs[0]
            if isinstance(cos, gs.Variable) and isinstance(b, gs.Variable):
                return RotaryMatch(add, x, cos, b, half)
    return None


def _slot(node: gs.Node, t: gs.Tensor) -> int:
    return next(i for i, x in enumerate(node.inputs) if x is t)


def _reader(y: gs.Variable) -> tuple[gs.Node, bool] | None:
    """The SpeculativeVerify reading y as q or k (past a float16 model's casts: its k is
    rounded to float16 and cast up for the cache), and whether as q; else None."""
    while len(y.outputs) == 1 and y.outputs[0].op == "Cast":
        y = y.outputs[0].outputs[0]
    node = y.outputs[0] if y.outputs else None
    if node is None or node.op != VERIFY_OP or any(c is not node for c in y.outputs):
        return None
    slot = _slot(node, y)
    return (node, slot == 0) if slot <= 1 else None


def find_rotary(graph: gs.Graph) -> tuple[list[RotaryMatch], list[str]]:
    """Rotaries whose result SpeculativeVerify reads as q or k, and the names of the Adds
    that looked like a rotary (a Mul of a rotate_half) but do not feed one."""
    found, unusable = [], []
    for node in graph.nodes:
        if node.op != "Add" or len(node.outputs) != 1:
            continue
        m = _match(node)
        if m is None:
            continue
        if _reader(node.outputs[0]) is not None:
            found.append(m)
        else:
            unusable.append(f"{node.name} (not read by SpeculativeVerify as q or k)")
    return found, unusable


def _ancestors(outputs: list[gs.Variable]) -> list[gs.Node]:
    seen: dict[int, gs.Node] = {}
    stack = [t for t in outputs]
    while stack:
        t = stack.pop()
        for node in t.inputs:
            if id(node) not in seen:
                seen[id(node)] = node
                stack.extend(node.inputs)
    return list(seen.values())


class TableMaker:
    """Runs the graph's cos/sin subgraph (position_ids -> cos, sin) at chosen positions."""

    def __init__(self, graph: gs.Graph, cos: gs.Variable, sin: gs.Variable):
        nodes = _ancestors([cos, sin])
        sources = {t.name: t for n in nodes for t in n.inputs
                   if isinstance(t, gs.Variable) and not t.inputs and t.name}
        self.session = None
        if set(sources) != {POSITION_IDS}:
            return
        from dspark.compiler.lazy_weights import session_bytes
        from dspark.runtime.model.sessions import make_session

        sub = gs.Graph(nodes=nodes, inputs=[sources[POSITION_IDS]], outputs=[cos, sin],
                       opset=graph.opset, import_domains=graph.import_domains)
        self.dtype = np.dtype(sources[POSITION_IDS].dtype or np.int64)
        self.session = make_session(session_bytes(sub), level="none")

    def rows(self, positions: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray] | None:
        """cos, sin [len(positions), width] at these positions, or None if not that shape."""
        out = self.session.run(None, {POSITION_IDS: positions.astype(self.dtype)[None]})
        if any(o.size != positions.size * width for o in out):
            return None
        return tuple(o.reshape(positions.size, width) for o in out)


def rotary_tables(maker: TableMaker, half: int, max_positions: int
                  ) -> tuple[np.ndarray, np.ndarray] | None:
    """cos and sin tables [max_positions, half], if the subgraph is a pure function of each
    position with both halves of a row equal (rotate_half's layout); else None."""
    if maker.session is None:
        return None
    full = maker.rows(np.arange(max_positions), 2 * half)
    if full is None or any(not np.array_equal(t[:, :half], t[:, half:]) for t in full):
        return None
    rng = np.random.default_rng(0)
    for probe in (np.arange(5), rng.integers(0, max_positions, 7)):
        part = maker.rows(probe, 2 * half)
        if part is None or any(not np.allclose(p, t[probe], rtol=0, atol=1e-6)
                               for p, t in zip(part, full)):
            return None
    return tuple(np.ascontiguousarray(t[:, :half], dtype=np.float32) for t in full)


def position_rows(graph: gs.Graph, role: str) -> gs.Variable:
    """position_ids as int64 [T, 1]: one token per batch row (see _emit)."""
    pos = next(t for t in graph.inputs if t.name == POSITION_IDS)
    name = f"/{role}/rotary/positions"
    if np.dtype(pos.dtype) != np.int64:
        cast = gs.Variable(f"{name}/int64", dtype=np.int64)
        graph.nodes.append(gs.Node("Cast", f"{name}/Cast", {"to": 7}, [pos], [cast]))
        pos = cast
    tokens = pos.shape[-1] if pos.shape else "tokens"
    column = gs.Variable(f"{name}/column", dtype=np.int64, shape=[tokens, 1])
    graph.nodes.append(gs.Node("Reshape", f"{name}/Reshape",
                               inputs=[pos, gs.Constant(f"{name}/shape", np.array([-1, 1]))],
                               outputs=[column]))
    return column


def _heads_first(x: gs.Tensor) -> gs.Tensor | None:
    """x_pre if x = Transpose(x_pre, perm 0,2,1,3) ([1, T, heads, dim] -> [1, heads, T, dim])."""
    node = producer(x, "Transpose")
    if node is None or list(node.attrs.get("perm", [])) != [0, 2, 1, 3]:
        return None
    return node.inputs[0]


def _emit(graph: gs.Graph, m: RotaryMatch, name: str, heads: int, positions: gs.Variable,
          tables: tuple[gs.Constant, gs.Constant]) -> None:
    """The op on one token per batch row: onnxruntime refuses a sequence longer than its
    tables, and a flattened batch of many sequences may hold more tokens than any one can.

        x_pre [1, T, heads, dim] --Reshape--> [T, 1, heads*dim] --RotaryEmbedding(positions
        [T, 1])--> --Reshape--> [1, T, heads, dim] --Transpose(0,2,1,3)--> y [1, heads, T, dim]
    """
    dim = 2 * m.half
    y = m.add.outputs[0]
    m.add.outputs.clear()
    source = _heads_first(m.x)
    inner = producer(source, "Reshape")
    if inner is not None and len(source.outputs) == 1:  # reshape the projection directly
        source = inner.inputs[0]
    if source.dtype is not None and np.dtype(source.dtype) != np.dtype(y.dtype):
        source = cast_to(graph, source, y.dtype, f"{name}/input")  # float16 up: exact
    flat = [positions.shape[0], 1, heads * dim]
    rows, out = (gs.Variable(f"{name}/{k}", dtype=y.dtype, shape=flat) for k in ("rows", "out"))
    back = gs.Variable(f"{name}/back", dtype=y.dtype)
    graph.nodes += [
        gs.Node("Reshape", f"{name}/to_rows", inputs=[
            source, gs.Constant(f"{name}/rows_shape", np.array([-1, 1, heads * dim]))],
            outputs=[rows]),
        gs.Node("RotaryEmbedding", name, {"interleaved": 0, "num_heads": heads},
                [rows, positions, *tables], [out], domain=CONTRIB),
        gs.Node("Reshape", f"{name}/to_tokens", inputs=[
            out, gs.Constant(f"{name}/tokens_shape", np.array([1, -1, heads, dim]))],
            outputs=[back]),
        gs.Node("Transpose", f"{name}/Transpose", {"perm": [0, 2, 1, 3]}, [back], [y]),
    ]


def fuse_rotary(graph: gs.Graph, role: str, max_positions: int) -> tuple[int, list[str]]:
    """Replace each usable rotary with RotaryEmbedding; returns how many, and each rotary
    left unfused with why (for the compile report)."""
    matches, unfused = find_rotary(graph)
    if not any(t.name == POSITION_IDS for t in graph.inputs):
        return 0, unfused + [f"{m.add.name} (no position_ids input)" for m in matches]
    tables: dict[tuple[str, str, int], tuple[gs.Constant, gs.Constant] | None] = {}
    fused, positions = 0, None
    for m in matches:
        key = (m.cos.name, m.sin.name, m.half)
        if key not in tables:
            made = rotary_tables(TableMaker(graph, m.cos, m.sin), m.half, max_positions)
            tables[key] = None if made is None else tuple(
                gs.Constant(f"/{role}/rotary/{kind}_table_{len(tables)}", t)
                for kind, t in zip(("cos", "sin"), made))
        if tables[key] is None:
            unfused.append(f"{m.add.name} (cos/sin not a pure function of the position)")
            continue
        if _heads_first(m.x) is None:
            unfused.append(f"{m.add.name} (its input is not [1, T, heads, dim] transposed)")
            continue
        positions = positions or position_rows(graph, role)
        verify, q = _reader(m.add.outputs[0])
        heads = int(verify.attrs["num_heads" if q else "num_kv_heads"])
        name = f"{verify.name.rsplit('/', 1)[0]}/rotary_{'q' if q else 'k'}"
        _emit(graph, m, name, heads, positions, tables[key])
        fused += 1
    if fused:
        _import(graph, CONTRIB)
    graph.cleanup().toposort()
    return fused, unfused


def _import(graph: gs.Graph, domain: str) -> None:
    import onnx

    domains = list(graph.import_domains or [])
    if all(d.domain != domain for d in domains):
        graph.import_domains = [*domains, onnx.helper.make_opsetid(domain, 1)]
