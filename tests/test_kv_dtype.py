"""float16 and int8 KV caches (`--kv-cache-dtype`): another model function, exact against it.

Rows are rounded alike by the C op (kernels/cpu_kv.c), numpy (runtime/cache/kv_rows.py) and
the reference's ONNX ops (compiler/kv_rounding.py), bit for bit. The op stores them and
attends over what it stored, on every vector path this CPU runs and a build without any;
the engine's greedy output with speculation equals plain decoding's and the original model's
with its cache rounded the same way; dsc verify passes such a bundle and fails one that
does not round.
"""

from __future__ import annotations

import ctypes

import numpy as np
import onnx_graphsurgeon as gs
import pytest
import torch
from cpu_builds import library_for, marches
from lossless import first_fork
from test_cpu_op import FEEDS, _graph_view
from test_kernels import _seeded, assert_close

from dspark.compiler.kv_rounding import _rounded, kv_rounded
from dspark.compiler.reference import OriginalModel
from dspark.kernels.verify_attention import verify_attention_reference
from dspark.runtime.bundle.bundle import open_bundle
from dspark.runtime.cache import kv_rows
from dspark.runtime.engine.engine import Engine
from dspark.runtime.model.sessions import make_session
from dspark.runtime.sequence.request import GenerationRequest

KINDS = {"float16": 1, "int8": 2}
BLOCKS = 24


@pytest.fixture(scope="module", params=[*marches(), "x86-64-v2"])
def library(request):
    """Every build this CPU runs, and one without AVX (the rows converted one by one)."""
    import platform

    if request.param == "x86-64-v2" and platform.machine() != "x86_64":
        pytest.skip("an x86-64 build")
    return library_for(request.param)


def _edge_rows(rng) -> np.ndarray:
    x = (rng.standard_normal((64, 64)) * np.logspace(-9, 5, 64)[:, None]).astype(np.float32)
    x[0] = 0
    x[1, :6] = [65520, -65519, 1e-9, 6e-8, 3e-8, 2.0 ** -24 * 1.5]  # overflow, subnormal ties
    x[2] = np.float32(127) * np.arange(64, dtype=np.float32) / 128  # int8 halfway steps
    return x


@pytest.mark.parametrize("dtype", list(KINDS))
def test_rows_round_alike_in_c_numpy_and_onnx(library, dtype):
    x = _edge_rows(np.random.default_rng(1))
    want = kv_rows.round_rows(x, dtype)
    fn = ctypes.CDLL(str(library)).dspark_kv_round
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_int64, ctypes.c_void_p]
    out, scratch = np.empty_like(x), np.empty(x.size * 4, np.uint8)
    fn(KINDS[dtype], x.ctypes.data, out.ctypes.data, len(x), x.shape[1], scratch.ctypes.data)
    np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(kv_rows.load(kv_rows.store(x, dtype), dtype), want)
    graph = gs.Graph(inputs=[gs.Variable("x", np.float32, x.shape)], opset=17)
    graph.outputs = [_rounded(graph, graph.inputs[0], dtype, "/r", 17)]
    graph.outputs[0].shape = x.shape
    session = make_session(gs.export_onnx(graph).SerializeToString(), level="all")
    [onnx_out] = session.run(None, {"x": x})
    np.testing.assert_array_equal(onnx_out, want)  # the same values (Round keeps a -0's sign)
    if dtype == "int8":
        assert np.abs(want - x).max() <= np.abs(x).max() / 254 * 1.0001


def _op_session(library, heads, kv, dim, dtype, window):
    from onnx import TensorProto, helper

    f, i = TensorProto.FLOAT, TensorProto.INT64
    inputs = [helper.make_tensor_value_info(n, f, None) for n in FEEDS[:5]]
    inputs += [helper.make_tensor_value_info(n, i, None) for n in FEEDS[5:]]
    node = helper.make_node("SpeculativeVerify", list(FEEDS), ["out"], domain="ai.dspark",
                            num_heads=heads, num_kv_heads=kv, head_dim=dim, scale=dim ** -0.5,
                            layout="tokens", window=window, kv_dtype=dtype)
    model = helper.make_model(helper.make_graph(
        [node], "op", inputs, [helper.make_tensor_value_info("out", f, None)]),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.dspark", 1)])
    return make_session(model.SerializeToString(), custom_ops=library)


def _stored_case(rng, heads, kv, dim, block, news, dtype):
    starts = [int(rng.integers(0, 3 * block)) for _ in news]
    need = [-(-(s + n) // block) for s, n in zip(starts, news)]
    perm = rng.permutation(BLOCKS)
    tables = np.zeros((len(news), max(need)), np.int64)
    at = 0
    for s, n in enumerate(need):
        tables[s, :n] = perm[at:at + n]
        at += n
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    pools = [kv_rows.store(f32(BLOCKS, kv, block, dim), dtype) for _ in range(2)]
    qoffs = np.concatenate([[0], np.cumsum(news)[:-1]]).astype(np.int64)
    tokens = sum(news)
    return (f32(tokens, heads, dim), f32(tokens, kv, dim), f32(tokens, kv, dim), pools, tables,
            np.array(starts, np.int64), qoffs, np.array(news, np.int64))


def _run(sess, q, k, v, pools, tables, starts, qoffs, lens):
    as_f32 = [p.view(np.float32) for p in pools]  # rows bound as floats, as the arena is
    [out] = sess.run(["out"], dict(zip(FEEDS, (_graph_view(q, "tokens"), _graph_view(
        k, "tokens"), _graph_view(v, "tokens"), *as_f32, tables, starts, qoffs, lens))))
    return out[0]


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("news", [[1], [3, 1, 8], [40, 2]])
@pytest.mark.parametrize("geometry", [(64, 9, 3), (64, 8, 2), (16, 4, 4), (24, 6, 2)],
                         ids=lambda g: f"d{g[0]}h{g[1]}kv{g[2]}")
@pytest.mark.parametrize("dtype", list(KINDS))
def test_op_stores_rows_and_attends_over_them(library, dtype, geometry, news, window):
    dim, heads, kv = geometry
    rng, _ = _seeded("kv-op", dtype, geometry, news, window)
    q, k, v, pools, tables, starts, qoffs, lens = _stored_case(rng, heads, kv, dim, 16, news,
                                                               dtype)
    want = [p.copy() for p in pools]
    for s in range(len(news)):
        for j in range(lens[s]):
            p = starts[s] + j
            for pool, x in zip(want, (k, v)):
                pool[tables[s, p // 16], :, p % 16] = kv_rows.store(x[qoffs[s] + j], dtype)
    out = _run(_op_session(library, heads, kv, dim, dtype, window), q, k, v, pools, tables,
               starts, qoffs, lens)
    np.testing.assert_array_equal(pools[0], want[0])  # stored in place, rounded as numpy does
    np.testing.assert_array_equal(pools[1], want[1])
    t = torch.from_numpy
    ref = verify_attention_reference(t(q), t(kv_rows.load(want[0], dtype)),
                                     t(kv_rows.load(want[1], dtype)), t(tables), t(starts),
                                     t(lens), t(qoffs), dim ** -0.5, window)
    assert_close(t(np.ascontiguousarray(out)).reshape(q.shape), ref, 2e-5)


@pytest.mark.parametrize("window", [0, 4])
@pytest.mark.parametrize("dtype", list(KINDS))
def test_a_window_is_its_steps_bit_for_bit(library, dtype, window):
    """Past 200 cached tokens (keys scored 16 at a time where a run fills a block): a
    9-token window's output is its nine one-token steps', bit for bit."""
    rng, _ = _seeded("kv-window", dtype, window)
    heads, kv, dim, n = 9, 3, 64, 9
    q, k, v, pools, tables, _, _, _ = _stored_case(rng, heads, kv, dim, 16, [n], dtype)
    tables = rng.permutation(BLOCKS)[None, :15].astype(np.int64)
    sess = _op_session(library, heads, kv, dim, dtype, window)

    def run(rows: slice, at: int, pools) -> np.ndarray:
        return _run(sess, q[rows], k[rows], v[rows], pools, tables, np.array([at], np.int64),
                    np.zeros(1, np.int64), np.array([rows.stop - rows.start], np.int64))

    whole = run(slice(0, n), 203, [p.copy() for p in pools])
    copies = [p.copy() for p in pools]
    steps = np.concatenate([run(slice(j, j + 1), 203 + j, copies) for j in range(n)])
    np.testing.assert_array_equal(whole, steps)


def _greedy(path, kv_dtype, method, prompts, max_new=24):
    engine = Engine(open_bundle(path), "fixed", 4, max_batch=len(prompts), kv_dtype=kv_dtype)
    seqs = engine.generate([GenerationRequest(
        tuple(p), max_new, speculative=method != "plain",
        method=None if method == "plain" else method) for p in prompts])
    return [s.generated for s in seqs]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("dtype", list(KINDS))
def test_greedy_is_the_rounded_originals_with_speculation_on_and_off(compiled, fixture_pairs,
                                                                     monkeypatch, arch, dtype):
    """The engine at a float16 or int8 cache: plain decoding, the draft model and lookups
    give the same tokens, batched; they are the original's own greedy loop with its cache
    rounded alike (gemma3: prompts past its 8-position window); the segments (no C op) give
    them too."""
    path = compiled[(arch, "classic")]
    rng = np.random.default_rng(7)
    prompts = [[int(t) for t in rng.integers(3, 300, n)] for n in (5, 19, 40)]
    plain = _greedy(path, dtype, "plain", prompts)
    for method in ("draft", "lookup"):
        assert _greedy(path, dtype, method, prompts) == plain, method
    main = fixture_pairs[(arch, "classic")][0]
    original = OriginalModel(main, make_session(kv_rounded(main, dtype).SerializeToString(),
                                                level="all"))
    for p, got in zip(prompts, plain):
        assert first_fork(got, original.greedy(p, 24), p, original, set(), "length") is None
    monkeypatch.setenv("DSPARK_CPU_OP", "0")
    assert _greedy(path, dtype, "draft", prompts) == plain


def test_dsc_verify_checks_the_rounded_function(compiled, fixture_pairs, monkeypatch):
    """dsc verify --kv-cache-dtype passes the bundle; a bundle side that does not round its
    cache is found out."""
    from dspark.compiler import verify

    path = compiled[("llama", "classic")]
    main = fixture_pairs[("llama", "classic")][0]
    bundle = open_bundle(path)
    report = verify.verify_model(bundle, "main", main, kv_dtype="int8")
    assert report.ok(1e-3), report
    plain = verify.ContiguousKVCache
    monkeypatch.setattr(verify, "ContiguousKVCache",
                        lambda spec, slots, length, stored=None: plain(spec, slots, length))
    assert not verify.verify_model(bundle, "main", main, kv_dtype="int8").ok(1e-3)


def test_a_genai_cache_cannot_be_rounded_in_its_original():
    """GroupQueryAttention rotates the keys it caches: the original cannot be rounded alike,
    and the refusal names the node."""
    from conftest import BUILD

    from dspark.runtime.errors import UnmappableAttentionError

    from model_fixtures import build_genai_fixtures

    folder = build_genai_fixtures(BUILD)["llama-fp32"]
    with pytest.raises(UnmappableAttentionError, match="GroupQueryAttention node '.+'"):
        kv_rounded(folder / "model.onnx", "int8")
