"""onnxruntime-genai's GroupQueryAttention becomes SpeculativeVerify (its builder's models).

Per layer the builder writes one contrib node that attends and owns the cache:

    qkv [B, T, (H + 2 KV) D] --+
    past k/v ------------------+--> GroupQueryAttention(do_rotary, cos/sin caches, scale,
    seqlens_k, total_length ---+        local_window_size) --> out [B, T, H D], present k/v
It becomes, in token rows (layout "tokens": no transposes):

    qkv --Split--> q [1, T, H D] --Reshape [T, 1, H D]--RotaryEmbedding(positions [T, 1],
                   |                 cos, sin)--Reshape [1, T, H D]--------------+
                   +-> k [1, T, KV D] --(the same, KV heads)-------------------------+--+
                   +-> v [1, T, KV D] ----------------------------------------------+  |
                                                      SpeculativeVerify(window) <--+--> out
(q, k and v may also come as three inputs.) seqlens_k and total_sequence_length, made from
the attention mask, go dead: the runtime knows each token's position. The window is what the
node does, measured rather than read off local_window_size: a one-node model of the same
GroupQueryAttention runs with zero queries (every visible key weighs the same) over values
that encode their own position, at lengths crossing local_window_size and up to
max_seq_len; the mean a query gets names the first key it saw (passes/span.py then checks
the runs as it does for masks).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx_graphsurgeon as gs
from onnx import TensorProto, helper

from dspark.compiler.passes.bind import position_input
from dspark.compiler.passes.graph_util import replace_uses
from dspark.compiler.passes.probe import ProbeShape
from dspark.compiler.passes.rotary import CONTRIB, position_rows
from dspark.compiler.passes.span import SpanRows, straddling
from dspark.compiler.passes.verify_nodes import verify_node_name
from dspark.runtime.bundle.spec import VERIFY_DOMAIN, VERIFY_OP
from dspark.runtime.errors import UnmappableAttentionError
from dspark.runtime.model.sessions import make_session

GQA = "GroupQueryAttention"
_PAST = re.compile(r"past_key_values\.(\d+)\.key$")
# inputs past the rotary caches (onnxruntime 1.32's schema): each changes what the node
# computes, and none is supported
_UNSUPPORTED_INPUTS = ("position_ids", "attention_bias", "head_sink", "k_scale", "v_scale",
                       "q_norm_weight", "k_norm_weight", "query_seqlens")
# attribute -> the values it may have (the defaults onnxruntime writes included)
# (sliding_window_cache 1: a window-sized cache, how the node stores its past, not what
# it attends to; the runtime owns the cache)
_SUPPORTED_ATTRS = {"smooth_softmax": (-1, 0), "qk_output": (0,),
                    "causal": (1,), "sliding_window_cache": (0, 1), "k_quant_type": ("NONE",),
                    "v_quant_type": ("NONE",)}


@dataclass(frozen=True)
class GqaLayer:
    node: gs.Node
    layer: int
    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    rotary: bool
    interleaved: bool
    cache_rows: int  # the fewest rows its past buffer may have (a window-sized cache's window)
    softcap: float = 0.0  # Gemma 2's: softcap * tanh(scale * q.k / softcap); 0: none


def gqa_nodes(graph: gs.Graph) -> list[gs.Node]:
    return [n for n in graph.nodes if n.op == GQA]


def _fail(path: Path, layer: int | str, node: gs.Node, why: str) -> UnmappableAttentionError:
    return UnmappableAttentionError(
        f"{path}: layer {layer}: cannot map {GQA} '{node.name}': {why}")


def gqa_failure(path: Path, layer: GqaLayer):
    """The refusal `measured_window` raises for this layer."""
    return lambda why: _fail(path, layer.layer, layer.node, why)


def read_layer(node: gs.Node, head_dim: int, path: Path) -> GqaLayer:
    """The node's layer (from the past it reads) and attributes; refuses what it cannot map."""
    past = node.inputs[3].name if len(node.inputs) > 3 else ""
    found = _PAST.match(past)
    layer = int(found.group(1)) if found else "?"
    if not found:
        raise _fail(path, layer, node, f"it reads {past or 'no past'}, not past_key_values.i.key")
    a = node.attrs
    for key, allowed in _SUPPORTED_ATTRS.items():
        if key in a and a[key] not in allowed:
            raise _fail(path, layer, node, f"{key}={a[key]!r} is not supported")
    for i, what in enumerate(_UNSUPPORTED_INPUTS, start=9):
        if len(node.inputs) > i and node.inputs[i].name:
            raise _fail(path, layer, node, f"its {what} input is not supported")
    heads, kv = int(a["num_heads"]), int(a["kv_num_heads"])
    scale = float(a.get("scale", 0.0)) or 1.0 / math.sqrt(head_dim)
    softcap = float(a.get("softcap", 0.0))
    if softcap < 0:
        raise _fail(path, layer, node, f"softcap={softcap} is negative")
    window = int(a.get("local_window_size", -1))
    return GqaLayer(node, layer, heads, kv, head_dim, scale, int(a.get("do_rotary", 0)) == 1,
                    int(a.get("rotary_interleaved", 0)) == 1,
                    max(window, 0) if int(a.get("sliding_window_cache", 0)) else 0, softcap)


# -- the window, measured on a one-node model ---------------------------------------------
def _probe_model(layer: GqaLayer) -> bytes:
    a = layer.node.attrs
    attrs = {"num_heads": layer.heads, "kv_num_heads": layer.kv_heads, "scale": layer.scale,
             "local_window_size": int(a.get("local_window_size", -1)),
             "sliding_window_cache": int(a.get("sliding_window_cache", 0))}
    f, i32 = TensorProto.FLOAT, TensorProto.INT32
    node = helper.make_node(GQA, ["qkv", "", "", "past_k", "past_v", "seqlens_k", "total"],
                            ["out", "present_k", "present_v"], domain=CONTRIB, **attrs)
    width = (layer.heads + 2 * layer.kv_heads) * layer.head_dim
    cache = [1, layer.kv_heads, "past", layer.head_dim]
    graph = helper.make_graph(
        [node], "gqa_window",
        [helper.make_tensor_value_info("qkv", f, [1, "new", width]),
         helper.make_tensor_value_info("past_k", f, cache),
         helper.make_tensor_value_info("past_v", f, cache),
         helper.make_tensor_value_info("seqlens_k", i32, [1]),
         helper.make_tensor_value_info("total", i32, [])],
        [helper.make_tensor_value_info("out", f, [1, "new", layer.heads * layer.head_dim])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid(CONTRIB, 1)])
    return model.SerializeToString()


def _encode(positions: np.ndarray, scale: float, dim: int) -> np.ndarray:
    """Value rows that carry their position: [p/L, (p/L)^2, 1, 0, ...]."""
    rows = np.zeros((len(positions), dim), np.float32)
    x = positions / scale
    rows[:, 0], rows[:, 1], rows[:, 2] = x, x * x, 1.0
    return rows


def _visible(session, layer: GqaLayer, shape: ProbeShape, longest: int, fail) -> np.ndarray:
    """[1, new, past+new]: which keys each new token's query saw (head 0)."""
    d, kv, total = layer.head_dim, layer.kv_heads, shape.past + shape.new
    values = _encode(np.arange(total, dtype=np.float64), longest, d)
    # a window-sized cache holds at least its window's rows; the first `past` hold 0..past-1
    rows = max(shape.past, layer.cache_rows)
    past_v = np.zeros((1, kv, rows, d), np.float32)
    past_v[0, :, : shape.past] = values[: shape.past]
    qkv = np.zeros((1, shape.new, (layer.heads + 2 * kv) * d), np.float32)
    v_at = (layer.heads + kv) * d
    for h in range(kv):
        qkv[0, :, v_at + h * d: v_at + (h + 1) * d] = values[shape.past:]
    [out] = session.run(["out"], {
        "qkv": qkv, "past_k": np.zeros_like(past_v), "past_v": past_v,
        "seqlens_k": np.array([total - 1], np.int32), "total": np.array(total, np.int32)})
    visible = np.zeros((1, shape.new, total), bool)
    for j in range(shape.new):
        p = shape.past + j
        mean, square, weight = (float(x) for x in out[0, j, :3])
        first = int(round(2 * mean * longest - p))
        run = np.arange(max(first, 0), p + 1) / longest
        if not (0 <= first <= p and abs(weight - 1) < 1e-4
                and abs(square - float(np.mean(run * run))) < 1e-4):
            raise fail(f"the query at position {p} does not see one run of keys ending at "
                       "its own position")
        visible[0, j, first: p + 1] = True
    return visible


def measured_window(layer: GqaLayer, max_positions: int, fail) -> int:
    """The node's window (0: every earlier key), measured up to max_positions."""
    if layer.head_dim < 3:
        raise fail(f"head_dim {layer.head_dim} is too small to measure its window")
    session = make_session(_probe_model(layer))
    rows = SpanRows(set())
    local = int(layer.node.attrs.get("local_window_size", -1))
    shapes = [ProbeShape(1, 0, min(6, max_positions)), ProbeShape(1, 5, 3),
              ProbeShape(1, max(0, max_positions - 4), min(4, max_positions))]
    if local > 0:
        shapes += [*straddling(local), *straddling(local + 1)]
    for shape in shapes:
        if 0 < shape.new and shape.past + shape.new <= max_positions:
            rows.record(_visible(session, layer, shape, max_positions, fail), shape, fail)
    return rows.window(fail)


# -- the rewrite ----------------------------------------------------------------------------
def _split_qkv(graph: gs.Graph, layer: GqaLayer, name: str) -> list[gs.Tensor]:
    """q, k, v [1, T, heads*D] from the node's packed query, or its three inputs."""
    node = layer.node
    if len(node.inputs) > 2 and node.inputs[1].name and node.inputs[2].name:
        return list(node.inputs[:3])
    d = layer.head_dim
    widths = [layer.heads * d, layer.kv_heads * d, layer.kv_heads * d]
    outs = [gs.Variable(f"{name}/{x}", dtype=np.float32, shape=[1, "tokens", w])
            for x, w in zip("qkv", widths)]
    graph.nodes.append(gs.Node("Split", f"{name}/Split", {"axis": -1}, inputs=[
        node.inputs[0], gs.Constant(f"{name}/widths", np.array(widths, np.int64))],
        outputs=outs))
    return outs


def _rotary(graph: gs.Graph, layer: GqaLayer, x: gs.Tensor, heads: int, name: str,
            positions: gs.Variable) -> gs.Variable:
    """GroupQueryAttention's own rotary (its cos/sin caches), one token per batch row as
    passes/rotary.py emits it."""
    cos, sin = layer.node.inputs[7], layer.node.inputs[8]
    width = heads * layer.head_dim
    rows, out = (gs.Variable(f"{name}/{k}", dtype=np.float32, shape=["tokens", 1, width])
                 for k in ("rows", "out"))
    back = gs.Variable(f"{name}/back", dtype=np.float32, shape=[1, "tokens", width])
    attrs = {"interleaved": int(layer.interleaved), "num_heads": heads}
    half = cos.shape[-1] if cos.shape else None
    if isinstance(half, int) and 2 * half != layer.head_dim:
        attrs["rotary_embedding_dim"] = 2 * half
    graph.nodes += [
        gs.Node("Reshape", f"{name}/to_rows", inputs=[
            x, gs.Constant(f"{name}/rows_shape", np.array([-1, 1, width]))], outputs=[rows]),
        gs.Node("RotaryEmbedding", name, attrs, [rows, positions, cos, sin], [out],
                domain=CONTRIB),
        gs.Node("Reshape", f"{name}/to_tokens", inputs=[
            out, gs.Constant(f"{name}/tokens_shape", np.array([1, -1, width]))],
            outputs=[back])]
    return back


def replace_gqa(graph: gs.Graph, layers: list[GqaLayer], windows: list[int], role: str) -> int:
    """Each GroupQueryAttention becomes Split (+ rotary) + SpeculativeVerify, token rows."""
    position_input(graph)
    positions = position_rows(graph, role) if any(g.rotary for g in layers) else None
    for g, window in zip(layers, windows):
        name = verify_node_name(role, g.layer)
        base = name.rsplit("/", 1)[0]
        q, k, v = _split_qkv(graph, g, base)
        if g.rotary:
            q = _rotary(graph, g, q, g.heads, f"{base}/rotary_q", positions)
            k = _rotary(graph, g, k, g.kv_heads, f"{base}/rotary_k", positions)
        out = gs.Variable(f"{name}/output_0", dtype=np.float32,
                          shape=[1, "tokens", g.heads * g.head_dim])
        graph.nodes.append(gs.Node(
            VERIFY_OP, name, {"layer": g.layer, "num_heads": g.heads,
                              "num_kv_heads": g.kv_heads, "head_dim": g.head_dim,
                              "scale": g.scale, "window": int(window), "layout": "tokens",
                              **({"softcap": g.softcap} if g.softcap else {})},
            inputs=[q, k, v], outputs=[out], domain=VERIFY_DOMAIN))
        replace_uses(graph, g.node.outputs[0], out)
        g.node.outputs.clear()
    graph.cleanup().toposort()
    return len(layers)


def gqa_layers(graph: gs.Graph, head_dim: int, num_layers: int, path: Path) -> list[GqaLayer]:
    """Every layer's GroupQueryAttention, in layer order; all of them or a refusal."""
    layers = sorted((read_layer(n, head_dim, path) for n in gqa_nodes(graph)),
                    key=lambda g: g.layer)
    if [g.layer for g in layers] != list(range(num_layers)):
        raise UnmappableAttentionError(
            f"{path}: {GQA} nodes read the caches of layers {[g.layer for g in layers]}, not "
            f"every one of its {num_layers} layers once")
    return layers

