"""QuantizeTokens (kernels/cpu_quant.c) and the rewrite that uses it
(runtime/model/quant_rows.py): the per-token quantization compiler/passes/token_quant.py
writes, as one op, the same bits as onnxruntime running the ONNX ops, a row alone as among
others, on the pool's path for many rows with the solo switch on or off, in this CPU's build
and the AVX2 one; a chain it cannot take whole stays."""

from __future__ import annotations

import re

import numpy as np
import onnx
import pytest
from cpu_builds import library_for, marches
from onnx import TensorProto, helper, numpy_helper

from dspark.compiler.passes.token_axes import TokenAxis
from dspark.compiler.passes.token_quant import make_per_token
from dspark.kernels.cpu_op import solo_ops
from dspark.runtime.model.quant_rows import rewrite_quantize
from dspark.runtime.model.sessions import make_session


@pytest.fixture(scope="module", params=marches())
def library(request):
    """This CPU's build, and on x86-64 with AVX-512 the AVX2 one (DSPARK_CPU_MARCH)."""
    return library_for(request.param)

K, N = 576, 24
def _per_token_projection(extra_output: str | None = None) -> onnx.ModelProto:
    """One quantize_dynamic projection, made per token by the compiler's pass; y and the
    per-token scale and zero point as outputs too (`extra_output`: one more)."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["q", "s", "z"], name="dql"),
             helper.make_node("MatMulInteger", ["q", "w", "z", "wzp"], ["mm"], name="mmi"),
             helper.make_node("Cast", ["mm"], ["mmf"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["s", "ws"], ["sc"]),
             helper.make_node("Mul", ["mmf", "sc"], ["y"])]
    graph = helper.make_graph(
        nodes, "projection", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["t", K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(rng.integers(-128, 128, (K, N)).astype(np.int8), "w"),
         numpy_helper.from_array(np.array(0, np.int8), "wzp"),
         numpy_helper.from_array(np.full(N, 0.01, np.float32), "ws")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    assert make_per_token(model, "p.onnx", {"q": TokenAxis(0, (1, K))}) == 1
    outs = [o for n in model.graph.node for o in n.output
            if re.search(r"/per_token/(y|scale|zero_point)_\d+$", o)]
    assert len(outs) == 3
    outs += [extra_output] if extra_output else []
    model.graph.output.extend(helper.make_tensor_value_info(
        o, TensorProto.UINT8 if "/y_" in o or "/zero_point_" in o else TensorProto.FLOAT, None)
        for o in outs)
    return model


def _rows(rng: np.random.Generator, count: int) -> np.ndarray:
    """Signed, all above or below zero, all zero, on a coarse grid (ties), integers over 7."""
    x = (rng.standard_normal((count, K)) * 10 ** rng.uniform(-3, 3, (count, 1))).astype(np.float32)
    kind = np.arange(count) % 6
    x[kind == 1] = np.abs(x[kind == 1])
    x[kind == 2] = -np.abs(x[kind == 2])
    x[kind == 3] = 0
    x[kind == 4] = np.round(x[kind == 4] * 4) / 4
    x[kind == 5] = rng.integers(-300, 300, ((kind == 5).sum(), K)) / 7
    return x


@pytest.mark.parametrize("solo", [False, True])
def test_quantize_tokens_gives_the_onnx_ops_bits(library, tmp_path, solo):
    """200 rows of 576 take the pool's path (over 65536 values) unless the switch is on."""
    ops = _per_token_projection()
    fused = _per_token_projection()
    assert rewrite_quantize(fused, tmp_path) == 1
    assert [n.op_type for n in fused.graph.node].count("QuantizeTokens") == 1
    reference = make_session(ops.SerializeToString(), level="all")
    ours = make_session(fused.SerializeToString(), custom_ops=library)
    x = _rows(np.random.default_rng(7), 200)
    switch = solo_ops(library)
    try:
        switch.set(solo)
        want = reference.run(None, {"x": x})
        got = ours.run(None, {"x": x})
        for a, b in zip(want, got):
            assert a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))
        alone = [ours.run(None, {"x": x[i:i + 1]}) for i in range(12)]
        for k, whole in enumerate(got):
            assert np.array_equal(np.concatenate([a[k] for a in alone]).view(np.uint8),
                                  whole[:12].view(np.uint8))
    finally:
        switch.set(False)


def test_a_chain_read_inside_stays(tmp_path):
    model = _per_token_projection()
    span = next(n.output[0] for n in model.graph.node if n.op_type == "Sub"
                and "/per_token/span" in n.output[0])
    kept = _per_token_projection(extra_output=span)
    assert rewrite_quantize(kept, tmp_path) == 0
