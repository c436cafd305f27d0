"""Per-tensor dynamic activation quantization made per token.

onnxruntime's `quantize_dynamic` (and optimum's `ORTQuantizer` dynamic configs, and the
`model_quantized.onnx` files made with them) quantize each projection's input with one
`DynamicQuantizeLinear`: one scale and zero point over the whole tensor, every token of the
forward together. Such a model is causal only one token at a time: in a forward of several
tokens, a later token moves the scale an earlier one is rounded with (the probe's causality
check measured 0.55 on a tiny Llama). A speculative verify feeds several tokens, so it would
not compute what plain decoding does.

This pass gives each token (each row of the last axis) its own scale and zero point,
computed as the `DynamicQuantizeLinear` computes them for a one-token tensor, in ONNX ops:

    min, max   = ReduceMin / ReduceMax of the row, each widened to include 0
    scale      = (max - min) / 255, or 1 where max == min
    zero point = Round(Clip(0 - min / scale, 0, 255))
    y          = Clip(Round(x / scale) + zero point, 0, 255)

so a one-token forward is the original's bit for bit (tests/test_token_quant.py holds the op
against onnxruntime's on a row at a time), and a forward of many tokens computes each of them
as that one-token forward would. onnxruntime's `MatMulInteger` takes only a scalar zero point
for its first input, so each consumer runs without it and subtracts zero point x the weight's
column sums (minus its own zero points), exact in int32:

    sum_k (y_k - zp)(w_kn - wzp_n) = sum_k y_k (w_kn - wzp_n) - zp * sum_k (w_kn - wzp_n)

The scale becomes one per row ([..., T, 1]); its consumers must be elementwise multiplies
(the dequantization), whose broadcast then gives each row its own. onnxruntime's fused
`MatMulIntegerToFloat` (a model saved after its extended optimizations) takes a scale per
tensor or per column only, so it is unfused the same way: the product as above, as float,
times the two scales, plus its bias (a DynamicQuantizeMatMul is first split into the
DynamicQuantizeLinear and MatMulIntegerToFloat it fuses). Any other consumer is refused,
naming the node.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from dspark.runtime.errors import ModelInputError

_DQL = "DynamicQuantizeLinear"
_TO_FLOAT = "MatMulIntegerToFloat"  # onnxruntime's fusion: product, scales and bias
_DQMM = "DynamicQuantizeMatMul"  # onnxruntime's fusion of all of a projection
_MS = "com.microsoft"


def per_token_quantized(model: onnx.ModelProto) -> bool:
    """Whether the model quantizes activations per tensor (a DynamicQuantizeLinear, or
    onnxruntime's DynamicQuantizeMatMul)."""
    return any((n.op_type, n.domain) in ((_DQL, ""), (_DQL, "ai.onnx"), (_DQMM, _MS))
               for n in model.graph.node)


def _split_fused(model: onnx.ModelProto) -> None:
    """Each DynamicQuantizeMatMul (onnxruntime's fusion of one projection) as the
    DynamicQuantizeLinear and MatMulIntegerToFloat it stands for, in its place."""
    nodes = []
    for n in model.graph.node:
        if (n.op_type, n.domain) == (_DQMM, _MS):
            a, b, b_scale, b_zp, bias = (list(n.input) + [""] * 5)[:5]
            q, s, z = (f"{n.name or n.output[0]}/quantized_{k}" for k in ("x", "scale", "zero"))
            nodes.append(helper.make_node(_DQL, [a], [q, s, z], name=q + "_node"))
            n.op_type = _TO_FLOAT
            del n.input[:]
            n.input.extend([q, b, s, b_scale, z, b_zp, bias])
        nodes.append(n)
    del model.graph.node[:]
    model.graph.node.extend(nodes)


def _opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


class _Emitter:
    """New nodes and constants, named after the node they replace."""

    def __init__(self, prefix: str, opset: int):
        self.prefix, self.opset = prefix, opset
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.count = 0

    def name(self, what: str) -> str:
        self.count += 1
        return f"{self.prefix}/per_token/{what}_{self.count}"

    def const(self, what: str, value: np.ndarray) -> str:
        name = self.name(what)
        self.inits.append(numpy_helper.from_array(value, name))
        return name

    def op(self, op: str, inputs: list[str], what: str, **attrs) -> str:
        out = self.name(what)
        self.nodes.append(helper.make_node(op, inputs, [out], name=out + "_node", **attrs))
        return out

    def reduce(self, op: str, x: str, what: str) -> str:
        if self.opset >= 18:
            return self.op(op, [x, self.const("axes", np.array([-1], np.int64))], what,
                           keepdims=1)
        return self.op(op, [x], what, axes=[-1], keepdims=1)


def _quantize_rows(e: _Emitter, x: str) -> tuple[str, str, str, str]:
    """y (uint8), scale [..., 1], zero point (uint8, [..., 1]) and that zero point in float."""
    zero = e.const("zero", np.array(0, np.float32))
    q_max = e.const("q_max", np.array(255, np.float32))
    low = e.op("Min", [e.reduce("ReduceMin", x, "row_min"), zero], "low")
    high = e.op("Max", [e.reduce("ReduceMax", x, "row_max"), zero], "high")
    span = e.op("Sub", [high, low], "span")
    flat = e.op("Equal", [span, zero], "flat")
    scale = e.op("Where", [flat, e.const("one", np.array(1, np.float32)),
                           e.op("Div", [span, q_max], "span_255")], "scale")
    start = e.op("Sub", [zero, e.op("Div", [low, scale], "low_scaled")], "zero_start")
    zp_f = e.op("Round", [e.op("Clip", [start, zero, q_max], "zero_clipped")], "zero_point_f")
    shifted = e.op("Add", [e.op("Round", [e.op("Div", [x, scale], "x_scaled")], "x_round"), zp_f],
                   "x_shifted")
    y = e.op("Cast", [e.op("Clip", [shifted, zero, q_max], "x_clipped")], "y", to=TensorProto.UINT8)
    zp = e.op("Cast", [zp_f], "zero_point", to=TensorProto.UINT8)
    return y, scale, zp, zp_f


def _jitter(features: int, size: float) -> np.ndarray:
    """1 +- size per feature, the signs fixed (seeded)."""
    signs = np.random.default_rng(0).choice(np.array([-1.0, 1.0]), features)
    return (1.0 + size * signs).astype(np.float32)


def _become(node: onnx.NodeProto, op: str, inputs: list[str]) -> None:
    """The node, in its place and with its output, turned into `op` of `inputs`."""
    node.op_type, node.domain = op, ""
    del node.input[:]
    node.input.extend(inputs)
    del node.attribute[:]


def _check_uses(node: onnx.NodeProto, consumers: dict[str, list[onnx.NodeProto]], path
                ) -> None:
    """Each output of the DynamicQuantizeLinear goes where a per-token form can follow:
    its data and zero point into integer products, its scale into multiplies."""
    allowed = {  # output -> (op, input index) it may feed
        0: {("MatMulInteger", 0), (_TO_FLOAT, 0)},
        1: {("Mul", 0), ("Mul", 1), (_TO_FLOAT, 2)},
        2: {("MatMulInteger", 2), (_TO_FLOAT, 4)},
    }
    what = {0: "output", 1: "scale", 2: "zero point"}
    for k, name in enumerate(node.output[:3]):
        for c in consumers[name]:
            if any((c.op_type, i) not in allowed[k] for i, x in enumerate(c.input) if x == name):
                raise ModelInputError(
                    f"{path}: DynamicQuantizeLinear node '{node.name}': its {what[k]} feeds "
                    f"{c.op_type} node '{c.name}', which a per-token scale cannot follow: "
                    "cannot quantize per token")


def _weight(inits: dict[str, onnx.TensorProto], name: str, node: onnx.NodeProto,
            what: str, path) -> np.ndarray:
    if name not in inits:
        raise ModelInputError(
            f"{path}: {node.op_type} node '{node.name}': its {what} is computed at run time, "
            "not a stored weight; cannot quantize its input per token")
    return numpy_helper.to_array(inits[name])


def make_per_token(model: onnx.ModelProto, path, jitter: float = 0.0) -> int:
    """Rewrite every DynamicQuantizeLinear (and its MatMulInteger consumers) per token, in
    place; the number rewritten. The model's weights must be loaded (column sums).
    `jitter`: first multiply each quantized input by 1 +- jitter, the sign fixed per feature
    (dsc verify's measure of how far the rounding carries a float difference that small)."""
    _split_fused(model)
    g = model.graph
    consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for n in g.node:
        for i in n.input:
            consumers[i].append(n)
    inits = {t.name: t for t in g.initializer}
    replaced: dict[int, list[onnx.NodeProto]] = {}
    done = 0
    for n in list(g.node):
        if n.op_type != _DQL or n.domain not in ("", "ai.onnx"):
            continue
        y_old, scale_old, zp_old = (list(n.output) + ["", "", ""])[:3]
        e = _Emitter(n.name or y_old, _opset(model))
        x = n.input[0]
        if jitter:
            first = next((c for c in consumers[y_old] if c.input[1] in inits), None)
            if first is not None:
                features = inits[first.input[1]].dims[-2]
                x = e.op("Mul", [x, e.const("jitter", _jitter(features, jitter))], "jittered")
        y, scale, zp, _ = _quantize_rows(e, x)
        _check_uses(n, consumers, path)
        zp32 = e.op("Cast", [zp], "zero_point_i32", to=TensorProto.INT32)
        # a zero point of 0 given, not left out: an empty input name trips onnx's checker
        # once graphsurgeon has been through the graph
        no_zp = e.const("no_zero_point", np.array(0, np.uint8))
        for c in consumers[y_old]:
            fused = c.op_type == _TO_FLOAT
            inputs = list(c.input) + [""] * 7
            w = _weight(inits, inputs[1], c, "weight", path).astype(np.int64)
            wzp_name = inputs[5] if fused else inputs[3]
            wzp = (_weight(inits, wzp_name, c, "weight zero point", path).astype(np.int64)
                   if wzp_name else np.zeros((), np.int64))
            sums = e.const("column_sums", (w - wzp).sum(axis=-2).astype(np.int32))
            raw = e.op("MatMulInteger", [y, inputs[1], no_zp] + [wzp_name] * bool(wzp_name),
                       "matmul")
            shift = e.op("Mul", [zp32, sums], "zero_point_share")
            if not fused:
                _become(c, "Sub", [raw, shift])
                continue
            # MatMulIntegerToFloat: (A B) as float x (a_scale b_scale) (+ bias), unfused, its
            # scale and bias read where the quantization was
            for k, what in ((3, "weight scale"), (6, "bias")):
                if inputs[k]:
                    _weight(inits, inputs[k], c, what, path)
            product = e.op("Cast", [e.op("Sub", [raw, shift], "product")], "product_f",
                           to=TensorProto.FLOAT)
            scaled = e.op("Mul", [scale, inputs[3]], "scales")
            if inputs[6]:
                _become(c, "Add", [e.op("Mul", [product, scaled], "dequantized"), inputs[6]])
            else:
                _become(c, "Mul", [product, scaled])
        for c in consumers[scale_old]:
            c.input[:] = [scale if i == scale_old else i for i in c.input]
        replaced[id(n)] = e.nodes
        g.initializer.extend(e.inits)
        done += 1
    if done:
        order = []
        for n in g.node:
            order.extend(replaced.get(id(n), [n]))
        del g.node[:]
        g.node.extend(order)
    return done
