"""Prove that each token's position-derived values depend on its own position only.

The runtime runs a flattened batch: one call holds tokens of many sequences, and a
sequence's tokens arrive one at a time (decoding), several at once (a verify window) or in
prompt chunks. So whatever the graph computes from position_ids alone (rotary cos/sin, a
learned position embedding's rows) must give a token the same values whichever other
positions share its call. Rope scalings that switch on the call's longest position break
this: LongRoPE (Phi-3's 128k models), as torch.onnx's dynamo exporter writes it, takes
`ReduceMax(position_ids) + 1 > original length` and picks other frequencies for every token
of the call, so a token's rotary depends on how tokens are batched (in the original too:
its own prefill and its own decoding rotate the same position differently). No compile of
such a graph is exact, so it is refused, naming the node where the first value stops being
per token and the longest --max-seq-len at which every value still is (LongRoPE below its
switch is plain RoPE).

The check runs the position-only subgraph (every float tensor computed from position_ids
and constants) at all positions up to the bundle's limit, and at small calls of chosen
positions, and compares each token's rows.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_graphsurgeon as gs

from dspark.runtime.bundle.spec import POSITION_IDS, VERIFY_OP
from dspark.runtime.errors import UnmappableAttentionError

_ATOL = 1e-6


def _position_only(graph: gs.Graph, source: gs.Variable) -> list[gs.Node]:
    """Nodes whose every variable input is computed from `source` and constants alone."""
    graph.toposort()
    pure, nodes = {source.name}, []
    for node in graph.nodes:
        if node.op in (VERIFY_OP, "If", "Loop", "Scan"):
            continue
        variables = [t for t in node.inputs if isinstance(t, gs.Variable) and t.name]
        if variables and all(t.name in pure for t in variables):
            nodes.append(node)
            pure.update(t.name for t in node.outputs)
    return nodes


def _token_rows(full: np.ndarray, part: np.ndarray, tokens: int, probe: np.ndarray
                ) -> np.ndarray | None:
    """full's values at the probe's positions, laid out as `part`: along the one axis that
    has `tokens` entries in full and len(probe) in part (None if there is none)."""
    if full.ndim != part.ndim:
        return None
    for axis in range(full.ndim - 1, -1, -1):
        others = [d for a, d in enumerate(full.shape) if a != axis]
        if (full.shape[axis] == tokens and part.shape[axis] == probe.size
                and others == [d for a, d in enumerate(part.shape) if a != axis]):
            return np.take(full, probe, axis=axis)
    return None


class _Subgraph:
    """The position-only subgraph's float tensors, run at chosen positions."""

    def __init__(self, graph: gs.Graph, source: gs.Variable, nodes: list[gs.Node]):
        from dspark.compiler.lazy_weights import session_bytes
        from dspark.runtime.model.sessions import make_session

        self.outputs = [t for n in nodes for t in n.outputs
                        if t.dtype is not None and np.dtype(t.dtype).kind == "f"]
        self.producers = {t.name: n for n in nodes for t in n.outputs}
        self.dtype = np.dtype(source.dtype or np.int64)
        self.session = None
        if self.outputs:
            sub = gs.Graph(nodes=nodes, inputs=[source], outputs=self.outputs,
                           opset=graph.opset, import_domains=graph.import_domains)
            self.session = make_session(session_bytes(sub), level="none")

    def run(self, positions: np.ndarray) -> list[np.ndarray]:
        return self.session.run(None, {POSITION_IDS: positions.astype(self.dtype)[None]})

    def first_mixed(self, limit: int) -> gs.Tensor | None:
        """The first float tensor (graph order) whose value for a token depends on the other
        positions of its call, for calls within positions 0 .. limit-1; None if none does."""
        full = self.run(np.arange(limit))
        rng = np.random.default_rng(0)
        probes = (np.arange(min(5, limit)), np.array([0]), np.array([limit - 1]),
                  np.sort(rng.integers(0, limit, 7)))
        for probe in probes:
            part = self.run(probe)
            for t, whole, piece in zip(self.outputs, full, part):
                rows = _token_rows(whole, piece, limit, probe)
                if rows is None:  # no token axis: the same value in every call
                    rows = whole if whole.shape == piece.shape else None
                if rows is None or not np.allclose(rows, piece, rtol=0, atol=_ATOL,
                                                   equal_nan=True):
                    return t
        return None


def layer_reading(t: gs.Tensor) -> int | None:
    """The first SpeculativeVerify layer downstream of `t`."""
    seen, todo = set(), [t]
    layers = []
    while todo:
        x = todo.pop()
        for node in x.outputs:
            if id(node) in seen:
                continue
            seen.add(id(node))
            if node.op == VERIFY_OP:
                layers.append(int(node.attrs["layer"]))
                continue
            todo.extend(node.outputs)
    return min(layers) if layers else None


def check_per_token_positions(graph: gs.Graph, max_positions: int, path: Path | str) -> None:
    """Refuse (UnmappableAttentionError) a graph whose position-derived values depend on the
    other positions of a call, at positions below `max_positions`."""
    source = next((t for t in graph.inputs if t.name == POSITION_IDS), None)
    if source is None:
        return
    sub = _Subgraph(graph, source, _position_only(graph, source))
    if sub.session is None:
        return
    mixed = sub.first_mixed(max_positions)
    if mixed is None:
        return
    node = sub.producers[mixed.name]
    layer = layer_reading(mixed)
    stable = _longest_stable(sub, max_positions)
    where = f"layer {layer}: " if layer is not None else ""
    hint = (f"; every value is per token up to --max-seq-len {stable}" if stable else "")
    raise UnmappableAttentionError(
        f"{path}: {where}cannot prove the positions: node '{node.name}' ({node.op}) gives each "
        "token values that depend on the other positions in its call (a rope scaling that "
        "switches on the call's longest position, as LongRoPE's does), so the output would "
        f"depend on how tokens are batched{hint}")


def _longest_stable(sub: _Subgraph, limit: int) -> int | None:
    """The largest n <= limit at which no value mixes positions (None below 2)."""
    lo, hi = 1, limit  # lo: known stable (a call of one position is trivially per token)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if sub.first_mixed(mid) is None:
            lo = mid
        else:
            hi = mid
    return lo if lo >= 2 else None
