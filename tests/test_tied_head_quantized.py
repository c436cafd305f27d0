"""A quantized tied table stored once: the embedding's GatherBlockQuantized reads the
head's codes (dsc quantize writes the same 8-bit blocks for both; onnxruntime-genai's int4
builds the same 4-bit ones, two codes a byte), and the model's outputs stay the same bits;
tables that differ anywhere, codes or scales, keep their own copies."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest

from dspark.compiler.passes.tied_head import share_quantized_tied_head
from dspark.runtime.bundle.spec import INPUT_IDS, LOGITS
from dspark.runtime.model.sessions import make_session

VOCAB, WIDTH, BLOCK = 96, 64, 32


def _graph(codes: np.ndarray, scales: np.ndarray, head_codes: np.ndarray,
           head_scales: np.ndarray, bits: int = 8) -> gs.Graph:
    ids = gs.Variable(INPUT_IDS, dtype=np.int64, shape=[1, "T"])
    embedded, normed = (gs.Variable(n, dtype=np.float32) for n in ("embedded", "normed"))
    logits = gs.Variable(LOGITS, dtype=np.float32)
    nodes = [
        gs.Node("GatherBlockQuantized", "embed", {"bits": bits, "block_size": BLOCK,
                                                  "gather_axis": 0, "quantize_axis": 1},
                inputs=[gs.Constant("table", codes), ids, gs.Constant("table_scales", scales)],
                outputs=[embedded], domain="com.microsoft"),
        gs.Node("Tanh", "body", inputs=[embedded], outputs=[normed]),
        gs.Node("MatMulNBits", "head", {"K": WIDTH, "N": VOCAB, "bits": bits, "block_size": BLOCK,
                                        "accuracy_level": 4},
                inputs=[normed, gs.Constant("head_codes", head_codes),
                        gs.Constant("head_scales", head_scales)],
                outputs=[logits], domain="com.microsoft")]
    return gs.Graph(nodes, [ids], [logits], opset=17)


def _run(graph: gs.Graph, ids: np.ndarray) -> np.ndarray:
    model = gs.export_onnx(graph, do_type_check=False)
    model.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    return make_session(model.SerializeToString()).run(None, {INPUT_IDS: ids})[0]


def _tables(seed=0, bits=8):
    """Codes as both ops store them ([VOCAB, WIDTH * bits / 8] bytes; at 4 bits the lower
    nibble holds the earlier input) and a float scale per block."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 256, (VOCAB, WIDTH * bits // 8), dtype=np.uint8)
    scales = (rng.random((VOCAB, WIDTH // BLOCK)) * 0.01 + 0.001).astype(np.float32)
    return codes, scales


@pytest.mark.parametrize("bits", [8, 4])
def test_the_embedding_reads_the_heads_codes_and_outputs_stay_the_same_bits(bits):
    codes, scales = _tables(bits=bits)
    blob = BLOCK * bits // 8
    graph = _graph(codes, scales, codes.reshape(VOCAB, -1, blob).copy(), scales.reshape(-1),
                   bits)
    ids = np.array([[0, 7, 95, 7]], dtype=np.int64)
    before = _run(graph, ids)
    assert share_quantized_tied_head(graph) == 1
    consts = {id(t): t for n in graph.nodes for t in n.inputs if isinstance(t, gs.Constant)}
    sizes = sorted(t.values.nbytes for t in consts.values())
    assert sum(1 for t in consts.values() if t.values.dtype == np.uint8) == 1  # codes once
    assert sum(sizes) < codes.nbytes + 2 * scales.nbytes + 64
    np.testing.assert_array_equal(_run(graph, ids), before)


@pytest.mark.parametrize("differs", ["codes", "scales"])
def test_tables_that_differ_keep_their_own_copies(differs):
    codes, scales = _tables()
    head_codes, head_scales = codes.reshape(VOCAB, -1, BLOCK).copy(), scales.reshape(-1).copy()
    if differs == "codes":
        head_codes[5, 1, 3] ^= 1
    else:
        head_scales[17] *= 1.5
    graph = _graph(codes, scales, head_codes, head_scales)
    assert share_quantized_tied_head(graph) == 0
    assert [n.op for n in graph.nodes] == ["GatherBlockQuantized", "Tanh", "MatMulNBits"]
