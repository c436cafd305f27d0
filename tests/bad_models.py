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
    """The eager export with Tanh soft-capping of its scores, which SpeculativeVerify lacks."""
    graph = gs.import_onnx(onnx.load(str(src)))
    for i, add in enumerate(_softmax_inputs(graph)):
        capped = gs.Variable(f"/capped_{i}", dtype=np.float32)
        graph.nodes.append(gs.Node("Tanh", f"/softcap_{i}/Tanh", inputs=[add.inputs[0]],
                                   outputs=[capped]))
        add.inputs[0] = capped
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
