"""Which axis of each DynamicQuantizeLinear's input holds the forward's tokens, read off the
running model (for passes/token_quant.py).

Each input is probed after 3 cached tokens with 1 and with 3 new ones, and after 6 cached
with 1 new (random ids each time):

    tokens on axis a   one axis is 1, 3 and 1 long and every other dim stays: quantized per
                       slice along a, a one-token forward quantizes the whole tensor as
                       before
    constant           the same shape and the same values all three times (optimum's
                       quantized rotary: the frequencies), quantized per tensor as before:
                       the same scale in any forward

Anything else (a dim that moves with the cache, values that move while no dim does) is
refused naming the node: its per-tensor scale mixes what a token-by-token run keeps apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

from dspark.compiler.contract import InputContract
from dspark.compiler.passes.probe import ProbeShape, feeds
from dspark.runtime.errors import ModelInputError
from dspark.runtime.model.sessions import make_session

DQL = "DynamicQuantizeLinear"
SHAPES = (ProbeShape(1, 3, 1), ProbeShape(1, 3, 3), ProbeShape(1, 6, 1))


@dataclass(frozen=True)
class TokenAxis:
    axis: int | None  # None: the input does not move with the tokens (a constant)
    shape: tuple[int, ...]  # its shape in a one-token forward


def quantizers(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == DQL and n.domain in ("", "ai.onnx")]


def token_axes(model: onnx.ModelProto, contract: InputContract, path
               ) -> dict[str, TokenAxis]:
    """Per DynamicQuantizeLinear (keyed by its first output): its input's token axis.
    `model` holds its weights; it is left as it was."""
    nodes = quantizers(model)
    inputs = sorted({n.input[0] for n in nodes})
    outputs = {o.name for o in model.graph.output}
    added = [onnx.helper.make_tensor_value_info(x, onnx.TensorProto.FLOAT, None)
             for x in inputs if x not in outputs]
    model.graph.output.extend(added)
    try:
        session = make_session(model.SerializeToString(), level="basic")
    finally:
        del model.graph.output[len(model.graph.output) - len(added):]
    rng = np.random.default_rng(0)
    runs = [dict(zip(inputs, session.run(inputs, feeds(
        contract, s, rng.integers(0, 32, (s.batch, s.new)))))) for s in SHAPES]
    return {n.output[0]: _axis(n, [r[n.input[0]] for r in runs], path) for n in nodes}


def _axis(node: onnx.NodeProto, seen: list[np.ndarray], path) -> TokenAxis:
    one, three, later = seen
    if (one.shape == three.shape == later.shape and np.array_equal(one, three)
            and np.array_equal(one, later)):
        return TokenAxis(None, one.shape)
    moved = [i for i, (a, b) in enumerate(zip(one.shape, three.shape)) if a != b]
    if (one.ndim == three.ndim and later.shape == one.shape and len(moved) == 1
            and (one.shape[moved[0]], three.shape[moved[0]]) == (1, 3)):
        return TokenAxis(moved[0], one.shape)
    hint = (" (it holds cached tokens: an attention's keys or values, quantized with the "
            "cache; quantize the model without its attention MatMuls)"
            if later.shape != one.shape else "")
    raise ModelInputError(
        f"{path}: {DQL} node '{node.name}' quantizes {node.input[0]} per tensor, which is "
        f"{list(one.shape)} for one new token, {list(three.shape)} for three and "
        f"{list(later.shape)} after more cached tokens: no one axis of tokens to quantize it "
        f"by{hint}")
