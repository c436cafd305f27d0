"""Move the head transpose past ops that act on the last axis alone (a q/k RMSNorm).

Gemma 3 (and Qwen 3, OLMo 2) norm each head's q and k between the head transpose and the
rotary, so neither the rotary fusion nor the token-row layout finds the Transpose they look
for in front of the rotary:

    x [1, T, H, D] --Transpose(0,2,1,3)--> y --Pow, ReduceMean(-1), Add, Sqrt, Div, Mul(w)--> n
    n --rotary--> SpeculativeVerify
An op that works along the last axis alone (elementwise with constants that broadcast over
the last axis only, a reduction over it, opset 23's RMSNormalization over it) commutes with
a transpose that keeps that axis, so the same ops run on x and the transpose comes after:

    x --Pow, ReduceMean(-1), ..., Mul(w)--> n' --Transpose(0,2,1,3)--> n
The region taken is every such op reachable from y whose other inputs are such constants;
it is moved only when one tensor of it is read from outside (the norm's output).
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from dspark.compiler.passes.graph_util import replace_uses

SWAP = [0, 2, 1, 3]
ELEMENTWISE = frozenset({"Mul", "Div", "Add", "Sub", "Pow", "Sqrt", "Cast", "Reciprocal", "Neg"})
REDUCTIONS = frozenset({"ReduceMean", "ReduceSum", "ReduceSumSquare"})
NORMS = frozenset({"RMSNormalization", "LayerNormalization"})  # opset 23's, over `axis`


def _last_axis_constant(t: gs.Tensor) -> bool:
    """A constant that broadcasts over the last axis only (a scalar, [D] or [1, .., 1, D])."""
    return isinstance(t, gs.Constant) and all(d == 1 for d in t.values.shape[:-1]) and \
        t.values.ndim <= 4


def _reduces_last_axis(n: gs.Node) -> bool:
    axes = n.attrs.get("axes")
    if axes is None and len(n.inputs) > 1 and isinstance(n.inputs[1], gs.Constant):
        axes = n.inputs[1].values.tolist()
    axes = np.atleast_1d(axes if axes is not None else []).tolist()
    return axes in ([-1], [3]) and int(n.attrs.get("keepdims", 1)) == 1


def _local(n: gs.Node, inside: set[str]) -> bool:
    """n acts on the last axis alone, its variable inputs all from the region."""
    if n.op in REDUCTIONS:
        return _reduces_last_axis(n) and n.inputs[0].name in inside
    if n.op in NORMS:  # one output, normalized over the last axis, constant scale and bias
        return (int(n.attrs.get("axis", -1)) in (-1, 3) and len(n.outputs) == 1
                and n.inputs[0].name in inside
                and all(_last_axis_constant(t) for t in n.inputs[1:]))
    if n.op not in ELEMENTWISE:
        return False
    return all(t.name in inside if isinstance(t, gs.Variable) else _last_axis_constant(t)
               for t in n.inputs)


def _region(y: gs.Variable) -> tuple[list[gs.Node], gs.Variable] | None:
    """(nodes in order, the one tensor read from outside) of the last-axis ops from y."""
    inside, nodes = {y.name}, []
    grown = True
    while grown:
        grown = False
        for t in [y, *(o for n in nodes for o in n.outputs)]:
            for n in t.outputs:
                if n not in nodes and _local(n, inside):
                    nodes.append(n)
                    inside.update(o.name for o in n.outputs)
                    grown = True
    outs = [t for t in (o for n in nodes for o in n.outputs)
            if any(c not in nodes for c in t.outputs)]
    if not nodes or len(outs) != 1 or any(c not in nodes for c in y.outputs):
        return None
    return nodes, outs[0]


def _move(graph: gs.Graph, transpose: gs.Node, nodes: list[gs.Node], out: gs.Variable) -> None:
    x = transpose.inputs[0]
    clone = {transpose.outputs[0].name: x}
    for n in nodes:  # in the order they were found: each after its region inputs
        outputs = [gs.Variable(f"{o.name}/sunk", dtype=o.dtype) for o in n.outputs]
        graph.nodes.append(gs.Node(n.op, f"{n.name}/sunk", dict(n.attrs),
                                   [clone.get(t.name, t) for t in n.inputs], outputs,
                                   domain=n.domain))
        clone.update({o.name: c for o, c in zip(n.outputs, outputs)})
    after = gs.Variable(f"{out.name}/heads", dtype=out.dtype, shape=out.shape)
    graph.nodes.append(gs.Node("Transpose", f"{transpose.name}/sunk", {"perm": SWAP},
                               [clone[out.name]], [after]))
    replace_uses(graph, out, after)


def sink_head_transposes(graph: gs.Graph) -> int:
    """Move each Transpose(0,2,1,3) past the last-axis ops after it; how many moved."""
    moved = 0
    for transpose in [n for n in graph.nodes if n.op == "Transpose"]:
        if list(transpose.attrs.get("perm", [])) != SWAP:
            continue
        found = _region(transpose.outputs[0])
        if found is None:
            continue
        _move(graph, transpose, *found)
        moved += 1
    graph.cleanup().toposort()
    return moved
