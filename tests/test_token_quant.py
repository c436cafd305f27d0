"""Models whose activations onnxruntime's quantize_dynamic quantizes per tensor
(DynamicQuantizeLinear + MatMulInteger): made per token (passes/token_quant.py), they
compile, verify against the original run token by token, and generate the same tokens plain
and speculating."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from lossless import check_self_drafted
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import QuantType, quantize_dynamic

from dspark.compiler.compile import CompileOptions
from dspark.compiler.passes.token_axes import TokenAxis, quantizers
from dspark.compiler.passes.token_quant import make_per_token, split_fused
from dspark.compiler.reference import OriginalModel
from dspark.compiler.verify import verify_model
from dspark.runtime.bundle.bundle import open_bundle
from dspark.runtime.engine.engine import Engine
from dspark.runtime.errors import ModelInputError
from dspark.runtime.model.sessions import make_session
from dspark.runtime.sequence.request import GenerationRequest

from bundle_cache import compiled

K, N = 64, 24


def _projection(weights: np.ndarray, weight_zero_point: np.ndarray, scale_op: str = "Mul",
                form: str = "MatMulInteger") -> onnx.ModelProto:
    """x -> DynamicQuantizeLinear -> MatMulInteger -> dequantized, as quantize_dynamic
    writes one projection; or as onnxruntime's extended optimizations leave it, with a bias:
    `form` MatMulIntegerToFloat (beside the DynamicQuantizeLinear) or DynamicQuantizeMatMul
    (the whole)."""
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["q", "s", "z"], name="dql")]
    if form == "DynamicQuantizeMatMul":
        nodes = [helper.make_node(form, ["x", "w", "ws", "wzp", "bias"], ["y"], name="dqmm",
                                  domain="com.microsoft")]
    elif form == "MatMulIntegerToFloat":
        nodes.append(helper.make_node(form, ["q", "w", "s", "ws", "z", "wzp", "bias"], ["y"],
                                      name="mmf", domain="com.microsoft"))
    else:
        nodes += [helper.make_node("MatMulInteger", ["q", "w", "z", "wzp"], ["mm"], name="mmi"),
                  helper.make_node("Cast", ["mm"], ["mmf"], to=TensorProto.FLOAT),
                  helper.make_node(scale_op, ["s", "ws"], ["sc"], name="scale_op"),
                  helper.make_node("Mul", ["mmf", "sc"], ["y"])]
    rng = np.random.default_rng(1)
    graph = helper.make_graph(
        nodes, "projection", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["t", K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(weights, "w"), numpy_helper.from_array(weight_zero_point, "wzp"),
         numpy_helper.from_array(rng.uniform(0.001, 0.02, N).astype(np.float32), "ws"),
         numpy_helper.from_array(rng.standard_normal(N).astype(np.float32), "bias")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                   helper.make_opsetid("com.microsoft", 1)])


def _session(model: onnx.ModelProto):
    return make_session(model.SerializeToString(), level="all")


def _per_token(model: onnx.ModelProto, axis: int = 0, shape: tuple = (1, K)) -> int:
    """The pass with every quantized input's tokens on `axis` (what token_axes probes)."""
    split_fused(model)
    return make_per_token(model, "p.onnx", {n.output[0]: TokenAxis(axis, shape)
                                            for n in quantizers(model)})


def _rows(rng: np.random.Generator, kind: int) -> np.ndarray:
    """Rows of every sort the quantizer treats apart: signed, all above or below zero, all
    zero, on a coarse grid (ties in x / scale), integers over 7."""
    x = (rng.standard_normal((1, K)) * 10 ** rng.uniform(-3, 3)).astype(np.float32)
    return [x, np.abs(x), -np.abs(x), np.zeros_like(x), np.round(x * 4) / 4,
            rng.integers(-300, 300, (1, K)).astype(np.float32) / 7][kind % 6]


@pytest.mark.parametrize("form", ["MatMulInteger", "MatMulIntegerToFloat",
                                  "DynamicQuantizeMatMul"])
@pytest.mark.parametrize("weights", ["int8", "uint8 per column"])
def test_per_token_form_is_the_original_a_row_at_a_time(weights, form):
    """Bit for bit: every row alone as the original computes a one-row tensor, and many rows
    in one run as each alone."""
    rng = np.random.default_rng(0)
    if weights == "int8":
        w, wzp = rng.integers(-128, 128, (K, N)).astype(np.int8), np.array(3, np.int8)
    else:
        w = rng.integers(0, 256, (K, N)).astype(np.uint8)
        wzp = rng.integers(0, 256, N).astype(np.uint8)
    original = _session(_projection(w, wzp, form=form))
    model = _projection(w, wzp, form=form)
    assert _per_token(model) == 1
    per_token = _session(model)
    rows = np.concatenate([_rows(rng, k) for k in range(600)])
    for row in rows:
        [a] = original.run(None, {"x": row[None]})
        [b] = per_token.run(None, {"x": row[None]})
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), row
    [together] = per_token.run(None, {"x": rows[:40]})
    alone = np.concatenate([original.run(None, {"x": r[None]})[0] for r in rows[:40]])
    assert np.array_equal(together.view(np.uint32), alone.view(np.uint32))
    # and the original itself is not: one scale for the 40 rows
    [mixed] = original.run(None, {"x": rows[:40]})
    assert not np.array_equal(mixed, alone)


def test_a_scale_used_other_than_by_a_multiply_is_refused():
    model = _projection(np.ones((K, N), np.int8), np.array(0, np.int8), scale_op="Add")
    with pytest.raises(ModelInputError, match="DynamicQuantizeLinear node 'dql': its scale "
                                              "feeds Add node 'scale_op'"):
        _per_token(model)


def _positions_times_frequencies(opset: int) -> onnx.ModelProto:
    """optimum's quantized rotary: frequencies [1, F, 1] (a constant, quantized per tensor)
    times positions [1, 1, T] (the tokens, as the product's columns), both quantized."""
    frequencies = np.geomspace(1, 1e-3, 8).astype(np.float32).reshape(1, 8, 1)
    nodes = [helper.make_node("DynamicQuantizeLinear", ["f"], ["fq", "fs", "fz"], name="dql_f"),
             helper.make_node("DynamicQuantizeLinear", ["p"], ["pq", "ps", "pz"], name="dql_p"),
             helper.make_node("MatMulInteger", ["fq", "pq", "fz", "pz"], ["mm"], name="mmi"),
             helper.make_node("Cast", ["mm"], ["mmf"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["fs", "ps"], ["sc"]),
             helper.make_node("Mul", ["mmf", "sc"], ["y"])]
    graph = helper.make_graph(
        nodes, "rotary", [helper.make_tensor_value_info("p", TensorProto.FLOAT, [1, 1, "t"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(frequencies, "f")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


@pytest.mark.parametrize("opset", [14, 18])  # ReduceSum's axes an input, the others' not yet
def test_tokens_as_a_products_columns_are_quantized_a_column_at_a_time(opset):
    original = _session(_positions_times_frequencies(opset))
    model = _positions_times_frequencies(opset)
    axes = {"fq": TokenAxis(None, (1, 8, 1)), "pq": TokenAxis(2, (1, 1, 1))}
    assert make_per_token(model, "p.onnx", axes) == 1
    per_token = _session(model)
    positions = np.array([[[0, 1, 2, 3, 17, 300, 301, 2047]]], np.float32)
    [together] = per_token.run(None, {"p": positions})
    alone = np.concatenate([original.run(None, {"p": positions[..., i:i + 1]})[0]
                            for i in range(positions.shape[-1])], axis=-1)
    assert np.array_equal(together.view(np.uint32), alone.view(np.uint32))
    [mixed] = original.run(None, {"p": positions})
    assert not np.array_equal(mixed, alone)


QUANTIZED = {  # fixture -> quantize_dynamic's options, as users pick them
    ("llama", "classic"): {"weight_type": QuantType.QInt8},
    ("gemma3", "classic"): {"weight_type": QuantType.QUInt8, "per_channel": True},
    ("gpt2", "classic"): {"weight_type": QuantType.QInt8, "per_channel": True,
                          "reduce_range": True},
}


@pytest.fixture(scope="module")
def quantized(fixture_pairs, tmp_path_factory):
    root = tmp_path_factory.mktemp("int8")
    out = {}
    for key, options in QUANTIZED.items():
        out[key] = root / f"{'-'.join(key)}.onnx"
        quantize_dynamic(fixture_pairs[key][0], out[key], **options)
    return out


@pytest.mark.parametrize("key", list(QUANTIZED), ids="-".join)
def test_a_dynamically_quantized_model_compiles_and_verifies(quantized, key, tmp_path):
    bundle = open_bundle(compiled(CompileOptions(quantized[key], None, tmp_path / "b.dsmodel",
                                                 max_seq_len=256, kv_budget_mb=8)))
    ops = {n.op_type for n in onnx.load(str(bundle.root / "main" / "model.onnx"),
                                        load_external_data=False).graph.node}
    assert "DynamicQuantizeLinear" not in ops and "MatMulInteger" in ops
    report = verify_model(bundle, "main", quantized[key], seqs=3, steps=3)
    assert report.ok(1e-3) and report.argmax_agree >= 0.98, report


def test_its_reference_runs_token_by_token(quantized):
    """In one forward the original's later tokens move its earlier ones' logits; the
    reference's chunk is its steps."""
    original = OriginalModel(quantized[("llama", "classic")])
    ids = [5, 17, 42, 8, 99, 3]
    whole, _ = original.forward(ids, original.empty_past())
    past, steps = original.empty_past(), []
    for t in ids:
        row, past = original.forward([t], past)
        steps.append(row)
    assert np.array_equal(whole, np.concatenate(steps))
    original.token_by_token = False
    at_once, _ = original.forward(ids, original.empty_past())
    assert not np.array_equal(at_once, whole)


@pytest.mark.parametrize("key", list(QUANTIZED), ids="-".join)
def test_speculation_on_a_dynamically_quantized_model_is_lossless(quantized, key, tmp_path):
    """The model as its own draft (every verify several tokens long) and lookup drafts,
    batched: the same tokens as plain decoding; plain decoding's are the original's greedy
    tokens run token by token (one fork forgiven: a float ulp apart, the int8 rounding can
    move a logit by verify's floor)."""
    path = quantized[key]
    bundle = open_bundle(compiled(CompileOptions(path, path, tmp_path / "b.dsmodel",
                                                 max_seq_len=256, kv_budget_mb=8)))
    check_self_drafted(bundle, path)


@pytest.fixture(scope="module")
def optimum_int8():
    from arch_fixtures import build_optimum_quantized
    from conftest import BUILD

    return build_optimum_quantized(BUILD)


def test_optimums_quantization_of_every_matmul_is_refused_naming_the_cache(optimum_int8,
                                                                            tmp_path):
    """Its attention's keys are quantized with one scale over every cached token: a
    token-by-token run re-rounds the cache at each step, which no per-token form computes."""
    with pytest.raises(ModelInputError, match=r"quantizes .*self_attn.* per tensor, which is .*"
                                              r"it holds cached tokens"):
        compiled(CompileOptions(optimum_int8["all"], None, tmp_path / "b.dsmodel",
                                max_seq_len=256, kv_budget_mb=8))


def test_optimums_quantization_without_the_attention_is_lossless(optimum_int8, tmp_path):
    """Its rotary's MatMul quantized too (positions as the product's columns, the frequencies
    a constant): verifies, and speculation gives plain decoding's tokens."""
    path = optimum_int8["no-attention"]
    bundle = open_bundle(compiled(CompileOptions(path, path, tmp_path / "b.dsmodel",
                                                 max_seq_len=256, kv_budget_mb=8)))
    nodes = onnx.load(str(bundle.root / "main" / "model.onnx"), load_external_data=False).graph.node
    assert not [n for n in nodes if n.op_type == "DynamicQuantizeLinear"]
    products = {n.name.split("/per_token/")[0] for n in nodes if n.op_type == "MatMulInteger"}
    source = {n.name for n in onnx.load(str(path), load_external_data=False).graph.node
              if n.op_type == "MatMulInteger"}
    # the rotary's, per token, became the fused rotary's tables (one position at a time)
    assert source - products == {"/model/rotary_emb/MatMul_quant"} and len(products) == 22
    report = verify_model(bundle, "main", path, seqs=3, steps=3)
    assert report.ok(1e-3) and report.argmax_agree >= 0.98, report
    prompts = [[5, 9, 200, 31], list(range(7, 27)) * 3]
    runs = [[s.generated for s in Engine(bundle, "fixed", 4, max_batch=2).generate(
        [GenerationRequest(tuple(p), 40, speculative=spec, method=method) for p in prompts])]
        for spec, method in ((False, None), (True, "draft"), (True, "lookup"))]
    assert runs[1] == runs[0] and runs[2] == runs[0]
