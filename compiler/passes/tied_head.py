"""A tied embedding and LM head stored once.

Exports of tied models (SmolLM2, Gemma, most small LMs) write the table twice: the
embedding Gather's [V, d] and the head MatMul's [d, V], its transpose (SmolLM2: 113 MB
each in fp32; Gemma 3 270M: 671 MB each, most of the model). When the head's weight is the
table transposed, bit for bit, the head reads the table itself:

    rows [1, K, d] --MatMul(W [d, V])--> logits
becomes
    rows [1, K, d] --Reshape [K, d]--Gemm(table [V, d], transB=1)--Reshape [1, K, V]--> logits
(measured on this kind of machine: 7.0 against 7.0 ms for SmolLM2's head at one row, 37.7
against 38.4 ms for Gemma's; onnxruntime reads the table's rows as they lie).
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from dspark.compiler.passes.graph_util import replace_uses
from dspark.compiler.passes.select_logits import head_projection
from dspark.runtime.bundle.spec import INPUT_IDS, LOGITS


def _embedding(graph: gs.Graph) -> gs.Constant | None:
    """The table the input ids are gathered from, when one Gather does it."""
    tables = [n.inputs[0] for n in graph.nodes if n.op == "Gather" and len(n.inputs) == 2
              and n.inputs[1].name == INPUT_IDS and isinstance(n.inputs[0], gs.Constant)
              and int(n.attrs.get("axis", 0)) == 0]
    return tables[0] if len(tables) == 1 and tables[0].values.ndim == 2 else None


def share_tied_head(graph: gs.Graph) -> int:
    """1 if the head now reads the embedding table, else 0."""
    logits = next((t for t in graph.outputs if t.name == LOGITS), None)
    head = head_projection(logits) if logits is not None else None
    table = _embedding(graph)
    if head is None or head.op != "MatMul" or table is None:
        return 0
    weight = head.inputs[1]
    if not isinstance(weight, gs.Constant) or weight.values.shape != table.values.shape[::-1]:
        return 0
    if weight.values.dtype != table.values.dtype or not np.array_equal(weight.values.T,
                                                                      table.values):
        return 0
    vocab, width = table.values.shape
    name = f"{head.name}/tied"
    old = head.outputs[0]
    rows, out = (gs.Variable(f"{name}/{k}", dtype=np.float32) for k in ("rows", "out"))
    back = gs.Variable(old.name, dtype=old.dtype, shape=old.shape)  # maybe `logits` itself
    old.name = f"{name}/untied"
    graph.nodes += [
        gs.Node("Reshape", f"{name}/Reshape", inputs=[
            head.inputs[0], gs.Constant(f"{name}/rows_shape", np.array([-1, width]))],
            outputs=[rows]),
        gs.Node("Gemm", f"{name}/Gemm", {"transB": 1}, inputs=[rows, table], outputs=[out]),
        gs.Node("Reshape", f"{name}/Reshape_back", inputs=[
            out, gs.Constant(f"{name}/logits_shape", np.array([1, -1, vocab]))],
            outputs=[back])]
    replace_uses(graph, old, back)
    head.outputs.clear()
    graph.cleanup().toposort()
    return 1
