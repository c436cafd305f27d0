"""Large attention windows (prefill) through onnxruntime, on the shared thread pool.

A window of n new tokens over L keys costs O(n L) per head: for a long prompt numpy at one
thread took longer than the rest of the prefill. This small graph runs the same math
multi-threaded on onnxruntime's pool, where numpy threads would fight it for the cores:

    q [kv, g, n, d] --MatMul(K^T [kv, 1, d, L])--> [kv, g, n, L] --+bias [n, L], Softmax-->
    --MatMul(V [kv, 1, L, d])--> [kv, g, n, d]
"""

from __future__ import annotations

import functools

import numpy as np
from onnx import TensorProto, helper

from dspark.runtime.model.sessions import make_session


def _graph() -> bytes:
    f = TensorProto.FLOAT
    nodes = [
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "kt"], ["s"]),
        helper.make_node("Add", ["s", "bias"], ["b"]),
        helper.make_node("Softmax", ["b"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "v"], ["out"]),
    ]
    graph = helper.make_graph(
        nodes, "dspark_attention",
        [helper.make_tensor_value_info(n, f, s) for n, s in (
            ("q", ["kv", "g", "n", "d"]), ("k", ["kv", 1, "L", "d"]), ("v", ["kv", 1, "L", "d"]),
            ("bias", ["n", "L"]))],
        [helper.make_tensor_value_info("out", f, ["kv", "g", "n", "d"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return model.SerializeToString()


@functools.cache
def attention_session():
    return make_session(_graph())


def ort_attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, bias: np.ndarray,
               scale: float) -> np.ndarray:
    """Same contract as paged_attention.attend for a window (bias given), float32."""
    heads, n, dim = q.shape
    kv = k.shape[0]
    qs = (q.reshape(kv, heads // kv, n, dim) * np.float32(scale)).astype(np.float32)
    feeds = {"q": qs, "k": np.ascontiguousarray(k[:, None], np.float32),
             "v": np.ascontiguousarray(v[:, None], np.float32), "bias": bias}
    [out] = attention_session().run(["out"], feeds)
    return out.reshape(heads, n, dim).astype(q.dtype, copy=False)
