"""Per-tensor dynamic activation quantization made per token.

onnxruntime's `quantize_dynamic` (and optimum's `ORTQuantizer` dynamic configs, and the
`model_quantized.onnx` files made with them) quantize each projection's input with one
`DynamicQuantizeLinear`: one scale and zero point over the whole tensor, every token of the
forward together. Such a model is causal only one token at a time: in a forward of several
tokens, a later token moves the scale an earlier one is rounded with (the probe's causality
check measured 0.55 on a tiny Llama). A speculative verify feeds several tokens, so it would
not compute what plain decoding does.

This pass gives each token its own scale and zero point: each quantized input's token axis
is read off the running model (passes/token_axes.py), and the input is quantized per slice
along it, as `DynamicQuantizeLinear` quantizes a one-token tensor, in ONNX ops:

    min, max   = ReduceMin / ReduceMax over every other axis, each widened to include 0
    scale      = (max - min) / 255, or 1 where max == min
    zero point = Round(Clip(0 - min / scale, 0, 255))
    y          = Clip(Round(x / scale) + zero point, 0, 255)

so a one-token forward is the original's bit for bit (tests/test_token_quant.py holds the op
against onnxruntime's a row at a time), and a forward of many tokens computes each of them as
that one-token forward would. An input that does not move with the tokens (a constant) keeps
its one scale. The tokens must be the rows of a product's first input or the columns of its
second. onnxruntime's `MatMulInteger` takes only a scalar zero point, so the product runs
without the per-token one and subtracts it times the other side's sums over the shared axis
(minus that side's own zero point), exact in int32:

    sum_k (y_k - zp)(w_kn - wzp) = sum_k y_k (w_kn - wzp) - zp * sum_k (w_kn - wzp)

(a stored weight's sums are constants; a run-time operand's, optimum's quantized rotary,
are computed). The scale becomes one per token; its consumers must be elementwise multiplies
(the dequantization), whose broadcast then gives each token its own. onnxruntime's fused
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

from dspark.compiler.passes.token_axes import DQL, quantizers, token_axes
from dspark.runtime.errors import ModelInputError

_TO_FLOAT = "MatMulIntegerToFloat"  # onnxruntime's fusion: product, scales and bias
_DQMM = "DynamicQuantizeMatMul"  # onnxruntime's fusion of all of a projection
_MS = "com.microsoft"


def per_token_quantized(model: onnx.ModelProto) -> bool:
    """Whether the model quantizes activations per tensor (a DynamicQuantizeLinear, or
    onnxruntime's DynamicQuantizeMatMul)."""
    return any((n.op_type, n.domain) in ((DQL, ""), (DQL, "ai.onnx"), (_DQMM, _MS))
               for n in model.graph.node)


def split_fused(model: onnx.ModelProto) -> None:
    """Each DynamicQuantizeMatMul (onnxruntime's fusion of one projection) as the
    DynamicQuantizeLinear and MatMulIntegerToFloat it stands for, in its place."""
    nodes = []
    for n in model.graph.node:
        if (n.op_type, n.domain) == (_DQMM, _MS):
            a, b, b_scale, b_zp, bias = (list(n.input) + [""] * 5)[:5]
            q, s, z = (f"{n.name or n.output[0]}/quantized_{k}" for k in ("x", "scale", "zero"))
            nodes.append(helper.make_node(DQL, [a], [q, s, z], name=q + "_node"))
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

    def reduce(self, op: str, x: str, axes: list[int], what: str) -> str:
        # axes became an input in opset 13 for ReduceSum, in 18 for the others
        if self.opset >= (13 if op == "ReduceSum" else 18):
            return self.op(op, [x, self.const("axes", np.array(axes, np.int64))], what,
                           keepdims=1)
        return self.op(op, [x], what, axes=axes, keepdims=1)


def _quantize(e: _Emitter, x: str, axes: list[int]) -> tuple[str, str, str]:
    """y (uint8), scale and zero point (uint8), the last two reduced over `axes`."""
    zero = e.const("zero", np.array(0, np.float32))
    q_max = e.const("q_max", np.array(255, np.float32))
    low = e.op("Min", [e.reduce("ReduceMin", x, axes, "token_min"), zero], "low")
    high = e.op("Max", [e.reduce("ReduceMax", x, axes, "token_max"), zero], "high")
    span = e.op("Sub", [high, low], "span")
    flat = e.op("Equal", [span, zero], "flat")
    scale = e.op("Where", [flat, e.const("one", np.array(1, np.float32)),
                           e.op("Div", [span, q_max], "span_255")], "scale")
    start = e.op("Sub", [zero, e.op("Div", [low, scale], "low_scaled")], "zero_start")
    zp_f = e.op("Round", [e.op("Clip", [start, zero, q_max], "zero_clipped")], "zero_point_f")
    shifted = e.op("Add", [e.op("Round", [e.op("Div", [x, scale], "x_scaled")], "x_round"), zp_f],
                   "x_shifted")
    y = e.op("Cast", [e.op("Clip", [shifted, zero, q_max], "x_clipped")], "y",
             to=TensorProto.UINT8)
    return y, scale, e.op("Cast", [zp_f], "zero_point", to=TensorProto.UINT8)


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


# where each operand of a product sits: (data, scale, zero point) input indices
_OPERANDS = {"MatMulInteger": ((0, None, 2), (1, None, 3)),
             _TO_FLOAT: ((0, 2, 4), (1, 3, 5))}


def _check_uses(node: onnx.NodeProto, consumers: dict[str, list[onnx.NodeProto]], path
                ) -> None:
    """Each output of the DynamicQuantizeLinear goes where a per-token form can follow:
    its data and zero point into products, its scale into multiplies."""
    allowed = {0: {(op, s[0]) for op, sides in _OPERANDS.items() for s in sides},
               1: {("Mul", 0), ("Mul", 1), (_TO_FLOAT, 2), (_TO_FLOAT, 3)},
               2: {(op, s[2]) for op, sides in _OPERANDS.items() for s in sides}}
    what = {0: "output", 1: "scale", 2: "zero point"}
    for k, name in enumerate(node.output[:3]):
        for c in consumers[name]:
            if any((c.op_type, i) not in allowed[k] for i, x in enumerate(c.input) if x == name):
                raise ModelInputError(
                    f"{path}: DynamicQuantizeLinear node '{node.name}': its {what[k]} feeds "
                    f"{c.op_type} node '{c.name}', which a per-token scale cannot follow: "
                    "cannot quantize per token")


class _Sums:
    """The other operand's sums over the shared axis, minus its zero point (int32): a
    constant for a stored weight, else computed in the graph."""

    def __init__(self, inits: dict[str, onnx.TensorProto]):
        self.inits = inits

    def __call__(self, e: _Emitter, data: str, zero_point: str, axis: int) -> str:
        if data in self.inits and (not zero_point or zero_point in self.inits):
            values = numpy_helper.to_array(self.inits[data]).astype(np.int64)
            if zero_point:
                values = values - numpy_helper.to_array(self.inits[zero_point]).astype(np.int64)
            return e.const("sums", values.sum(axis=axis, keepdims=True).astype(np.int32))
        values = e.op("Cast", [data], "operand_i32", to=TensorProto.INT32)
        if zero_point:
            values = e.op("Sub", [values, e.op("Cast", [zero_point], "operand_zero_i32",
                                               to=TensorProto.INT32)], "operand_shifted")
        return e.reduce("ReduceSum", values, [axis], "sums")


def _product(e: _Emitter, c: onnx.NodeProto, side: int, y: str, scale: str, zp: str,
             sums: _Sums, per_token: set[str], path) -> None:
    """Consumer c of the per-token operand (side 0: rows, 1: columns) rewritten in place,
    its correction nodes emitted by e (placed before it). `per_token`: the data outputs of
    every quantization made per token."""
    ins = list(c.input) + [""] * 7
    mine, other = _OPERANDS[c.op_type][side], _OPERANDS[c.op_type][1 - side]
    other_data, other_zp = ins[other[0]], ins[other[2]]
    if other_data in per_token:
        raise ModelInputError(f"{path}: {c.op_type} node '{c.name}': both of its inputs are "
                              "quantized per token; cannot quantize per token")
    no_zp = e.const("no_zero_point", np.array(0, np.uint8))
    if side == 0:  # A per token; B's own zero point stays (left out where it has none)
        operands = [y, other_data, no_zp] + [other_zp] * bool(other_zp)
    elif other_zp:
        operands = [other_data, y, other_zp, no_zp]
    else:
        raise ModelInputError(f"{path}: {c.op_type} node '{c.name}': its first input has no "
                              "zero point; cannot quantize its second per token")
    raw = e.op("MatMulInteger", operands, "product")
    other_sums = sums(e, other_data, other_zp, -2 if side == 0 else -1)
    zp32 = e.op("Cast", [zp], "zero_point_i32", to=TensorProto.INT32)
    shift = e.op("Mul", [zp32, other_sums], "zero_point_share")
    if c.op_type == "MatMulInteger":
        _become(c, "Sub", [raw, shift])
        return
    exact = e.op("Sub", [raw, shift], "exact")
    product = e.op("Cast", [exact], "exact_f", to=TensorProto.FLOAT)
    scaled = e.op("Mul", [scale if k == mine[1] else ins[k] for k in (2, 3)], "scales")
    if ins[6]:
        _become(c, "Add", [e.op("Mul", [product, scaled], "dequantized"), ins[6]])
    else:
        _become(c, "Mul", [product, scaled])


def make_per_token(model: onnx.ModelProto, path, axes: dict, jitter: float = 0.0) -> int:
    """Rewrite every DynamicQuantizeLinear whose input moves with the tokens (and its
    products) per token, in place; the number rewritten. `axes`: token_axes() of the model
    after split_fused(); its weights must be loaded (constant sums).
    `jitter`: first multiply each projection input by 1 +- jitter, the sign fixed per feature
    (dsc verify's measure of how far the rounding carries a float difference that small)."""
    g = model.graph
    consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for n in g.node:
        for i in n.input:
            consumers[i].append(n)
    sums = _Sums({t.name: t for t in g.initializer})
    per_token = {n.output[0] for n in g.node if n.output and axes.get(n.output[0])
                 and axes[n.output[0]].axis is not None}
    placed: dict[int, list[onnx.NodeProto]] = {}
    done = 0
    for n in quantizers(model):
        if axes[n.output[0]].axis is None:
            continue
        token = axes[n.output[0]]
        rank, axis = len(token.shape), token.axis
        y_old, scale_old, zp_old = (list(n.output) + ["", "", ""])[:3]
        _check_uses(n, consumers, path)
        e = _Emitter(n.name or y_old, _opset(model))
        x = n.input[0]
        if jitter and axis == rank - 2:
            x = e.op("Mul", [x, e.const("jitter", _jitter(token.shape[-1], jitter))], "jittered")
        # every other axis longer than 1, counted from the end: a projection's input
        # [1, T, K] reduces over [-1] alone (the form runtime/model/quant_rows.py runs in C);
        # where none is, one of length 1 (no axes at all would reduce over every axis)
        others = [i - rank for i in range(rank) if i != axis]
        y, scale, zp = _quantize(e, x, [i for i in others if token.shape[i] != 1] or others[:1])
        for c in consumers[y_old]:
            side = list(c.input).index(y_old)
            if axis != rank - 2 + side:
                raise ModelInputError(
                    f"{path}: {c.op_type} node '{c.name}': its {('first', 'second')[side]} "
                    f"input holds the tokens on axis {axis} of {rank}, not as its "
                    f"{('rows', 'columns')[side]}; cannot quantize per token")
            fix = _Emitter(f"{c.name or c.output[0]}", _opset(model))
            _product(fix, c, side, y, scale, zp, sums, per_token, path)
            placed[id(c)] = fix.nodes + [c]
            g.initializer.extend(fix.inits)
        for c in consumers[scale_old]:
            c.input[:] = [scale if i == scale_old else i for i in c.input]
        placed[id(n)] = e.nodes
        g.initializer.extend(e.inits)
        done += 1
    if done:
        order = [m for n in g.node for m in placed.get(id(n), [n])]
        del g.node[:]
        g.node.extend(order)
    return done


def per_token_model(model: onnx.ModelProto, contract, path, jitter: float = 0.0) -> int:
    """The whole pass on a model with its weights, in place: fused forms split, token axes
    probed, quantizations rewritten; the number rewritten."""
    split_fused(model)
    return make_per_token(model, path, token_axes(model, contract, path), jitter)
