"""Fold the If nodes that switch on a sequence's length (or its positions), where the bundle
never reaches the switch.

onnxruntime-genai writes LongRoPE (Phi-3's 128k models) as an If between two rope caches,
decided by the attention mask's length: a call whose sequence holds more than the original
context (past + new > 4096 for Phi-3) takes the long caches for all its tokens.

    Shape(attention_mask)[1] --> Greater(., 4096) --> If --> cos_cache, sin_cache

Above the switch no batching of tokens reproduces that: a prompt's tokens would be rotated
by the table of the prompt's end, the same positions decoded one by one by the tables of
theirs. At or below it the model is plain RoPE, and the If is replaced by the branch it
always takes. Which branch that is, and that it never changes, is read off the running
condition: the If's condition subgraph is run for every sequence length the bundle allows
(1 .. --max-seq-len), each as a decode step after a cache, as a whole prompt, as a 7-token
window and as a random split. Only conditions computed from input shapes, the mask and the
positions (whose values the runtime fixes) are folded; any other is left to `bind`, which
refuses it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_graphsurgeon as gs

from dspark.compiler.contract import ATTENTION_MASK, InputContract
from dspark.compiler.passes.bind import tainted
from dspark.compiler.passes.graph_util import replace_uses
from dspark.compiler.passes.positions import layer_reading
from dspark.compiler.passes.probe import ProbeShape, feeds
from dspark.runtime.bundle.spec import POSITION_IDS
from dspark.runtime.errors import UnmappableAttentionError

_VALUES_KNOWN = (ATTENTION_MASK, POSITION_IDS)  # all ones; past + arange(new)
_CONTROL = ("If", "Loop", "Scan")


def condition_subgraph(cond: gs.Tensor) -> tuple[list[gs.Node], set[str]] | None:
    """The nodes computing `cond` and the graph inputs they read; None if they read the
    values of an input the runtime does not fix (not just its shape) or run control flow."""
    nodes, inputs, todo, seen = [], {}, [cond], set()
    while todo:
        t = todo.pop()
        if isinstance(t, gs.Constant) or id(t) in seen:
            continue
        seen.add(id(t))
        if not t.inputs:
            inputs[t.name] = t
            continue
        node = t.inputs[0]
        if node.op in _CONTROL:
            return None
        if id(node) not in seen:
            seen.add(id(node))
            nodes.append(node)
            todo.extend(node.inputs)
    for name, t in inputs.items():
        readers = [n for n in nodes if any(x is t for x in n.inputs)]
        if name not in _VALUES_KNOWN and any(n.op != "Shape" for n in readers):
            return None
    return nodes, set(inputs)


def _calls(limit: int, seed: int = 0):
    """(past, new) for every sequence length 1 .. limit: a decode step, a whole prompt, a
    7-token window and a random split."""
    rng = np.random.default_rng(seed)
    for total in range(1, limit + 1):
        for new in sorted({1, total, min(total, 7), int(rng.integers(1, total + 1))}):
            yield total, ProbeShape(1, total - new, new)


class _Conditions:
    """The switching Ifs' conditions as one small onnxruntime session."""

    def __init__(self, graph: gs.Graph, contract: InputContract, ifs: list[gs.Node],
                 nodes: list[gs.Node], reads: set[str]):
        from dspark.compiler.lazy_weights import session_bytes
        from dspark.runtime.model.sessions import make_session

        self.contract, self.ifs, self.reads = contract, ifs, reads
        inputs = [t for t in graph.inputs if t.name in reads]
        order = {id(n): i for i, n in enumerate(graph.nodes)}
        sub = gs.Graph(nodes=sorted(nodes, key=lambda n: order[id(n)]), inputs=inputs,
                       outputs=[n.inputs[0] for n in ifs], opset=graph.opset,
                       import_domains=graph.import_domains)
        self.session = make_session(session_bytes(sub), level="none")

    def branches(self, shape: ProbeShape) -> tuple[bool, ...]:
        ids = np.zeros((1, shape.new), np.int64)
        out = self.session.run(None, feeds(self.contract, shape, ids, only=self.reads))
        return tuple(bool(np.asarray(v).reshape(-1)[0]) for v in out)

    def first_switch(self, limit: int) -> tuple[tuple[bool, ...], int | None, int]:
        """The branches at length 1, the first length at which one differs (None if
        none up to `limit`) and the index of the If that changes there."""
        first = None
        for total, shape in _calls(limit):
            taken = self.branches(shape)
            if first is None:
                first = taken
            elif taken != first:
                return first, total, next(i for i, (a, b) in enumerate(zip(first, taken))
                                          if a != b)
        return first, None, -1


def _inline(graph: gs.Graph, node: gs.Node, branch: gs.Graph) -> None:
    """Replace If `node` by the nodes of `branch` (which may read outer tensors)."""
    graph.nodes.extend(branch.nodes)
    for out, result in zip(node.outputs, branch.outputs):
        replace_uses(graph, out, result)
    node.outputs.clear()


def fold_length_switches(graph: gs.Graph, contract: InputContract, max_positions: int,
                         path: Path | str) -> int:
    """Replace each If decided by the sequence's length by the branch it takes for every
    length up to `max_positions`; refuse (UnmappableAttentionError) one that switches below
    it, naming the layer, the If and the longest --max-seq-len at which it does not."""
    dirty = {t.name for t in tainted(graph, {*contract.removed_inputs, POSITION_IDS})}
    ifs, nodes, reads = [], [], set()
    for node in graph.nodes:
        if node.op != "If" or not node.inputs or node.inputs[0].name not in dirty:
            continue
        found = condition_subgraph(node.inputs[0])
        if found is None:
            continue
        ifs.append(node)
        nodes.extend(n for n in found[0] if all(n is not m for m in nodes))
        reads |= found[1]
    if not ifs:
        return 0
    conditions = _Conditions(graph, contract, ifs, nodes, reads)
    taken, switch, which = conditions.first_switch(max_positions)
    if switch is not None:
        node = ifs[which]
        layer = min((x for x in map(layer_reading, node.outputs) if x is not None),
                    default=None)
        where = f"layer {layer}: " if layer is not None else ""
        raise UnmappableAttentionError(
            f"{path}: {where}cannot prove the positions: If node '{node.name}' takes its other "
            f"branch once a sequence holds {switch} tokens (as LongRoPE's long rope caches "
            "do), so a prompt's tokens and the same positions decoded one by one would be "
            "computed differently, which no batching of tokens reproduces exactly"
            + (f"; it takes one branch up to --max-seq-len {switch - 1}" if switch > 1 else ""))
    for node, cond in zip(ifs, taken):
        _inline(graph, node, node.attrs["then_branch" if cond else "else_branch"])
    graph.cleanup().toposort()
    return len(ifs)
