"""The float16 original with one float32 ulp of difference: `dsc verify`'s floor for it.

onnxruntime runs a float16 model's MatMuls, Softmax and norms in float32 between casts
(passes/attention.py `widening`), rounding to float16 where a cast back remains. The bundle
computes the same ops with other summation orders (its attention, its batching of tokens),
so a value a float32 ulp away may round to the other float16 neighbour, and that moves every
later logit. How far is measured on the original itself: its optimized graph with each
float32 region's run-time inputs (the casts up from float16) moved by one float32 ulp.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from dspark.compiler.passes.optimize import pin_casts
from dspark.runtime.model.sessions import make_session

JITTER = 2.0 ** -23  # one float32 ulp


# ops that take float16 constants as a quantized weight's scales, computing in float32
SCALE_OPS = frozenset({"MatMulNBits", "GatherBlockQuantized", "DequantizeLinear", "MatMulBnb4"})


def computes_in_float16(header: onnx.ModelProto) -> bool:
    """Casts to float16, or float16 constants beyond quantized weights' scales (an int4
    model's MatMulNBits): onnxruntime then rounds to float16 between float32 regions."""
    half = {t.name for t in header.graph.initializer if t.data_type == onnx.TensorProto.FLOAT16}
    for n in header.graph.node:
        if n.op_type == "Cast" and any(a.name == "to" and a.i == onnx.TensorProto.FLOAT16
                                       for a in n.attribute):
            return True
        if n.op_type not in SCALE_OPS and half.intersection(n.input):
            return True
    return False


def _types(model: onnx.ModelProto) -> dict[str, int]:
    inferred = onnx.shape_inference.infer_shapes(model)
    g = inferred.graph
    types = {v.name: v.type.tensor_type.elem_type
             for v in (*g.value_info, *g.input, *g.output)}
    types.update({t.name: t.data_type for t in model.graph.initializer})
    return types


def jittered(path: Path, factor: float = 1.0 + JITTER) -> bytes:
    """The original, as onnxruntime optimizes it, with every run-time float16 tensor cast up
    to float32 multiplied by `factor` (constants such as exponents left alone)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "optimized.onnx"
        make_session(path, level="basic", optimized_path=out, config={
            "session.optimized_model_external_initializers_file_name": "optimized.weights",
            "session.optimized_model_external_initializers_min_size_in_bytes": "1024"})
        model = onnx.load(str(out))
    pin_casts(model)
    types = _types(model)
    live = {t.name for t in model.graph.input}
    nodes = []
    for n in model.graph.node:
        if any(i in live for i in n.input):
            live.update(n.output)
        nodes.append(n)
        to = next((a.i for a in n.attribute if a.name == "to"), None)
        if not (n.op_type == "Cast" and to == onnx.TensorProto.FLOAT and n.input[0] in live
                and types.get(n.input[0]) == onnx.TensorProto.FLOAT16):
            continue
        out, raw = n.output[0], f"{n.output[0]}/unjittered"
        n.output[0] = raw
        const = f"{out}/jitter"
        model.graph.initializer.append(numpy_helper.from_array(np.array(factor, np.float32),
                                                               const))
        nodes.append(helper.make_node("Mul", [raw, const], [out], name=f"{n.name}/Jitter"))
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model.SerializeToString()
