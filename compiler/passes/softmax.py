"""From an attention's scores to its probabilities, as the exporters and onnxruntime write it.

    scores -> [Mul/Div scale] -> [Add/Where mask] -> Softmax -> [Cast] -> [NaN guard] -> p
The Softmax may be onnxruntime's inlined function body (a float16 model on a CPU), and the
float16 model's casts up to its float32 core pass (`widening`); a cast down is not read
through. Used by passes/attention.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from dspark.compiler.passes.static_value import static_scalar

PROBS_PASS = frozenset({"Cast", "Identity", "Dropout"})
_FLOAT = onnx.TensorProto.FLOAT


def scalar(t: gs.Tensor) -> float | None:
    """t's value if it is one number: a constant, or computed from constants and static
    dims (optimum's GPT-2 computes its scale from the head dim at run time)."""
    if isinstance(t, gs.Constant) and t.values.size == 1:
        return float(t.values.reshape(()))
    return static_scalar(t)


def scale_step(n: gs.Node, t: gs.Tensor) -> float | None:
    """Mul/Div of `t` by a scalar constant: the factor it applies, else None."""
    if n.op not in ("Mul", "Div") or len(n.inputs) != 2:
        return None
    other = n.inputs[1] if n.inputs[0] is t else n.inputs[0]
    c = scalar(other)
    if c is None or (n.op == "Div" and n.inputs[0] is not t):
        return None
    return c if n.op == "Mul" else 1.0 / c


def live_consumers(t: gs.Tensor) -> list[gs.Node]:
    """Consumers that use the values, not only the shape."""
    return [n for n in t.outputs if n.op != "Shape"]


def widening(n: gs.Node) -> bool:
    """A Cast to float32: it keeps every value of its float16 (or float32) input. In a float16
    model, onnxruntime's CPU runs each op that has no float16 kernel (MatMul, Softmax) in
    float32 between such casts, and its optimizer drops the casts back to float16 and up
    again between two of them: the attention's core runs in float32 on float16 keys."""
    return n.op == "Cast" and n.attrs.get("to") == _FLOAT


def float16(t: gs.Tensor) -> bool:
    return t.dtype is not None and np.dtype(t.dtype) == np.float16


@dataclass(frozen=True)
class Softmax:
    name: str
    inp: gs.Variable  # what it normalizes: the masked scores
    out: gs.Variable  # the probabilities


def _last_axis(n: gs.Node) -> bool:
    """A Reduce* over the last of 4 axes, keeping it."""
    axes = n.attrs.get("axes")
    if axes is None and len(n.inputs) > 1 and isinstance(n.inputs[1], gs.Constant):
        axes = n.inputs[1].values.reshape(-1).tolist()
    return list(axes or []) in ([-1], [3]) and n.attrs.get("keepdims", 1) == 1


def _reduce_then(t: gs.Variable, reduce: str, combine: str) -> gs.Node | None:
    """combine(t, reduce(t)) when those two are all t feeds, the reduction over the last
    axis: the combining node."""
    users = live_consumers(t)
    red = next((n for n in users if n.op == reduce), None)
    comb = next((n for n in users if n.op == combine), None)
    if len(users) != 2 or red is None or comb is None or not _last_axis(red):
        return None
    ok = list(comb.inputs) == [t, red.outputs[0]] and live_consumers(red.outputs[0]) == [comb]
    return comb if ok else None


def _inlined_softmax(t: gs.Variable) -> Softmax | None:
    """onnxruntime inlines Softmax's function body where no kernel takes its type (float16
    on a CPU), each step in float32 between casts:
        t --+--> ReduceMax --+
            +--------------> Sub --> Exp --+--> ReduceSum --+
                                           +--------------> Div --> probabilities
    the same arithmetic as the Softmax op."""
    sub = _reduce_then(t, "ReduceMax", "Sub")
    exp = live_consumers(sub.outputs[0]) if sub is not None else []
    if len(exp) != 1 or exp[0].op != "Exp":
        return None
    div = _reduce_then(exp[0].outputs[0], "ReduceSum", "Div")
    return None if div is None else Softmax(div.name or div.outputs[0].name, t, div.outputs[0])


@dataclass(frozen=True)
class ScoreWalk:
    """What lies between the scores and the Softmax: score -> softcap * tanh(scale * score /
    softcap) (softcap 0: scale * score), then the mask (`mask`: its first node's name, or
    the Softmax's when there is none)."""

    softmax: Softmax
    scale: float
    mask: str
    softcap: float = 0.0


def scores_to_softmax(score: gs.Node, fail) -> ScoreWalk:
    """Walk scores -> Softmax through scale, soft-cap and mask ops. A soft-cap is Gemma 2's
    scale steps -> Tanh -> scale steps: the factor after the Tanh is the cap (the scale is
    both factors' product); it must come before the mask (a mask under a Tanh is a bias)."""
    t, factor, mask, before = score.outputs[0], 1.0, None, None  # before: the Tanh's factor

    def walk(softmax: Softmax) -> ScoreWalk:
        if before is None:
            return ScoreWalk(softmax, factor, mask or softmax.name)
        if factor <= 0:
            raise fail(f"the soft-cap's factor after its Tanh is {factor:g}, not a cap > 0")
        return ScoreWalk(softmax, before * factor, mask or softmax.name, factor)

    while True:
        if (inlined := _inlined_softmax(t)) is not None:
            return walk(inlined)
        users = live_consumers(t)
        if len(users) != 1:
            raise fail(f"scores {t.name} have {len(users)} consumers")
        n = users[0]
        step = scale_step(n, t)
        if n.op == "Softmax":
            if n.attrs.get("axis", -1) not in (-1, 3):
                raise fail(f"Softmax '{n.name}' is not over the key axis")
            return walk(Softmax(n.name, t, n.outputs[0]))
        if step is not None:
            factor *= step
        elif n.op == "Tanh":
            if mask is not None or before is not None:
                raise fail(f"Tanh node '{n.name}' soft-caps scores already "
                           + ("masked" if mask is not None else "soft-capped"))
            before, factor = factor, 1.0
        elif n.op == "Cast" and not widening(n):
            raise fail(f"Cast node '{n.name}' rounds the scores before the Softmax")
        elif n.op not in ("Add", "Where", "Cast"):
            raise fail(f"unexpected {n.op} node '{n.name}' between scores and Softmax")
        elif n.op != "Cast":
            mask = mask or n.name
        t = n.outputs[0]


def _nan_guard(t: gs.Variable) -> gs.Variable | None:
    """The output of Where(IsNaN(t), 0, t) when that guard is all t feeds, else None.

    torch's SDPA export adds it after the Softmax (optimum's opset-18 exports): a row whose
    every key is masked is NaN and becomes 0. A causal row always sees its own key, so the
    guard never fires here and the probabilities pass through unchanged:
        p --+--> IsNaN --> Where(nan, 0, p) --> probabilities
            +------------------^
    In a float16 model onnxruntime runs the Where in float32 on p and the IsNaN in float16
    on p cast down, which is NaN exactly where p is.
    """
    users = live_consumers(t)
    isnan = next((n for n in users if n.op in ("IsNaN", "Cast")), None)
    where = next((n for n in users if n.op == "Where"), None)
    if isnan is not None and isnan.op == "Cast":
        tested = live_consumers(isnan.outputs[0])
        floats = (_FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
        isnan = (tested[0] if len(tested) == 1 and tested[0].op == "IsNaN"
                 and isnan.attrs.get("to") in floats else None)
    if len(users) != 2 or isnan is None or where is None:
        return None
    ok = (where.inputs[0] is isnan.outputs[0] and where.inputs[2] is t
          and scalar(where.inputs[1]) == 0.0 and live_consumers(isnan.outputs[0]) == [where])
    return where.outputs[0] if ok else None


def probabilities(t: gs.Variable) -> gs.Variable:
    """Softmax's output past casts, identities, dropout and SDPA's NaN guard."""
    while True:
        users = live_consumers(t)
        if len(users) == 1 and users[0].op in PROBS_PASS and (
                users[0].op != "Cast" or widening(users[0])):
            t = users[0].outputs[0]
        elif (guarded := _nan_guard(t)) is not None:
            t = guarded
        else:
            return t
