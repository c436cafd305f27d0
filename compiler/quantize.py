"""A self-speculative draft from a main model: its projections in low-bit blocks (dsc quantize).

    dsc quantize main.onnx -o draft.onnx

Every MatMul with a float weight [K, N] (K a multiple of 32) becomes onnxruntime's MatMulNBits
(blocks of 32 along K, accuracy level 4: int8 arithmetic):
- projections at 4 bits with a float16 scale and a float16 min per block, weight = scale * q +
  min, q in 0..15, scale = (max - min) / 15, min = the block's min: llama.cpp's Q4_1 grid.
  Stored as MatMulNBits' float zero points (zp = -min / scale);
- the LM head (a MatMul writing a graph output) at 8 bits, symmetric, scale = max|w| / 127:
  llama.cpp's Q8_0 grid. The head decides every proposal; at 4 bits it was SmolLM2's largest
  source of disagreement with its main;
- the token embedding (a Gather of a float table by input_ids) the same way, as onnxruntime's
  GatherBlockQuantized: 4x smaller, exact for a GGUF's Q8_0 embedding (SmolLM2's, Gemma 3's).
A main whose weights came from such a file (the sample's SmolLM2 is Q4_1 with a Q8_0 head)
sits exactly on these grids, so the draft holds its weights exactly and differs from it only
by int8 inputs, and far more of its drafts are accepted than of a draft from onnxruntime's
symmetric 4-bit quantizer, which re-quantizes onto another grid (docs/drafting.md). Any
other main gets min/max round-to-nearest, which keeps each block's range.

The draft runs as MatMulInt4 (kernels/cpu_int4.c) where the runtime rewrites it
(runtime/model/int4_rows.py); onnxruntime's own kernel computes float zero points in float32,
correct but slow. Output is written to a temporary file, then renamed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from dspark.runtime.errors import DSparkError

BLOCK = 32


@dataclass
class QuantReport:
    projections: int = 0  # MatMuls quantized, the head included
    exact: int = 0  # of them, held exactly (the weights were on the grid)
    head: str | None = None  # the head's MatMul, if one was found
    kept: int = 0  # float MatMuls left as they were (K not a multiple of 32, not 2-D)
    embedding: str | None = None  # the token embedding's Gather, at 8 bits
    embedding_exact: bool = False  # its table was on the grid


def _blocks(w: np.ndarray) -> np.ndarray:
    """[K, N] weight -> [N, K/32, 32] blocks along K (MatMulNBits' order)."""
    k, n = w.shape
    return np.ascontiguousarray(w.T).reshape(n, k // BLOCK, BLOCK)


def q4_min(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """4-bit blocks with a min: (B [N, K/32, 16] uint8, scales, float zero points, exact)."""
    blocks = _blocks(w)
    lo, hi = blocks.min(axis=2), blocks.max(axis=2)
    scale = ((hi - lo) / 15).astype(np.float16).astype(np.float32)
    low = lo.astype(np.float16).astype(np.float32)
    safe = np.where(scale > 0, scale, 1)
    q = np.clip(np.rint((blocks - low[..., None]) / safe[..., None]), 0, 15).astype(np.uint8)
    exact = bool(np.array_equal(scale[..., None] * q + low[..., None], blocks))
    packed = q[..., 0::2] | (q[..., 1::2] << 4)
    zero = np.where(scale > 0, -low / safe, 0).astype(np.float32)
    return packed, scale.reshape(-1), zero.reshape(-1), exact


def q8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, bool]:
    """8-bit symmetric blocks: (B [N, K/32, 32] uint8 stored + 128, scales, exact)."""
    blocks = _blocks(w)
    scale = (np.abs(blocks).max(axis=2) / 127).astype(np.float16).astype(np.float32)
    safe = np.where(scale > 0, scale, 1)
    q = np.clip(np.rint(blocks / safe[..., None]), -127, 127)
    exact = bool(np.array_equal(scale[..., None] * q, blocks))
    return (q + 128).astype(np.uint8), scale.reshape(-1), exact


def _nbits(node: onnx.NodeProto, k: int, n: int, bits: int, inputs: list[str]) -> onnx.NodeProto:
    return helper.make_node("MatMulNBits", [node.input[0], *inputs], list(node.output),
                            name=f"{node.name}_Q{bits}", domain="com.microsoft", K=k, N=n,
                            bits=bits, block_size=BLOCK, accuracy_level=4)


def _embedding(node: onnx.NodeProto, inits: dict, report: QuantReport, added: list,
               replaced: set) -> onnx.NodeProto:
    """The token embedding (a Gather of a float [V, d] table by input_ids) at 8 bits in
    blocks of 32 along d (Q8_0, a GGUF's usual embedding grid): GatherBlockQuantized,
    4x smaller (Gemma 3 270M's table: 671 -> 168 MB). Any other node comes back as it was."""
    table = inits.get(node.input[0]) if node.op_type == "Gather" else None
    if (table is None or table.data_type != onnx.TensorProto.FLOAT or len(table.dims) != 2
            or table.dims[1] % BLOCK or node.input[1] != "input_ids"
            or any(a.name == "axis" and a.i != 0 for a in node.attribute)):
        return node
    v, d = table.dims
    packed, scales, exact = q8(numpy_helper.to_array(table).T)
    names = (f"{table.name}_Q8", f"{table.name}_scales")
    added += [numpy_helper.from_array(packed.reshape(v, d), names[0]),
              numpy_helper.from_array(scales.reshape(v, d // BLOCK), names[1])]
    replaced.add(table.name)
    report.embedding, report.embedding_exact = node.name, exact
    return helper.make_node("GatherBlockQuantized", [names[0], node.input[1], names[1]],
                            list(node.output), name=f"{node.name}_Q8", domain="com.microsoft",
                            gather_axis=0, quantize_axis=1, block_size=BLOCK, bits=8)


def quantize_model(model: onnx.ModelProto, head_bits: int = 8) -> QuantReport:
    """Rewrite `model` in place (see the module doc); head_bits 4 or 8."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    outputs = {o.name for o in graph.output}
    report, replaced, added, nodes = QuantReport(), set(), [], []
    for node in graph.node:
        weight = inits.get(node.input[1]) if node.op_type == "MatMul" else None
        if weight is None or weight.data_type != onnx.TensorProto.FLOAT:
            nodes.append(node)
            continue
        w = numpy_helper.to_array(weight)
        if w.ndim != 2 or w.shape[0] % BLOCK:
            report.kept += 1
            nodes.append(node)
            continue
        k, n = w.shape
        name = weight.name
        head = node.output[0] in outputs
        if head and head_bits == 8:
            packed, scales, exact = q8(w)
            tensors = [(packed, f"{name}_Q8"), (scales, f"{name}_scales")]
            bits = 8
        else:
            packed, scales, zero, exact = q4_min(w)
            tensors = [(packed, f"{name}_Q4"), (scales, f"{name}_scales"),
                       (zero, f"{name}_zero_points")]
            bits = 4
        if head:
            report.head = node.name
        added += [numpy_helper.from_array(a, nm) for a, nm in tensors]
        nodes.append(_nbits(node, k, n, bits, [nm for _, nm in tensors]))
        replaced.add(name)
        report.projections += 1
        report.exact += exact
    nodes = [_embedding(nd, inits, report, added, replaced) for nd in nodes]
    del graph.node[:]
    graph.node.extend(nodes)
    used = {i for nd in graph.node for i in nd.input}
    keep = [t for t in graph.initializer if t.name not in replaced or t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(keep + added)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return report


def quantize_file(main: Path, out: Path, head_bits: int = 8) -> QuantReport:
    """main.onnx -> a draft at `out` (temporary file, then renamed)."""
    try:
        model = onnx.load(str(main))
    except FileNotFoundError:
        raise DSparkError(f"{main}: no such file") from None
    except Exception as e:  # onnx raises DecodeError and others for a bad file
        raise DSparkError(f"{main}: not a readable ONNX model ({e})") from None
    report = quantize_model(model, head_bits)
    if report.projections == 0:
        half = any(t.data_type == onnx.TensorProto.FLOAT16 and len(t.dims) == 2
                   for t in model.graph.initializer)
        raise DSparkError(f"{main}: no MatMul with a float32 [K, N] weight (K a multiple of "
                          f"{BLOCK}) to quantize" + ("; its weights are float16: quantize the "
                                                     "float32 model it was converted from"
                                                     if half else ""))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    try:
        onnx.save(model, str(tmp))
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return report
