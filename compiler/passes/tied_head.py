"""A tied embedding and LM head stored once.

Exports of tied models (SmolLM2, Gemma, most small LMs) write the table twice: the
embedding Gather's [V, d] and the head MatMul's [d, V], its transpose (SmolLM2: 113 MB
each in fp32; Gemma 3 270M: 671 MB each, most of the model). When the head's weight is the
table transposed, bit for bit, the head reads the table itself:

    rows [1, K, d] --MatMul(W [d, V])--> logits
becomes
    rows [1, K, d] --Reshape [K, d]--Gemm(table [V, d], transB=1)--Reshape [1, K, V]--> logits
(as fast as the transposed copy: onnxruntime reads the table's rows as they lie). A float16
model's head reads its float16 weight through a Cast up: the Gemm reads the float16 table
through the same Cast.

A quantized model (`dsc quantize`: the embedding a GatherBlockQuantized, the head a
MatMulNBits, both from the same table) stores the same blocks twice too, once as the
gather's [V, d] and once as the head's [V, d / 32, 32] (Gemma 3's 8-bit draft: 168 MB each;
SmolLM2's: 28 MB). When the codes and the scales are equal byte for byte, the gather reads
the head's codes, its blocks as a third axis, and its rows are reshaped back:

    ids --GatherBlockQuantized(codes [V, d], scales [V, d/32])--> [1, T, d]
becomes
    ids --GatherBlockQuantized(B [V, d/32, 32], scales [V, d/32, 1], quantize_axis=2)
        --> [1, T, d/32, 32] --Reshape [0, 0, d]--> [1, T, d]

(MatMulNBits takes its B in three axes only, and GatherBlockQuantized wants scales of the
data's rank, so the scales keep a copy each: 21 MB for Gemma 3, as before.)
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from dspark.compiler.passes.graph_util import producer, replace_uses
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
    weight, cast = head.inputs[1], producer(head.inputs[1], "Cast")
    if cast is not None and isinstance(cast.inputs[0], gs.Constant):
        weight = cast.inputs[0]  # a float16 model's: its head weight cast up to float32
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
        gs.Node("Gemm", f"{name}/Gemm", {"transB": 1}, inputs=[
            rows, table if cast is None else _cast_up(graph, cast, table, name)],
            outputs=[out]),
        gs.Node("Reshape", f"{name}/Reshape_back", inputs=[
            out, gs.Constant(f"{name}/logits_shape", np.array([1, -1, vocab]))],
            outputs=[back])]
    replace_uses(graph, old, back)
    head.outputs.clear()
    graph.cleanup().toposort()
    return 1


def _cast_up(graph: gs.Graph, cast: gs.Node, table: gs.Constant, name: str) -> gs.Variable:
    """The table through the head's own Cast (onnxruntime folds it when it loads)."""
    out = gs.Variable(f"{name}/table", dtype=np.float32, shape=list(table.values.shape))
    graph.nodes.append(gs.Node("Cast", f"{name}/Cast", dict(cast.attrs), [table], [out]))
    return out


def _quantized_embedding(graph: gs.Graph) -> gs.Node | None:
    """The one GatherBlockQuantized that reads the input ids from a [V, d] table, without
    zero points (the default, the middle of the range, is MatMulNBits' too)."""
    found = [n for n in graph.nodes if n.op == "GatherBlockQuantized" and len(n.inputs) == 3
             and n.inputs[1].name == INPUT_IDS
             and all(isinstance(t, gs.Constant) for t in (n.inputs[0], n.inputs[2]))
             and int(n.attrs.get("gather_axis", 0)) == 0
             and int(n.attrs.get("quantize_axis", 1)) in (1, -1)]
    return found[0] if len(found) == 1 and found[0].inputs[0].values.ndim == 2 else None


def share_quantized_tied_head(graph: gs.Graph) -> int:
    """1 if the quantized embedding now reads the quantized head's codes, else 0."""
    logits = next((t for t in graph.outputs if t.name == LOGITS), None)
    head = head_projection(logits) if logits is not None else None
    gather = _quantized_embedding(graph)
    if head is None or head.op != "MatMulNBits" or gather is None or len(head.inputs) != 3:
        return 0
    codes, scales = head.inputs[1], head.inputs[2]
    table, table_scales = gather.inputs[0].values, gather.inputs[2].values
    bits, block = int(gather.attrs.get("bits", 4)), int(gather.attrs.get("block_size", 128))
    if (not isinstance(codes, gs.Constant) or not isinstance(scales, gs.Constant)
            or int(head.attrs.get("bits", 4)) != bits
            or int(head.attrs.get("block_size", 0)) != block
            or codes.values.ndim != 3 or codes.values.size != table.size
            or codes.values.dtype != table.dtype or scales.values.size != table_scales.size
            or scales.values.dtype != table_scales.dtype
            or int(head.attrs.get("N", 0)) != table.shape[0]):
        return 0
    if not (np.array_equal(codes.values.reshape(table.shape), table)
            and np.array_equal(scales.values.reshape(table_scales.shape), table_scales)):
        return 0
    vocab, blocks, _ = codes.values.shape
    width = int(head.attrs["K"])
    name = f"{gather.name}/tied"
    old = gather.outputs[0]
    rows = gs.Variable(f"{name}/blocks", dtype=old.dtype)
    back = gs.Variable(old.name, dtype=old.dtype, shape=old.shape)
    old.name = f"{name}/untied"
    graph.nodes += [
        gs.Node("GatherBlockQuantized", f"{name}/Gather", dict(gather.attrs, quantize_axis=2),
                inputs=[codes, gather.inputs[1], gs.Constant(
                    f"{name}/scales", table_scales.reshape(vocab, blocks, 1))],
                outputs=[rows], domain=gather.domain),
        gs.Node("Reshape", f"{name}/Reshape", inputs=[
            rows, gs.Constant(f"{name}/rows_shape", np.array([0, 0, width]))],
            outputs=[back])]
    replace_uses(graph, old, back)
    gather.outputs.clear()
    graph.cleanup().toposort()
    return 1
