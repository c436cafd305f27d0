"""Compute logits only for the token rows the runtime asks for.

A prefill of n tokens needs the logits of its last token only, a draft forward one row per
sequence; the vocabulary projection of every other row is wasted (for SmolLM2 it is the
largest matrix in the model). A new input `logits_index` [K] gathers those rows just
before the projection:

    hidden [1, T, d] --Gather(logits_index, axis=1)--> [1, K, d] --MatMul(lm_head)--> logits
Only token-wise ops may stand between the projection and `logits`; otherwise nothing changes.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from dspark.runtime.bundle.spec import LOGITS, LOGITS_INDEX

PROJECTIONS = frozenset({"MatMul", "Gemm", "MatMulNBits"})
TOKENWISE = frozenset({"Cast", "Mul", "Div", "Add", "Sub", "Tanh", "Identity"})


def _is_scalar_const(t: gs.Tensor) -> bool:
    return isinstance(t, gs.Constant) and t.values.size == 1


def head_projection(logits: gs.Variable) -> gs.Node | None:
    """The vocab projection feeding `logits` through token-wise ops only, else None."""
    t = logits
    while t.inputs:
        node = t.inputs[0]
        if node.op in PROJECTIONS:
            return node
        others = [i for i in node.inputs[1:] if not _is_scalar_const(i)]
        if node.op not in TOKENWISE or others:
            return None
        t = node.inputs[0]
    return None


def select_logits_rows(graph: gs.Graph) -> int:
    logits = next((t for t in graph.outputs if t.name == LOGITS), None)
    node = head_projection(logits) if logits is not None else None
    if node is None or not node.inputs[0].shape or len(node.inputs[0].shape) < 2:
        return 0
    hidden = node.inputs[0]
    index = gs.Variable(LOGITS_INDEX, dtype=np.int64, shape=["rows"])
    rows = gs.Variable("/logits/select_rows/output_0", dtype=hidden.dtype)
    graph.nodes.append(gs.Node("Gather", "/logits/select_rows", {"axis": len(hidden.shape) - 2},
                               inputs=[hidden, index], outputs=[rows]))
    node.inputs[0] = rows
    graph.inputs.append(index)
    return 1
