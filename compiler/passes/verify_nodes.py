"""Stage 2 rewrites: each matched attention becomes one ai.dspark::SpeculativeVerify node.

    q ------+
    k_new --+--> SpeculativeVerify(layer, num_heads, num_kv_heads, head_dim, scale,
    v_new --+                      window) --> out
The cache plumbing (past inputs, Concat, repeat_kv, mask, present outputs) goes dead and
`cleanup()` removes it: the runtime owns the cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from dspark.compiler.contract import InputContract
from dspark.compiler.passes.attention import AttentionMatch
from dspark.compiler.passes.graph_util import cast_to, replace_uses
from dspark.compiler.passes.softmax import float16
from dspark.runtime.bundle.spec import VERIFY_DOMAIN, VERIFY_OP
from dspark.runtime.errors import UnmappableAttentionError


@dataclass(frozen=True)
class LayerGeometry:
    num_heads: int
    num_kv_heads: int
    head_dim: int


def geometry_from_probe(contract: InputContract, match: AttentionMatch, samples: list[dict],
                        shapes) -> LayerGeometry:
    """Read heads and head_dim off the probed q/k/v/out; all must be [batch, heads, new, dim]."""
    for sample, shape in zip(samples, shapes):
        q, k, v, out = (sample[t.name] for t in (match.q, match.k_new, match.v_new, match.out))
        ok = (q.ndim == k.ndim == v.ndim == 4 and q.shape == out.shape and k.shape == v.shape
              and q.shape[0] == k.shape[0] == shape.batch and q.shape[2] == k.shape[2] == shape.new
              and q.shape[3] == k.shape[3] and q.shape[1] % k.shape[1] == 0)
        if not ok:
            raise UnmappableAttentionError(
                f"{contract.path}: layer {match.layer}: q/k/v/out shapes {q.shape} {k.shape} "
                f"{v.shape} {out.shape} are not [batch, heads, seq, head_dim] with grouped KV heads"
            )
    return LayerGeometry(int(q.shape[1]), int(k.shape[1]), int(q.shape[3]))


def verify_node_name(role: str, layer: int) -> str:
    return f"/{role}/layers.{layer}/attn/{VERIFY_OP}"


def cache_dtype(model: np.dtype, matches: list[AttentionMatch]) -> np.dtype:
    """The arena's type: the model's cache type, or float32 for a float16 cache whose new
    keys and values are float16 already (a float16 model's float16 I/O): cast up, they are
    held exactly, and the C op runs on float32 caches (the segments on any)."""
    if np.dtype(model) == np.float16 and all(float16(m.k_new) and float16(m.v_new)
                                             for m in matches):
        return np.dtype(np.float32)
    return np.dtype(model)


def insert_verify_nodes(graph: gs.Graph, matches: list[AttentionMatch],
                        geometry: list[LayerGeometry], windows: list[int], role: str,
                        kv_dtype=np.float32) -> int:
    """`windows`: each layer's attention window (0: every earlier position; passes/span.py).
    A float16 model's keys and values are cast to the cache's type and its q to float32, all
    exact: its attention ran in float32 on them (passes/attention.py `widening`)."""
    for m, geo, window in zip(matches, geometry, windows):
        name = verify_node_name(role, m.layer)
        q = cast_to(graph, m.q, np.float32, f"{name}/q", m.q.shape) if float16(m.q) else m.q
        k, v = (cast_to(graph, t, kv_dtype, f"{name}/{kind}", t.shape)
                for t, kind in ((m.k_new, "k"), (m.v_new, "v")))
        out = gs.Variable(f"{name}/output_0", dtype=m.out.dtype or np.float32, shape=m.out.shape)
        scale = m.scale if m.scale is not None else 1.0 / math.sqrt(geo.head_dim)
        node = gs.Node(
            op=VERIFY_OP, name=name, domain=VERIFY_DOMAIN,
            attrs={"layer": m.layer, "num_heads": geo.num_heads,
                   "num_kv_heads": geo.num_kv_heads, "head_dim": geo.head_dim,
                   "scale": float(scale), "window": int(window),
                   **({"softcap": float(m.softcap)} if m.softcap else {})},
            inputs=[q, k, v], outputs=[out],
        )
        replace_uses(graph, m.out, out)
        m.terminal.outputs.clear()
        graph.nodes.append(node)
    return len(matches)


def detach_kv_outputs(graph: gs.Graph) -> int:
    """present.* leave the graph's outputs; the runtime keeps the cache."""
    keep = [t for t in graph.outputs if not t.name.startswith("present.")]
    removed = len(graph.outputs) - len(keep)
    graph.outputs = keep
    return removed
