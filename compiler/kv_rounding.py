"""The original model with its KV cache rounded as the runtime's is (`--kv-cache-dtype`).

A float16 or int8 cache is another model function: every key and value attention reads has
been stored and read back (runtime/cache/kv_rows.py, kernels/cpu_kv.c), the token's own
included. So the reference `dsc verify` and the lossless tests compare against is the
original with each layer's new keys and values rounded the same way where they enter its
cache, before anything reads them:

    new k ---> Concat(past, .) ---> present, scores        (an eager or SDPA export)
        \\__ round __/
    new k ---> Attention(q, ., v, mask, past k, past v)    (ONNX Attention with a cache)

    float16:  Cast(float16) -> Cast(float32)
    int8:     s = ReduceMax(|k|, last axis) / 127;  Round(k / Where(s == 0, 1, s)),
              clipped to [-127, 127], times s
The ONNX ops round as the runtime does (IEEE float32 operations, ties to even), so the
original rounds bit for bit as the bundle stores. Models whose attention takes the new keys
before rotating them (onnxruntime-genai's GroupQueryAttention) are refused naming the node.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from dspark.compiler.contract import check_contract, model_file
from dspark.compiler.passes.attention import _split_present
from dspark.runtime.errors import UnmappableAttentionError

PREFIX = "/dspark/kv_round"


def _rounded(graph: gs.Graph, x: gs.Variable, dtype: str, where: str, opset: int
             ) -> gs.Variable:
    """`x` (float32, values on its last axis) as the cache stores and reads it back."""
    def node(op: str, inputs: list, suffix: str, **attrs) -> gs.Variable:
        out = gs.Variable(f"{where}/{suffix}", dtype=np.float32)
        graph.nodes.append(gs.Node(op, f"{where}/{suffix}_node", attrs, inputs, [out]))
        return out

    if dtype == "float16":
        half = node("Cast", [x], "half", to=onnx.TensorProto.FLOAT16)
        half.dtype = np.float16
        return node("Cast", [half], "float", to=onnx.TensorProto.FLOAT)
    const = lambda name, v: gs.Constant(f"{where}/{name}", np.array(v, np.float32))  # noqa: E731
    size = node("Abs", [x], "abs")
    if opset >= 18:
        top = node("ReduceMax", [size, gs.Constant(f"{where}/axes", np.array([-1], np.int64))],
                   "max", keepdims=1)
    else:
        top = node("ReduceMax", [size], "max", axes=[-1], keepdims=1)
    scale = node("Div", [top, const("q127", 127.0)], "scale")
    zero = node("Equal", [scale, const("zero", 0.0)], "is_zero")
    zero.dtype = np.bool_
    safe = node("Where", [zero, const("one", 1.0), scale], "safe")
    steps = node("Round", [node("Div", [x, safe], "ratio")], "round")
    clipped = node("Clip", [steps, const("low", -127.0), const("high", 127.0)], "clip")
    return node("Mul", [clipped, scale], "value")


def kv_rounded(path: Path, dtype: str, jitter: float = 0.0) -> onnx.ModelProto:
    """The original model at `path` (weights loaded) with its cache rounded to `dtype`
    (float16 or int8); float32 returns it as it is. `jitter`: each new key and value is
    first scaled by 1 + jitter (dsc verify's floor: how far float32 differences below the
    rounding move the logits once a rounding flips)."""
    path = model_file(path)
    model = onnx.load(str(path))
    if dtype == "float32":
        return model
    contract = check_contract(path, model)
    if contract.kv_dtype != onnx.TensorProto.FLOAT:
        raise UnmappableAttentionError(
            f"{path}: --kv-cache-dtype {dtype}: the model's own cache is not float32; a "
            "rounded reference is made for float32 caches only")
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 17)
    graph = gs.import_onnx(model)
    tensors = graph.tensors()
    for node in graph.nodes:
        if node.op == "GroupQueryAttention":
            raise UnmappableAttentionError(
                f"{path}: --kv-cache-dtype {dtype}: GroupQueryAttention node '{node.name}' "
                "caches keys it rotates itself: the original cannot be rounded as the bundle "
                "stores them (serve it with a float32 cache, or verify without the flag)")
    for layer in range(contract.num_layers):
        for kind, index in (("key", 1), ("value", 2)):
            new, consumer = _split_present(tensors, contract, layer, kind)
            if consumer.op == "Attention":
                new = consumer.inputs[index]
            slot = next(i for i, t in enumerate(consumer.inputs) if t is new)
            where = f"{PREFIX}/layers.{layer}/{kind}"
            if jitter:
                moved = gs.Variable(f"{where}/jittered", dtype=np.float32)
                graph.nodes.append(gs.Node("Mul", f"{where}/jitter", {}, [new, gs.Constant(
                    f"{where}/factor", np.array(1 + jitter, np.float32))], [moved]))
                new = moved
            consumer.inputs[slot] = _rounded(graph, new, dtype, where, opset)
    graph.cleanup().toposort()
    out = gs.export_onnx(graph)
    out.ir_version = model.ir_version
    return out
