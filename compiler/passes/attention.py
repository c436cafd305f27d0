"""Find each layer's attention by anchoring on the KV-cache plumbing, not on op order.

    past_key_values.i.key --+
                            Concat(axis=-2) --> present.i.key --(repeat_kv, Transpose)--+
    k_new ------------------+                                                            |
    q ----------------------------------------------------------------------> MatMul (scores)
          scores -> [Mul/Div scale] -> [Add/Where mask] -> Softmax -> [Cast] -+
    present.i.value --(repeat_kv)--------------------------------------------> MatMul -> out

or, from the dynamo exporter, the same with one ONNX `Attention(q, K, V, mask)` node, or an
`Attention` that takes past_key/past_value itself. The match names q, k_new, v_new, the
tensor the attention produces and the softmax scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx
import onnx_graphsurgeon as gs

from dspark.compiler.contract import InputContract, past_name, present_name
from dspark.compiler.passes.softmax import (
    float16,
    live_consumers,
    probabilities,
    scale_step,
    scores_to_softmax,
    widening,
)
from dspark.runtime.errors import UnmappableAttentionError

LAYOUT_OPS = frozenset({"Unsqueeze", "Expand", "Reshape", "Transpose", "Identity", "Squeeze"})
SWAP_LAST = [0, 1, 3, 2]
_FLOAT = onnx.TensorProto.FLOAT


@dataclass(frozen=True)
class SpanSource:
    """Where a layer's mask is decided, for the span probe (passes/span.py)."""

    node: str  # the node whose masking decides which keys a query sees (for messages)
    scores: str | None = None  # eager: the raw scores Q.K^T
    masked: str | None = None  # eager: Softmax's input; Attention: its mask input (or None)
    factor: float = 1.0  # eager: the scale applied between `scores` and `masked`
    softcap: float = 0.0  # eager: the soft-cap after the scale (0: none)
    causal: bool = False  # Attention: is_causal=1 (upper-left aligned, as ONNX defines it)


@dataclass
class AttentionMatch:
    layer: int
    q: gs.Variable
    k_new: gs.Variable
    v_new: gs.Variable
    out: gs.Variable  # what the attention produced, [batch, heads, seq, head_dim]
    terminal: gs.Node  # the node producing `out`
    scale: float | None  # None: the ONNX Attention default, 1/sqrt(head_dim)
    span: SpanSource | None = None
    softcap: float = 0.0  # scores soft-capped (Gemma 2): softcap * tanh(score / softcap)


@dataclass
class _Chain:
    end: gs.Node  # first consumer that is not a layout op
    fed: gs.Variable  # the tensor the chain hands to `end`
    perms: list[list[int]]
    factor: float


def _unmappable(contract: InputContract, layer: int, why: str) -> UnmappableAttentionError:
    return UnmappableAttentionError(f"{contract.path}: layer {layer}: cannot map attention: {why}")


def _cache(tensors: dict, layer: int, kind: str, concat: gs.Node
           ) -> tuple[gs.Variable, gs.Node | None]:
    """Where the attention reads the cache: present, or where present is only the cache cast
    up for the graph's output (a float16 model with float32 cache I/O), the Concat's output,
    that Cast aside."""
    present = tensors[present_name(layer, kind)]
    if live_consumers(present) or present is concat.outputs[0]:
        return present, None
    return concat.outputs[0], present.inputs[0]


def _follow(t: gs.Variable, skip: gs.Node | None, scale_ok: bool, where: str, fail) -> _Chain:
    perms, factor = [], 1.0
    while True:
        users = [n for n in live_consumers(t) if n is not skip]
        if len(users) != 1:
            raise fail(f"{where} {t.name} has {len(users)} consumers, expected one")
        n = users[0]
        if (n.op in LAYOUT_OPS or widening(n)) and n.inputs[0] is t:
            if n.op == "Transpose":
                perms.append(list(n.attrs.get("perm", [])))
            t = n.outputs[0]
            continue
        step = scale_step(n, t) if scale_ok else None
        if step is not None:
            factor *= step
            t = n.outputs[0]
            continue
        return _Chain(n, t, perms, factor)


def _from_past(t: gs.Tensor, name: str, cast_ok: bool = False) -> bool:
    """t is the graph input `name`, possibly behind Identity or one-input Concat, and when
    `cast_ok` behind a Cast (a float16 model with float32 cache I/O: its present is the
    float16 cache cast up, so the past cast down gets back the same values exactly)."""
    passes = ("Identity", "Concat", "Cast") if cast_ok else ("Identity", "Concat")
    while t.name != name:
        if len(t.inputs) != 1 or t.inputs[0].op not in passes:
            return False
        if len(t.inputs[0].inputs) != 1:
            return False
        t = t.inputs[0].inputs[0]
    return True


def _split_present(tensors: dict, contract: InputContract, layer: int, kind: str
                   ) -> tuple[gs.Variable, gs.Node]:
    present = tensors[present_name(layer, kind)]
    producer = present.inputs[0] if present.inputs else None
    cast_up = (producer is not None and producer.op == "Cast"
               and producer.attrs.get("to") == contract.kv_dtype and producer.inputs[0].inputs
               and producer.inputs[0].inputs[0].op == "Concat")
    if cast_up:  # the cache cast to its own type (GPT-J), or up from float16
        producer = producer.inputs[0].inputs[0]
    if producer is None:
        raise _unmappable(contract, layer, f"present.{layer}.{kind} has no producer")
    ok = (producer.op == "Concat" and len(producer.inputs) == 2
          and producer.attrs.get("axis") in (-2, 2)
          and _from_past(producer.inputs[0], past_name(layer, kind),
                             cast_ok=cast_up and contract.kv_dtype == _FLOAT))
    if ok:
        return producer.inputs[1], producer
    if producer.op == "Attention":
        return present, producer
    raise _unmappable(contract, layer,
                      f"present.{layer}.{kind} comes from {producer.op} node '{producer.name}', "
                      f"expected Concat(past_key_values.{layer}.{kind}, new)")


def _native_cache_attention(node: gs.Node, contract: InputContract, layer: int) -> AttentionMatch:
    """Attention(q, k_new, v_new, mask, past_key, past_value) -> (out, present k, present v)."""
    fail = lambda why: _unmappable(contract, layer, why)  # noqa: E731
    if len(node.inputs) < 6 or not _from_past(node.inputs[4], past_name(layer, "key")):
        raise fail(f"Attention node '{node.name}' does not read past_key_values.{layer}.key")
    _check_attention_attrs(node, fail)
    return AttentionMatch(layer, node.inputs[0], node.inputs[1], node.inputs[2], node.outputs[0],
                          node, node.attrs.get("scale"), _attention_span(node))


def _attention_span(node: gs.Node) -> SpanSource:
    """An ONNX Attention decides its span by its mask input and is_causal."""
    mask = node.inputs[3] if len(node.inputs) > 3 and node.inputs[3].name else None
    return SpanSource(node.name, masked=mask.name if mask is not None else None,
                      causal=int(node.attrs.get("is_causal", 0)) == 1)


def _check_attention_attrs(node: gs.Node, fail) -> None:
    if float(node.attrs.get("softcap", 0.0)) != 0.0:
        raise fail(f"soft-capped Attention node '{node.name}' is not supported")
    if int(node.attrs.get("qk_matmul_output_mode", 0)) != 0 or len(node.outputs) == 4:
        raise fail(f"Attention node '{node.name}' exposes its qk scores")
    if any(float16(t) for t in node.inputs[:3]):
        raise fail(f"Attention node '{node.name}' takes float16 q/k/v: onnxruntime computes it "
                   "in float16, whose rounding SpeculativeVerify does not reproduce (convert "
                   "the model with the attention kept in float32, or export it in float32)")


def _eager(chain_k: _Chain, chain_v: _Chain, k_new, v_new, contract, layer) -> AttentionMatch:
    fail = lambda why: _unmappable(contract, layer, why)  # noqa: E731
    score = chain_k.end
    if not _matmul(score, trans_b_ok=True) or score.inputs[1] is not chain_k.fed:
        raise fail(f"present.{layer}.key feeds {score.op} node '{score.name}', not a score MatMul")
    perms = chain_k.perms + [SWAP_LAST] * int(score.attrs.get("transB", 0))
    if perms != [SWAP_LAST]:
        raise fail(f"the key's path to {score.op} node '{score.name}' transposes {perms}, "
                   "expected one swap of the last two axes")
    scores = scores_to_softmax(score, fail)
    softmax, factor = scores.softmax, scores.scale
    t = probabilities(softmax.out)
    out_mm = chain_v.end
    narrowing = [n for n in live_consumers(t) if n.op == "Cast" and not widening(n)]
    if narrowing:
        raise fail(f"Cast node '{narrowing[0].name}' rounds the probabilities ({t.name}) to "
                   f"{onnx.TensorProto.DataType.Name(narrowing[0].attrs.get('to', 0)).lower()} "
                   "before their MatMul with the values, which SpeculativeVerify does not "
                   "reproduce")
    if (not _matmul(out_mm, trans_b_ok=False) or out_mm.inputs[0] is not t
            or out_mm.inputs[1] is not chain_v.fed or _alpha(out_mm) != 1.0):
        users = ", ".join(f"{n.op} '{n.name}'" for n in live_consumers(t)) or "nothing"
        raise fail(f"Softmax '{softmax.name}' and present.{layer}.value do not meet in one "
                   f"MatMul: the probabilities ({t.name}) go to {users}, present.{layer}.value "
                   f"to {chain_v.end.op} '{chain_v.end.name}'")
    half = [x.name for x in (score.inputs[0], chain_k.fed, t, chain_v.fed) if float16(x)]
    if half:
        raise fail(f"MatMul '{score.name}' or '{out_mm.name}' multiplies float16 tensors "
                   f"({half[0]}): an attention computed in float16 rounds its scores, "
                   "which SpeculativeVerify does not reproduce")
    span = SpanSource(scores.mask, scores=score.outputs[0].name, masked=softmax.inp.name,
                      factor=factor, softcap=scores.softcap)
    q, q_factor = _unscaled(score.inputs[0])
    return AttentionMatch(layer, q, k_new, v_new, out_mm.outputs[0], out_mm,
                          factor * chain_k.factor * q_factor * _alpha(score), span,
                          scores.softcap)


def _matmul(n: gs.Node, trans_b_ok: bool) -> bool:
    """A MatMul, or onnxruntime's FusedMatMul (its extended optimizations: a scale and a
    transpose of B folded in) transposing at most B, where allowed."""
    if n.op == "MatMul":
        return True
    if n.op != "FusedMatMul":
        return False
    a = n.attrs
    return (not a.get("transA", 0) and not a.get("transBatchA", 0)
            and not a.get("transBatchB", 0) and (trans_b_ok or not a.get("transB", 0)))


def _alpha(n: gs.Node) -> float:
    return float(n.attrs.get("alpha", 1.0)) if n.op == "FusedMatMul" else 1.0


def _unscaled(t: gs.Variable) -> tuple[gs.Variable, float]:
    """q before the scalar Mul/Div that feed only the score MatMul, and their factor.

    torch's SDPA export scales q and k by sqrt(scale) each (optimum's exports): the scale
    joins SpeculativeVerify's, so its q is the rotary's output, which the rotary fusion and
    the token-row layout then reach."""
    factor = 1.0
    while len(t.inputs) == 1 and len(live_consumers(t)) == 1:
        n = t.inputs[0]
        source = next((i for i in n.inputs if isinstance(i, gs.Variable)), None)
        step = scale_step(n, source) if source is not None else None
        if step is None:
            break
        factor *= step
        t = source
    return t, factor


def match_layer(tensors: dict, contract: InputContract, layer: int) -> AttentionMatch:
    fail = lambda why: _unmappable(contract, layer, why)  # noqa: E731
    k_new, k_prod = _split_present(tensors, contract, layer, "key")
    v_new, v_prod = _split_present(tensors, contract, layer, "value")
    if k_prod.op == "Attention":
        return _native_cache_attention(k_prod, contract, layer)
    chain_k = _follow(*_cache(tensors, layer, "key", k_prod), True, "present key", fail)
    chain_v = _follow(*_cache(tensors, layer, "value", v_prod), False, "present value", fail)
    if chain_v.perms:
        raise fail(f"value path transposes {chain_v.perms}")
    if chain_k.end.op != "Attention":
        return _eager(chain_k, chain_v, k_new, v_new, contract, layer)
    node = chain_k.end
    if chain_k.perms or node.inputs[1] is not chain_k.fed or chain_v.end is not node \
            or node.inputs[2] is not chain_v.fed:
        raise fail(f"Attention node '{node.name}' does not take present.{layer}.key/value as K/V")
    if len(node.inputs) > 4 and any(i.name for i in node.inputs[4:]):
        raise fail(f"Attention node '{node.name}' also takes a past cache")
    _check_attention_attrs(node, fail)
    scale = node.attrs.get("scale")
    return AttentionMatch(layer, node.inputs[0], k_new, v_new, node.outputs[0], node,
                          None if scale is None else scale * chain_k.factor,
                          _attention_span(node))


def find_attentions(graph: gs.Graph, contract: InputContract) -> list[AttentionMatch]:
    tensors = graph.tensors()
    return [match_layer(tensors, contract, i) for i in range(contract.num_layers)]
