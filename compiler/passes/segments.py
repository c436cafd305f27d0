"""Cut a rewritten graph into onnxruntime segments at its SpeculativeVerify nodes.

A node's segment is the number of SpeculativeVerify nodes upstream of it:

    segment 0: embeddings .. layer 0 q,k,v     SpeculativeVerify 0 runs after segment 0
    segment 1: layer 0 o_proj .. layer 1 q,k,v SpeculativeVerify 1 runs after segment 1
    ...
    segment L: layer L-1 o_proj .. logits
Tensors used across a cut (residual stream, rotary tables) become segment outputs/inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_graphsurgeon as gs

from dspark.runtime.bundle.spec import VERIFY_OP


@dataclass
class SegmentCut:
    index: int
    nodes: list[gs.Node]
    inputs: list[gs.Variable]
    outputs: list[gs.Variable]


def _depths(graph: gs.Graph) -> dict[str, int]:
    """Depth of every variable: SpeculativeVerify nodes upstream of it."""
    depth: dict[str, int] = {}
    for node in graph.nodes:
        d = max((depth.get(t.name, 0) for t in node.inputs if isinstance(t, gs.Variable)),
                default=0)
        for out in node.outputs:
            depth[out.name] = d + (node.op == VERIFY_OP)
    return depth


def _with_first_consumer(graph: gs.Graph, node_depth: dict[int, int]) -> None:
    """A node of constants alone (a float16 model's weight cast up to float32) runs in the
    segment of its first consumer, not in segment 0 handing its output down every cut."""
    consumers: dict[int, list[gs.Node]] = {}
    for n in graph.nodes:
        for t in n.inputs:
            for p in t.inputs:
                consumers.setdefault(id(p), []).append(n)
    for n in reversed(graph.nodes):
        if n.op != VERIFY_OP and n.inputs and all(isinstance(t, gs.Constant) for t in n.inputs):
            users = [node_depth[id(c)] for c in consumers.get(id(n), []) if c.op != VERIFY_OP]
            node_depth[id(n)] = min(users, default=0)


def cut_segments(graph: gs.Graph) -> tuple[list[SegmentCut], dict[str, int]]:
    """Segments in order, and for each SpeculativeVerify node the segment it follows."""
    graph.toposort()
    depth = _depths(graph)
    node_depth = {
        id(n): max((depth.get(t.name, 0) for t in n.inputs if isinstance(t, gs.Variable)),
                   default=0)
        for n in graph.nodes
    }
    _with_first_consumer(graph, node_depth)
    count = 1 + max(node_depth.values(), default=0)
    cuts = [SegmentCut(i, [], [], []) for i in range(count)]
    after = {}
    for n in graph.nodes:
        if n.op == VERIFY_OP:
            after[n.name] = node_depth[id(n)]
        else:
            cuts[node_depth[id(n)]].nodes.append(n)
    graph_outputs = {t.name for t in graph.outputs}
    for cut in cuts:
        inside = {id(n) for n in cut.nodes}
        produced = {t.name: t for n in cut.nodes for t in n.outputs}
        seen: set[str] = set()
        for n in cut.nodes:
            for t in n.inputs:
                if isinstance(t, gs.Variable) and t.name not in produced and t.name not in seen:
                    seen.add(t.name)
                    cut.inputs.append(t)
        for name, t in produced.items():
            if name in graph_outputs or any(id(c) not in inside for c in t.outputs):
                cut.outputs.append(t)
    return cuts, after


def segment_graph(graph: gs.Graph, cut: SegmentCut) -> gs.Graph:
    return gs.Graph(nodes=cut.nodes, inputs=cut.inputs, outputs=cut.outputs,
                    name=f"{graph.name}_segment_{cut.index:03d}", opset=graph.opset,
                    import_domains=graph.import_domains)
