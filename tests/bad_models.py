"""Broken or unsuitable ONNX models, made from the fixtures by graph surgery or by hand."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import TensorProto, helper


def no_kv_model(path: Path) -> Path:
    """input_ids -> Gather -> logits: a causal LM exported without past."""
    table = helper.make_tensor("table", TensorProto.FLOAT, [8, 8], np.eye(8).flatten().tolist())
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "input_ids"], ["logits"])], "no_kv",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", 8])], [table])
    onnx.save(helper.make_model(graph), str(path))
    return path


def encoder_model(path: Path) -> Path:
    """A BERT-like encoder's I/O: input_ids, attention_mask, token_type_ids -> last_hidden_state."""
    graph = helper.make_graph(
        [helper.make_node("Cast", ["input_ids"], ["last_hidden_state"], to=TensorProto.FLOAT)],
        "encoder",
        [helper.make_tensor_value_info(n, TensorProto.INT64, ["b", "s"])
         for n in ("input_ids", "attention_mask", "token_type_ids")],
        [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, ["b", "s"])])
    onnx.save(helper.make_model(graph), str(path))
    return path


def _softmax_inputs(graph: gs.Graph) -> list[gs.Node]:
    """The Add (scores + mask) right before each Softmax of an eager export."""
    return [n.inputs[0].inputs[0] for n in graph.nodes if n.op == "Softmax"]


def bidirectional_model(src: Path, path: Path) -> Path:
    """The eager export with its causal mask replaced by zeros: attention sees the future."""
    graph = gs.import_onnx(onnx.load(str(src)))
    for add in _softmax_inputs(graph):
        add.inputs[1] = gs.Constant(f"{add.name}/zero_mask", np.zeros((), np.float32))
    onnx.save(gs.export_onnx(graph.cleanup()), str(path))
    return path


def softcapped_model(src: Path, path: Path) -> Path:
    """The eager export with a Tanh between each mask Add and its Softmax: the masked scores
    squashed to [-1, 1], the mask with them (Gemma 2 caps before the mask)."""
    graph = gs.import_onnx(onnx.load(str(src)))
    for i, add in enumerate(_softmax_inputs(graph)):
        softmax = add.outputs[0].outputs[0]
        capped = gs.Variable(f"/capped_{i}", dtype=np.float32)
        graph.nodes.append(gs.Node("Tanh", f"/softcap_{i}/Tanh", inputs=[add.outputs[0]],
                                   outputs=[capped]))
        softmax.inputs[0] = capped
    onnx.save(gs.export_onnx(graph.toposort()), str(path))
    return path


def other_vocab_model(src: Path, path: Path, vocab: int) -> Path:
    """The export with its logits cut to the first `vocab` entries."""
    graph = gs.import_onnx(onnx.load(str(src)))
    logits = next(t for t in graph.outputs if t.name == "logits")
    logits.name = "/full_logits"
    cut = gs.Variable("logits", dtype=np.float32, shape=[logits.shape[0], logits.shape[1], vocab])
    consts = [gs.Constant(f"/cut/{n}", np.array(v, np.int64))
              for n, v in (("starts", [0]), ("ends", [vocab]), ("axes", [2]))]
    graph.nodes.append(gs.Node("Slice", "/cut/Slice", inputs=[logits, *consts], outputs=[cut]))
    graph.outputs = [cut if t is logits else t for t in graph.outputs]
    onnx.save(gs.export_onnx(graph), str(path))
    return path


def _key_positions(graph: gs.Graph, scores: gs.Tensor, name: str) -> tuple[gs.Variable, ...]:
    """(query positions [n, 1], key positions [T]) of a [.., n, T] score tensor, as int64
    (queries are the last n of T positions: past + arange(n))."""
    def var(suffix: str) -> gs.Variable:
        return gs.Variable(f"{name}/{suffix}", dtype=np.int64)

    def node(op: str, inputs, out: gs.Variable, **attrs) -> gs.Variable:
        graph.nodes.append(gs.Node(op, f"{name}/{out.name.rsplit('/', 1)[1]}", attrs, inputs,
                                   [out]))
        return out

    one, zero = (gs.Constant(f"{name}/{v}", np.array(v, np.int64)) for v in (1, 0))
    total = node("Squeeze", [node("Shape", [scores], var("T"), start=3, end=4)], var("t"))
    new = node("Squeeze", [node("Shape", [scores], var("N"), start=2, end=3)], var("n"))
    past = node("Sub", [total, new], var("past"))
    keys = node("Range", [zero, total, one], var("keys"))
    queries = node("Range", [past, total, one], var("queries"))
    column = gs.Constant(f"{name}/column", np.array([-1, 1], np.int64))
    return node("Reshape", [queries, column], var("query_column")), keys


def alibi_model(src: Path, path: Path, layer: int = 1) -> Path:
    """The eager export with an ALiBi-style bias (0.1 x the key's position: ALiBi's
    -m (i - j) up to a per-query constant) added to layer `layer`'s masked scores."""
    graph = gs.import_onnx(onnx.load(str(src)))
    add = _softmax_inputs(graph)[layer]
    name = f"/alibi_{layer}"
    _, keys = _key_positions(graph, add.inputs[0], name)
    as_float = gs.Variable(f"{name}/keys_f", dtype=np.float32)
    bias = gs.Variable(f"{name}/bias", dtype=np.float32)
    biased = gs.Variable(f"{name}/biased", dtype=np.float32)
    graph.nodes += [
        gs.Node("Cast", f"{name}/Cast", {"to": TensorProto.FLOAT}, [keys], [as_float]),
        gs.Node("Mul", f"{name}/Mul", inputs=[as_float, gs.Constant(
            f"{name}/slope", np.array(0.1, np.float32))], outputs=[bias]),
        gs.Node("Add", f"{name}/Add", inputs=[add.outputs[0], bias], outputs=[biased])]
    softmax = add.outputs[0].outputs[0]
    softmax.inputs[0] = biased
    onnx.save(gs.export_onnx(graph.toposort()), str(path))
    return path


def chunked_model(src: Path, path: Path, layer: int = 1, chunk: int = 4) -> Path:
    """The eager export whose layer `layer` attends only inside chunks of `chunk` positions
    (Llama 4's chunked attention): causal, but no sliding window."""
    graph = gs.import_onnx(onnx.load(str(src)))
    add = _softmax_inputs(graph)[layer]
    name = f"/chunked_{layer}"
    queries, keys = _key_positions(graph, add.inputs[0], name)
    size = gs.Constant(f"{name}/chunk", np.array(chunk, np.int64))
    outs = [gs.Variable(f"{name}/{n}", dtype=d) for n, d in (
        ("qc", np.int64), ("kc", np.int64), ("same", np.bool_), ("mask", np.float32),
        ("masked", np.float32))]
    graph.nodes += [
        gs.Node("Div", f"{name}/DivQ", inputs=[queries, size], outputs=[outs[0]]),
        gs.Node("Div", f"{name}/DivK", inputs=[keys, size], outputs=[outs[1]]),
        gs.Node("Equal", f"{name}/Equal", inputs=[outs[0], outs[1]], outputs=[outs[2]]),
        gs.Node("Where", f"{name}/Where", inputs=[
            outs[2], gs.Constant(f"{name}/open", np.array(0.0, np.float32)),
            gs.Constant(f"{name}/shut", np.array(np.finfo(np.float32).min, np.float32))],
            outputs=[outs[3]]),
        gs.Node("Add", f"{name}/Add", inputs=[add.outputs[0], outs[3]], outputs=[outs[4]])]
    softmax = add.outputs[0].outputs[0]
    softmax.inputs[0] = outs[4]
    onnx.save(gs.export_onnx(graph.toposort()), str(path))
    return path


def broken_guard_model(src: Path, path: Path, layer: int = 0) -> Path:
    """optimum's form with layer `layer`'s NaN guard replaced by Where(IsNaN(p), 1, p): not
    a guard that leaves the probabilities unchanged, so the attention cannot be matched."""
    graph = gs.import_onnx(onnx.load(str(src)))
    wheres = [n for n in graph.nodes if n.op == "Where" and n.inputs[0].inputs
              and n.inputs[0].inputs[0].op == "IsNaN"]
    wheres[layer].inputs[1] = gs.Constant(f"/broken_guard_{layer}", np.array(1.0, np.float32))
    onnx.save(gs.export_onnx(graph), str(path))
    return path


def softcapped_gqa_model(folder: Path, dest: Path, layer: int | None = 1, cap: float = 50.0,
                         attribute: str = "softcap") -> Path:
    """An onnxruntime-genai model folder whose GroupQueryAttention at `layer` (None: every
    layer) has `attribute` (Gemma 2's softcap by default) set to `cap`, copied to `dest`."""
    import shutil

    shutil.copytree(folder, dest)
    model = onnx.load(str(dest / "model.onnx"), load_external_data=False)
    nodes = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
    for node in nodes if layer is None else [nodes[layer]]:
        kept = [a for a in node.attribute if a.name != attribute]
        del node.attribute[:]
        node.attribute.extend([*kept, onnx.helper.make_attribute(attribute, cap)])
    onnx.save(model, str(dest / "model.onnx"))
    return dest


def unrunnable_model(src: Path, path: Path) -> Path:
    """The eager export with its logits passed through Reshape(., [7, -1]) and back: it loads,
    and onnxruntime fails once the compiler's probes run it (6 tokens x 320 logits)."""
    graph = gs.import_onnx(onnx.load(str(src)))
    logits = next(t for t in graph.outputs if t.name == "logits")
    made = logits.inputs[0]
    inner = gs.Variable("/bad/logits", dtype=np.float32)
    made.outputs = [inner if t is logits else t for t in made.outputs]
    shape, folded = gs.Variable("/bad/shape", dtype=np.int64), gs.Variable("/bad/folded",
                                                                              dtype=np.float32)
    graph.nodes += [
        gs.Node("Shape", "/bad/Shape", inputs=[inner], outputs=[shape]),
        gs.Node("Reshape", "/bad/Reshape", inputs=[inner, gs.Constant(
            "/bad/seven", np.array([7, -1], np.int64))], outputs=[folded]),
        gs.Node("Reshape", "/bad/Back", inputs=[folded, shape], outputs=[logits])]
    onnx.save(gs.export_onnx(graph.toposort()), str(path))
    return path
