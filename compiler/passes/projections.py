"""Sibling int4 projections of one input as one MatMulNBits, split after.

A Llama-style layer projects its normed input three times (q, k, v) and its MLP input twice
(gate, up). As separate onnxruntime MatMulNBits ops each small projection pays its own
dispatch and starts its own cold weight stream; concatenated along N they are one op:

    x --MatMulNBits(B_q | B_k | B_v, scales too)--> y --Split(N_q, N_k, N_v, -1)--> q, k, v

One op instead of three reads the input once and dispatches once (faster from a cold
cache and a warm one alike). Each output column still reads only its own weight blocks and
the shared input, so every value is what the separate op computed. Only MatMulNBits without
group index or bias, with equal K, bits, block_size and accuracy_level, and zero points on
all or none (of one dtype: a GGUF's Q4_1 mins), are joined; fp32 MatMuls are left alone
(bandwidth-bound already, and a main model's numerics are not worth touching for it).
A GGUF Q4_1 draft's layer (zero points) runs 4 projection ops instead of 7.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx_graphsurgeon as gs

ATTRS = ("K", "bits", "block_size", "accuracy_level")


def _joinable(node: gs.Node) -> bool:
    """Weights, scales and zero points (if any) constant; no group index or bias."""
    return (node.op == "MatMulNBits" and len(node.inputs) in (3, 4) and len(node.outputs) == 1
            and all(isinstance(t, gs.Constant) for t in node.inputs[1:])
            and not isinstance(node.inputs[0], gs.Constant))


def _zero_points(node: gs.Node) -> np.ndarray | None:
    return node.inputs[3].values if len(node.inputs) == 4 else None


def _dtype(values: np.ndarray | None) -> str | None:
    return None if values is None else values.dtype.str


def _rows(values: np.ndarray, n: int) -> np.ndarray:
    """Scales as [N, blocks] (onnxruntime accepts them flat or 2-D)."""
    return values.reshape(n, -1)


def fuse_projections(graph: gs.Graph) -> int:
    """Join sibling MatMulNBits of each input; returns how many ops were removed."""
    groups: dict[tuple, list[gs.Node]] = defaultdict(list)
    for node in graph.nodes:
        if _joinable(node):
            key = (node.inputs[0].name, *(node.attrs.get(a) for a in ATTRS),
                   node.inputs[1].values.dtype.str, node.inputs[2].values.dtype.str,
                   _dtype(_zero_points(node)))
            groups[key].append(node)
    removed = 0
    for nodes in (g for g in groups.values() if len(g) > 1):
        sizes = [int(n.attrs["N"]) for n in nodes]
        first = nodes[0]
        weights = np.concatenate([n.inputs[1].values for n in nodes], axis=0)
        name = first.name or first.outputs[0].name
        inputs = [first.inputs[0], gs.Constant(f"{name}_joined_B", weights)]
        for index, label in ((2, "scales"), (3, "zero_points")):
            if index < len(first.inputs):  # per output row (uint8 zero points packed per row)
                rows = np.concatenate([_rows(n.inputs[index].values, s)
                                       for n, s in zip(nodes, sizes)])
                flat = first.inputs[index].values.ndim == 1
                inputs.append(gs.Constant(f"{name}_joined_{label}",
                                          rows.reshape(-1) if flat else rows))
        joined = gs.Variable(f"{name}_joined", dtype=first.outputs[0].dtype)
        graph.nodes.append(gs.Node(
            "MatMulNBits", f"{name}_joined", {**first.attrs, "N": sum(sizes)},
            inputs=inputs, outputs=[joined], domain=first.domain))
        outputs = [n.outputs[0] for n in nodes]
        for n in nodes:
            n.outputs.clear()
        graph.nodes.append(gs.Node(
            "Split", f"{name}_split", {"axis": -1},
            inputs=[joined, gs.Constant(f"{name}_split_sizes", np.array(sizes, np.int64))],
            outputs=outputs))
        removed += len(nodes) - 1
    if removed:
        graph.cleanup().toposort()
    return removed
