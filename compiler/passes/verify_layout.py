"""SpeculativeVerify reads and writes token-major tensors, so the layout ops around it go.

Exporters hand attention [1, heads, T, dim] and take its result back the same way:

    proj [1, T, heads*dim] --Reshape--> [1, T, heads, dim] --Transpose(0,2,1,3)--> q
    out [1, heads, T, dim] --Transpose(0,2,1,3)--> [1, T, heads, dim] --Reshape-->
        [1, T, heads*dim] --> o_proj
Each op copies a few KB, but each costs onnxruntime a dispatch on every CPU decode step,
and a layer has nine of them. The runtime's attention works in token rows anyway ([T, heads,
dim]: the kernels' layout, and a free view for numpy or torch), so the node reads the first
tensor of each chain (memory order token, head, dim; any shape) and writes [1, T, heads*dim]
straight to o_proj: layout "tokens" in the spec. A standard RotaryEmbedding between the
Transpose and the node (dynamo exports) runs in its 3-D form on the projection instead. A
node is rewritten only when q, k, v and out all fit; otherwise it keeps the exported layout
("heads").
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from dspark.compiler.passes.graph_util import producer, replace_uses
from dspark.runtime.bundle.spec import VERIFY_OP

HEADS_TO_TOKENS = [0, 2, 1, 3]


def _swaps_heads(node: gs.Node | None) -> bool:
    return node is not None and node.op == "Transpose" and \
        list(node.attrs.get("perm", [])) == HEADS_TO_TOKENS


def token_source(t: gs.Tensor) -> gs.Variable | None:
    """The earliest (typed) tensor holding t's values in token-major order, if t is
    Transpose(0,2,1,3) of [1, T, heads, dim]: the Reshapes before that keep the order."""
    node = producer(t, "Transpose")
    if not _swaps_heads(node):
        return None
    x = node.inputs[0]
    while (reshape := producer(x, "Reshape")) is not None and _typed(reshape.inputs[0]):
        x = reshape.inputs[0]
    return x if _typed(x) else None


def _typed(t: gs.Tensor) -> bool:
    """A tensor that can cross a segment boundary: segment inputs need a dtype and shape."""
    return isinstance(t, gs.Variable) and t.dtype is not None and t.shape is not None


def _rotary_source(t: gs.Tensor, heads: int, dim: int
                   ) -> tuple[gs.Node, gs.Variable] | None:
    """(rotary, x) if t is the standard RotaryEmbedding of Transpose(0,2,1,3) of x's values,
    x [batch, T, heads*dim] and t read by nothing else: the op takes x itself (its 3-D
    form, `num_heads` given) and its result is then token-major. Dynamo exports."""
    rotary = producer(t, "RotaryEmbedding")
    if rotary is None or rotary.domain not in (None, "", "ai.onnx") or len(t.outputs) != 1:
        return None
    if int(rotary.attrs.get("num_heads", 0)) != heads:
        return None
    x = token_source(rotary.inputs[0])
    if x is None or len(x.shape) != 3 or x.shape[-1] != heads * dim:
        return None
    return rotary, x


def _reshaped(shape: tuple[int, ...], target: np.ndarray, allowzero: int) -> tuple | None:
    dims = [shape[i] if d == 0 and not allowzero and i < len(shape) else int(d)
            for i, d in enumerate(target)]
    try:
        return np.empty(shape, np.int8).reshape(dims).shape
    except ValueError:
        return None


def _same_heads_shape(node: gs.Node, heads: int, dim: int) -> bool:
    """A Reshape to a constant target that leaves [1, heads, T, dim] as it is (torch's SDPA
    export adds one after the attention)."""
    target = node.inputs[1] if node.op == "Reshape" and len(node.inputs) > 1 else None
    if not isinstance(target, gs.Constant):
        return False
    zero = int(node.attrs.get("allowzero", 0))
    return all(_reshaped((1, heads, t, dim), target.values, zero) == (1, heads, t, dim)
               for t in (1, 5))


def token_sinks(out: gs.Variable, heads: int, dim: int) -> list[gs.Node] | None:
    """The Reshapes that read `out` through Transpose(0,2,1,3) (and any Reshapes that keep
    its shape before it), if that is all that reads it and each gives the same shape from
    [1, T, heads*dim] as from the transposed tensor."""
    while len(out.outputs) == 1 and _same_heads_shape(out.outputs[0], heads, dim):
        out = out.outputs[0].outputs[0]
    if len(out.outputs) != 1 or not _swaps_heads(out.outputs[0]):
        return None
    y = out.outputs[0].outputs[0]
    sinks = list(y.outputs)
    for node in sinks:
        target = node.inputs[1] if node.op == "Reshape" and len(node.inputs) > 1 else None
        if not isinstance(target, gs.Constant) or node.inputs[0] is not y:
            return None
        zero = int(node.attrs.get("allowzero", 0))
        for tokens in (1, 5):
            shape = _reshaped((1, tokens, heads, dim), target.values, zero)
            if shape is None or shape != _reshaped((1, tokens, heads * dim), target.values, zero):
                return None
    return sinks or None


def _casts_after(out: gs.Variable) -> list[gs.Node]:
    """The Casts `out` goes through alone (a float16 model's result rounded to float16)."""
    casts = []
    while len(out.outputs) == 1 and out.outputs[0].op == "Cast":
        casts.append(out.outputs[0])
        out = out.outputs[0].outputs[0]
    return casts


def _after_casts(out: gs.Variable) -> gs.Variable:
    casts = _casts_after(out)
    return casts[-1].outputs[0] if casts else out


def _wire_out(graph: gs.Graph, out: gs.Variable, sinks: list[gs.Node], heads: int,
              dim: int) -> None:
    """out becomes [1, T, heads*dim]; a Reshape that would give that shape goes."""
    out.shape = [1, "tokens", heads * dim]
    for node in sinks:
        if _reshaped((1, 5, heads * dim), node.inputs[1].values,
                     int(node.attrs.get("allowzero", 0))) == (1, 5, heads * dim):
            replace_uses(graph, node.outputs[0], out)
        else:
            node.inputs[0] = out


def _casts_before(t: gs.Tensor) -> tuple[gs.Tensor, list[gs.Node]]:
    """t before the Casts that make it (a float16 model's key rounded and cast up for the
    cache), and those Casts, first first, if nothing else reads their outputs."""
    casts = []
    while (cast := producer(t, "Cast")) is not None and len(t.outputs) == 1:
        casts.insert(0, cast)
        t = cast.inputs[0]
    return t, casts


def _cast_like(graph: gs.Graph, t: gs.Variable, casts: list[gs.Node], name: str
               ) -> gs.Variable:
    """t through the same Casts (a Cast commutes with the layout ops: elementwise)."""
    for i, cast in enumerate(casts):
        out = gs.Variable(f"{name}/cast_{i}", dtype=cast.outputs[0].dtype, shape=t.shape)
        graph.nodes.append(gs.Node("Cast", f"{name}/Cast_{i}", dict(cast.attrs), [t], [out]))
        t = out
    return t


def _source(graph: gs.Graph, t: gs.Tensor, name: str) -> gs.Variable | None:
    """token_source of t, also past Casts before or after the Transpose (a float16 model's:
    made on the earliest typed token tensor instead, in the same order)."""
    before, casts = _casts_before(t)
    node = producer(before, "Transpose")
    if not _swaps_heads(node):
        return None
    x = node.inputs[0]
    while True:
        if (reshape := producer(x, "Reshape")) is not None and _typed(reshape.inputs[0]):
            x = reshape.inputs[0]
        elif (cast := producer(x, "Cast")) is not None and len(x.outputs) == 1:
            casts.insert(0, cast)
            x = cast.inputs[0]
        else:
            break
    if not _typed(x):
        return None
    return _cast_like(graph, x, casts, name) if casts else x


def token_major_verify(graph: gs.Graph) -> int:
    """Rewire each SpeculativeVerify node to token-major q/k/v/out; returns how many."""
    done = 0
    for node in [n for n in graph.nodes if n.op == VERIFY_OP]:
        heads, kv, dim = (int(node.attrs[a]) for a in ("num_heads", "num_kv_heads", "head_dim"))
        plain = [_source(graph, t, f"{node.name}/{k}") for t, k in zip(node.inputs, "qkv")]
        rotary = [None if p is not None else _rotary_source(t, h, dim)
                  for p, t, h in zip(plain, node.inputs, (heads, kv, kv))]
        out, casts = node.outputs[0], _casts_after(node.outputs[0])
        sinks = token_sinks(_after_casts(out), heads, dim)
        if sinks is None or any(p is None and r is None for p, r in zip(plain, rotary)):
            continue
        for i, (p, r) in enumerate(zip(plain, rotary)):
            if p is not None:
                node.inputs[i] = p
            else:
                op, x = r
                op.inputs[0] = x
                op.outputs[0].shape = list(x.shape)
        out.shape = [1, "tokens", heads * dim]
        _wire_out(graph, _cast_like(graph, out, casts, f"{node.name}/out"), sinks, heads, dim)
        node.attrs["layout"] = "tokens"
        done += 1
    graph.cleanup().toposort()
    return done
