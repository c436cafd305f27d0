"""Bind what the removed inputs (KV cache, attention mask) still feed after the rewrite.

Once attention reads the runtime's cache, the past tensors and the mask feed only shape
arithmetic: the batch size, each new token's position (past_len + arange(new)), constants
such as the head count. Which integer tensor means what is read off the running model
(`probe`), so no exporter's op sequence is assumed:

    Shape(past.0.key)[2] --+
    Range(0, new) ---------+--> Add --> positions    becomes    position_ids (a new input)
    Shape(attention_mask)[0] ------> 1 (batch)       becomes    a constant
A tensor whose meaning is unknown and still live is refused, naming its node.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from dspark.compiler.passes.graph_util import cast_to, replace_uses
from dspark.compiler.passes.probe import ProbeShape
from dspark.runtime.bundle.spec import POSITION_IDS
from dspark.runtime.errors import UnmappableAttentionError

_INT_TYPES = (np.dtype(np.int64), np.dtype(np.int32))


@dataclass(frozen=True)
class Meaning:
    kind: str  # "positions" or "constant" (the batch size is a constant: always 1 here)
    rank: int
    value: np.ndarray | None = None


def tainted(graph: gs.Graph, sources: set[str]) -> list[gs.Tensor]:
    """Every tensor computed from `sources`, in topological order."""
    graph.toposort()
    dirty = {t.name for t in graph.inputs if t.name in sources}
    order = []
    for node in graph.nodes:
        if any(t.name in dirty for t in node.inputs):
            for out in node.outputs:
                dirty.add(out.name)
                order.append(out)
    return order


def int_candidates(graph: gs.Graph, sources: set[str]) -> dict[str, int]:
    """Integer tensors derived from `sources`: name -> onnx elem type, for the probe."""
    return {t.name: onnx.helper.np_dtype_to_tensor_dtype(np.dtype(t.dtype))
            for t in tainted(graph, sources)
            if t.dtype is not None and np.dtype(t.dtype) in _INT_TYPES}


def _is_positions(s: np.ndarray, shape: ProbeShape) -> bool:
    expect = shape.past + np.arange(shape.new)
    if s.ndim == 1:
        return s.shape == (shape.new,) and np.array_equal(s, expect)
    return (s.ndim == 2 and s.shape[1] == shape.new and s.shape[0] in (1, shape.batch)
            and bool((s == expect).all()))


def classify(samples: list[np.ndarray], shapes: tuple[ProbeShape, ...]) -> Meaning | None:
    first = samples[0]
    if all(s.shape == first.shape and np.array_equal(s, first) for s in samples[1:]):
        return Meaning("constant", first.ndim, first)
    if all(s.ndim == first.ndim and _is_positions(s, sh) for s, sh in zip(samples, shapes)):
        return Meaning("positions", first.ndim)
    return None


def position_input(graph: gs.Graph) -> gs.Variable:
    for t in graph.inputs:
        if t.name == POSITION_IDS:
            return t
    t = gs.Variable(POSITION_IDS, dtype=np.int64, shape=["batch", "sequence"])
    graph.inputs.append(t)
    return t


def _materialize(graph: gs.Graph, meaning: Meaning, old: gs.Variable, role: str) -> gs.Tensor:
    """The replacement tensor for `old`: a constant, or position_ids [1, T] reshaped."""
    name = f"/{role}/bind/{old.name.strip('/')}"
    dtype = np.dtype(old.dtype)
    if meaning.kind == "constant":
        return gs.Constant(name, np.asarray(meaning.value, dtype=dtype))
    src = position_input(graph)
    if meaning.rank == 1:
        flat = gs.Variable(f"{name}/flat", dtype=src.dtype)
        graph.nodes.append(gs.Node("Reshape", f"{name}/Reshape",
                                   inputs=[src, gs.Constant(f"{name}/shape", np.array([-1]))],
                                   outputs=[flat]))
        src = flat
    return cast_to(graph, src, dtype, name)


def _branch_decided(node: gs.Node) -> gs.Node | None:
    """The first If node whose condition `node`'s outputs feed, if any."""
    seen, todo = set(), list(node.outputs)
    while todo:
        t = todo.pop(0)
        for user in t.outputs:
            if user.op == "If" and user.inputs and user.inputs[0] is t:
                return user
            if id(user) not in seen:
                seen.add(id(user))
                todo.extend(user.outputs)
    return None


def bind_removed_inputs(graph: gs.Graph, removed: set[str], meanings: dict[str, Meaning],
                        role: str, model_path) -> int:
    """Replace the earliest tensor of known meaning on every path from a removed input."""
    graph.toposort()
    dirty = {t.name for t in graph.inputs if t.name in removed}
    replaced = 0
    for node in list(graph.nodes):
        if not any(t.name in dirty for t in node.inputs):
            continue
        for out in node.outputs:
            meaning = meanings.get(out.name)
            if meaning is None:
                dirty.add(out.name)
                continue
            new = _materialize(graph, meaning, out, role)
            replace_uses(graph, out, new)
            replaced += 1
    graph.cleanup()
    still = {t.name for t in tainted(graph, removed)} | removed
    for node in graph.nodes:
        used = [t.name for t in node.inputs if t.name in still]
        if used:
            branch = _branch_decided(node)
            raise UnmappableAttentionError(
                f"{model_path}: node '{node.name}' ({node.op}) still reads {used[0]} after the "
                "attention rewrite, and its meaning is not the batch size, the positions or a "
                "constant" + ("" if branch is None else
                              f"; it decides If node '{branch.name}', so the model changes with "
                              "the sequence's length (as LongRoPE's rope caches do), which no "
                              "batching of tokens reproduces exactly")
            )
    graph.inputs = [t for t in graph.inputs if t.name not in removed]
    return replaced
