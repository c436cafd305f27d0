"""A draft's int4 projections as MatMulInt4 (kernels/cpu_int4.c): graph rewrite, row packing.

A draft that reads the main's KV cache (the self-speculative int4 copy) runs 1-3 tokens a
forward, right after the main's step evicted its weights from the cache, so its forward is
mostly a cold read of every projection: SmolLM2's draft forward after a main step took 6.3 ms
with onnxruntime's MatMulNBits, 4.7 with MatMulInt4's streamed rows. Applied when the fused
session is built (runtime/model/fused.py), on the bundle's MatMulNBits as the compiler left
them; the bundle is unchanged and other executors (segments, CUDA) never see the op. Only
such drafts: one that prefills its own prompt would run it through rows made for 1-3 tokens
(MatMulNBits' GEMM is faster there).

Rewritten: MatMulNBits with 4 bits, blocks of 32, accuracy level 4 (int8 arithmetic, which
MatMulInt4 does too), no zero points, group index or bias, K a multiple of 64, weights and
scales stored as initializers. Anything else stays as it is. Only drafts: a main's arithmetic
is what its output is, and MatMulInt4 sums in another order than MatMulNBits.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

OP = "MatMulInt4"
DOMAIN = "ai.dspark"
BLOCK = 32


def pack_rows(b: np.ndarray, scales: np.ndarray, k: int, n: int) -> np.ndarray:
    """MatMulNBits' B ([N, K/32, 16] uint8: input 2i in a byte's low nibble, 2i+1 in its
    high) and scales ([N * K/32] float32) as MatMulInt4's rows [N, K/2 + K/16] (cpu_int4.c:
    chunks of 128 inputs pair input j with 64 + j in a byte, a last chunk of 64 pairs j with
    32 + j; then the row's scales as float16)."""
    pairs = np.asarray(b, np.uint8).reshape(n, k // 2)
    q = np.empty((n, k), np.uint8)
    q[:, 0::2] = pairs & 15
    q[:, 1::2] = pairs >> 4
    full = k // 128 * 128
    parts = []
    if full:
        chunks = q[:, :full].reshape(n, full // 128, 2, 64)
        parts.append((chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(n, full // 2))
    if k > full:
        tail = q[:, full:].reshape(n, 2, 32)
        parts.append(tail[:, 0] | (tail[:, 1] << 4))
    halves = np.asarray(scales, np.float32).astype("<f2").reshape(n, k // BLOCK)
    parts.append(np.ascontiguousarray(halves).view(np.uint8))
    return np.ascontiguousarray(np.concatenate(parts, axis=1))


def initializer_array(tensor: onnx.TensorProto, folder: Path) -> np.ndarray:
    """An initializer's values, read from its external file under `folder` when it has one
    (not through onnx's loader: it refuses a hard-linked weights file, as cached bundles
    are)."""
    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        return numpy_helper.to_array(tensor)
    info = {entry.key: entry.value for entry in tensor.external_data}
    path = (Path(folder) / info["location"]).resolve()
    if Path(folder).resolve() not in path.parents:
        raise ValueError(f"{tensor.name}: external data {info['location']!r} is outside "
                         f"{folder}")
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type))
    count = int(np.prod(tensor.dims, dtype=np.int64))
    with open(path, "rb") as f:
        f.seek(int(info.get("offset", 0)))
        data = np.fromfile(f, dtype=dtype.newbyteorder("<"), count=count)
    if data.size != count:
        raise ValueError(f"{tensor.name}: {path} ends before its {count} values")
    return data.reshape(tuple(tensor.dims))


def _eligible(node: onnx.NodeProto, initializers: dict[str, onnx.TensorProto]) -> bool:
    if node.op_type != "MatMulNBits" or node.domain != "com.microsoft":
        return False
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    inputs = list(node.input)
    while inputs and not inputs[-1]:
        inputs.pop()
    return (len(inputs) == 3 and inputs[1] in initializers and inputs[2] in initializers
            and attrs.get("bits", 4) == 4 and attrs.get("block_size") == BLOCK
            and attrs.get("accuracy_level", 0) == 4 and attrs.get("K", 0) % 64 == 0
            and attrs.get("K", 0) > 0 and attrs.get("N", 0) > 0)


def _halves_hold(scales: np.ndarray) -> bool:
    """float16 keeps every scale to 2^-11 (normal range; zero stays zero)."""
    mags = np.abs(np.asarray(scales, np.float32))
    return bool(np.all(mags < 65000) and np.all((mags == 0) | (mags >= 2.0 ** -14)))


def rewrite_int4(model: onnx.ModelProto, folder: Path, threads: int) -> int:
    """Every eligible MatMulNBits of `model` (its external data under `folder`) becomes a
    MatMulInt4 reading packed rows, held in the model, its rows split over `threads`; the
    count rewritten. A projection whose scales float16 cannot hold stays MatMulNBits."""
    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    done, replaced = 0, set()
    for node in graph.node:
        if not _eligible(node, initializers):
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        k, n = int(attrs["K"]), int(attrs["N"])
        b = initializer_array(initializers[node.input[1]], folder)
        scales = initializer_array(initializers[node.input[2]], folder)
        if not _halves_hold(scales):
            continue
        rows_name = f"{node.output[0]}/int4_rows"  # output names are unique in a graph
        graph.initializer.append(numpy_helper.from_array(pack_rows(b, scales, k, n), rows_name))
        replaced.update(node.input[1:3])
        new = helper.make_node(OP, [node.input[0], rows_name], list(node.output), name=node.name,
                               domain=DOMAIN, K=k, N=n, threads=threads)
        node.CopyFrom(new)
        done += 1
    if done:
        used = {name for node in graph.node for name in node.input}
        keep = [t for t in graph.initializer if t.name not in replaced or t.name in used]
        del graph.initializer[:]
        graph.initializer.extend(keep)
        if not any(o.domain == DOMAIN for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return done
