"""The SpeculativeVerify onnxruntime custom op (kernels/cpu_op.c) and the one-session executor.

The op alone, in a one-node graph, against the torch reference the Triton and numba kernels
are checked with (append, then attend over shuffled block tables, both q/k/v layouts, long
windows split over onnxruntime's pool); its errors; then every fixture bundle's model run
as one session against its segments, and the fallbacks when the op cannot be used.
"""

from __future__ import annotations

import subprocess

import numpy as np
import onnxruntime as ort
import pytest
import torch
from cpu_builds import library_for, marches
from onnx import TensorProto, helper
from test_cpu_kernel import _case
from test_kernels import GEOMETRIES, _seeded, assert_close

from dspark.kernels.cpu_op import op_library
from dspark.kernels.verify_attention import verify_attention_reference
from dspark.runtime.bundle.bundle import open_bundle
from dspark.runtime.cache.kv_arena import KVArena
from dspark.runtime.env import kernel_cache_dir, read_env
from dspark.runtime.model.batch import FlatBatch, SeqChunk
from dspark.runtime.model.executor import SegmentedModel
from dspark.runtime.model.fused import FusedModel
from dspark.runtime.model.paged_attention import PagedAttention
from dspark.runtime.model.runner import cpu_model
from dspark.runtime.model.sessions import make_session

from model_fixtures import ARCHS, FORMS

FAST_GEOMETRIES = [(64, 9, 3), (64, 8, 2), (64, 4, 4), (64, 2, 1)]  # head_dim 64, group 3/4/1/2
INVALID = ort.capi.onnxruntime_pybind11_state.InvalidArgument
FEEDS = ("q", "k", "v", "k_pool", "v_pool", "tables", "starts", "qoffs", "news")


@pytest.fixture(scope="module", params=marches())
def library(request):
    return library_for(request.param)


def _op_session(library, heads: int, kv: int, dim: int, layout: str, **attrs):
    f, i = TensorProto.FLOAT, TensorProto.INT64
    inputs = [helper.make_tensor_value_info(n, f, None) for n in FEEDS[:5]]
    inputs += [helper.make_tensor_value_info(n, i, None) for n in FEEDS[5:]]
    node = helper.make_node("SpeculativeVerify", list(FEEDS), ["out"], domain="ai.dspark",
                            num_heads=heads, num_kv_heads=kv, head_dim=dim, scale=dim ** -0.5,
                            layout=layout, **attrs)
    graph = helper.make_graph([node], "op", inputs,
                              [helper.make_tensor_value_info("out", f, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("ai.dspark", 1)])
    return make_session(model.SerializeToString(), custom_ops=library)


def _graph_view(x: np.ndarray, layout: str) -> np.ndarray:
    """[T, heads, d] as the graph holds it: [1, T, heads*d] or [1, heads, T, d]."""
    if layout == "tokens":
        return np.ascontiguousarray(x.reshape(1, x.shape[0], -1))
    return np.ascontiguousarray(x.transpose(1, 0, 2)[None])


@pytest.mark.parametrize("window", [0, 5, 40])
@pytest.mark.parametrize("layout", ["tokens", "heads"])
@pytest.mark.parametrize("news", [[1], [1, 1, 1], [5], [3, 1, 8], [17, 2], [150, 3]])
@pytest.mark.parametrize("block", [16, 7])
@pytest.mark.parametrize("geometry", GEOMETRIES + FAST_GEOMETRIES[1:],
                         ids=lambda g: f"d{g[0]}h{g[1]}kv{g[2]}")
def test_op_matches_reference(library, geometry, block, news, layout, window):
    """[150, 3] is a prefill-sized window: split in query blocks over the intra-op pool.
    window 5 and 40: a sliding-window layer, cut inside a verify window and inside a prefill
    query block."""
    dim, heads, kv = geometry
    rng, _ = _seeded("ort-op", geometry, block, news, window)
    q, k, v, k_pool, v_pool, tables, starts, qoffs, lens = _case(rng, heads, kv, dim, block, news)
    want_k, want_v = k_pool.copy(), v_pool.copy()
    for s in range(len(news)):
        for j in range(lens[s]):
            p = starts[s] + j
            want_k[tables[s, p // block], :, p % block] = k[qoffs[s] + j]
            want_v[tables[s, p // block], :, p % block] = v[qoffs[s] + j]
    sess = _op_session(library, heads, kv, dim, layout, window=window)
    [out] = sess.run(["out"], dict(zip(FEEDS, (
        _graph_view(q, layout), _graph_view(k, layout), _graph_view(v, layout), k_pool, v_pool,
        tables, starts, qoffs, lens))))
    np.testing.assert_array_equal(k_pool, want_k)  # appended in place, in the caller's arrays
    np.testing.assert_array_equal(v_pool, want_v)
    t = torch.from_numpy
    want = verify_attention_reference(t(q), t(want_k), t(want_v), t(tables), t(starts), t(lens),
                                      t(qoffs), dim ** -0.5, window)
    got = out[0] if layout == "tokens" else out[0].transpose(1, 0, 2)
    assert out.shape == _graph_view(q, layout).shape
    assert_close(t(np.ascontiguousarray(got)).reshape(q.shape), want, 2e-5)


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("news", [[1], [3, 1, 8], [150, 3]])
@pytest.mark.parametrize("geometry", [GEOMETRIES[0], FAST_GEOMETRIES[0]],
                         ids=lambda g: f"d{g[0]}h{g[1]}kv{g[2]}")
def test_op_soft_caps_its_scores(library, geometry, news, window):
    """Gemma 2's `softcap` attribute on every path of the op (each machine path, head_dim
    64's fast one, a prefill's query blocks); a small cap, so that it changes the output."""
    dim, heads, kv = geometry
    rng, _ = _seeded("ort-op-softcap", geometry, news, window)
    q, k, v, k_pool, v_pool, tables, starts, qoffs, lens = _case(rng, heads, kv, dim, 16, news)
    q *= 3
    sess = _op_session(library, heads, kv, dim, "tokens", window=window, softcap=1.5)
    [out] = sess.run(["out"], dict(zip(FEEDS, (
        _graph_view(q, "tokens"), _graph_view(k, "tokens"), _graph_view(v, "tokens"), k_pool,
        v_pool, tables, starts, qoffs, lens))))
    t = torch.from_numpy
    args = (t(q), t(k_pool), t(v_pool), t(tables), t(starts), t(lens), t(qoffs), dim ** -0.5,
            window)
    got = t(np.ascontiguousarray(out[0])).reshape(q.shape)
    assert_close(got, verify_attention_reference(*args, 1.5), 2e-5)
    assert not torch.allclose(got, verify_attention_reference(*args), atol=1e-3)


@pytest.mark.parametrize("span", [0, 4])
@pytest.mark.parametrize("layout", ["tokens", "heads"])
@pytest.mark.parametrize("geometry", FAST_GEOMETRIES, ids=lambda g: f"d{g[0]}h{g[1]}kv{g[2]}")
def test_a_window_agrees_with_decoding_its_tokens_one_by_one(library, geometry, layout, span):
    """Greedy speculation is lossless only if verifying a window scores each position
    exactly as decoding it would: the op's output for a 6-token window equals, bit for bit,
    six one-token steps over the same cache (and the reference within float tolerance); also
    in a sliding-window layer (span 4, cut inside the 6 tokens)."""
    dim, heads, kv = geometry
    rng, _ = _seeded("window-vs-steps", geometry, layout, span)
    q, k, v, k_pool, v_pool, tables, starts, qoffs, lens = _case(rng, heads, kv, dim, 16, [6])
    sess = _op_session(library, heads, kv, dim, layout, window=span)

    def run(rows: slice, start: int, pools) -> np.ndarray:
        n = rows.stop - rows.start
        [out] = sess.run(["out"], dict(zip(FEEDS, (
            _graph_view(q[rows], layout), _graph_view(k[rows], layout),
            _graph_view(v[rows], layout), *pools, tables, np.array([start], np.int64),
            np.zeros(1, np.int64), np.array([n], np.int64)))))
        return out[0] if layout == "tokens" else out[0].transpose(1, 0, 2)

    window = run(slice(0, 6), int(starts[0]), (k_pool.copy(), v_pool.copy()))
    pools = (k_pool.copy(), v_pool.copy())
    steps = np.concatenate([run(slice(j, j + 1), int(starts[0]) + j, pools).reshape(1, -1)
                            for j in range(6)])
    np.testing.assert_array_equal(window.reshape(6, -1), steps)


@pytest.mark.parametrize("span", [0, 40])
@pytest.mark.parametrize("geometry", FAST_GEOMETRIES, ids=lambda g: f"d{g[0]}h{g[1]}kv{g[2]}")
def test_a_window_at_a_long_context_agrees_with_its_steps(library, geometry, span):
    """At 203 cached tokens the keys are scored 16 at a time where a run fills a cache block
    and one by one elsewhere, and a long context's window is cut into several work items:
    a 9-token window still equals its nine one-token steps bit for bit, and the reference
    within float tolerance."""
    dim, heads, kv = geometry
    rng, _ = _seeded("long-window", geometry, span)
    start, n, block = 203, 9, 16
    need = -(-(start + n) // block)
    blocks = need + 5
    f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    q, k, v = f32(n, heads, dim), f32(n, kv, dim), f32(n, kv, dim)
    k_pool, v_pool = f32(blocks, kv, block, dim), f32(blocks, kv, block, dim)
    tables = rng.permutation(blocks)[None, :need].astype(np.int64)
    sess = _op_session(library, heads, kv, dim, "tokens", window=span)

    def run(rows: slice, at: int, pools) -> np.ndarray:
        [out] = sess.run(["out"], dict(zip(FEEDS, (
            _graph_view(q[rows], "tokens"), _graph_view(k[rows], "tokens"),
            _graph_view(v[rows], "tokens"), *pools, tables, np.array([at], np.int64),
            np.zeros(1, np.int64), np.array([rows.stop - rows.start], np.int64)))))
        return out[0]

    written = (k_pool.copy(), v_pool.copy())
    window = run(slice(0, n), start, written)
    pools = (k_pool.copy(), v_pool.copy())
    steps = np.concatenate([run(slice(j, j + 1), start + j, pools) for j in range(n)])
    np.testing.assert_array_equal(window, steps)
    t = torch.from_numpy
    want = verify_attention_reference(t(q), t(written[0]), t(written[1]), t(tables),
                                      t(np.array([start])), t(np.array([n])),
                                      t(np.zeros(1, np.int64)), dim ** -0.5, span)
    assert_close(t(np.ascontiguousarray(window)).reshape(q.shape), want, 2e-5)


def test_loading_the_op_leaves_the_process_floating_point_state(library):
    """A library built with -ffast-math turns on flush-to-zero for the whole process when it
    loads (crtfastmath.o): subnormals would vanish from every computation."""
    import sys

    _op_session(library, 4, 2, 16, "tokens")
    assert sys.float_info.min / 2 > 0
    assert np.float32(1e-38) / np.float32(100) > 0


def test_op_rejects_inconsistent_inputs(library):
    rng, _ = _seeded("ort-op-bad")
    q, k, v, k_pool, v_pool, tables, starts, qoffs, lens = _case(rng, 4, 2, 16, 16, [3])
    feeds = dict(zip(FEEDS, (_graph_view(q, "tokens"), _graph_view(k, "tokens"),
                             _graph_view(v, "tokens"), k_pool, v_pool, tables, starts, qoffs,
                             lens)))
    wrong_heads = _op_session(library, 8, 2, 16, "tokens")
    with pytest.raises(INVALID,
                       match="SpeculativeVerify: q/k/v, the pools or the tables"):
        wrong_heads.run(["out"], feeds)
    sess = _op_session(library, 4, 2, 16, "tokens")
    before = k_pool.copy()
    with pytest.raises(INVALID, match="out of range"):
        sess.run(["out"], {**feeds, "tables": np.full_like(tables, 10_000)})
    with pytest.raises(INVALID, match="out of range"):
        sess.run(["out"], {**feeds, "news": lens + 1})  # more rows than the batch has
    np.testing.assert_array_equal(k_pool, before)  # nothing written out of place
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.RuntimeException,
                       match="num_heads a multiple of num_kv_heads"):
        _op_session(library, 6, 4, 16, "tokens")  # refused when the session is created


def _step_logits(model, arena: KVArena, pool: str, chunks: list[SeqChunk]) -> np.ndarray:
    for c in chunks:
        arena.reserve(c.slot, pool, c.start, len(c.tokens))
    return model.forward(FlatBatch.build(chunks)).copy()


@pytest.mark.parametrize("role", ["main", "draft"])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("arch", ARCHS)
def test_one_session_matches_segments(compiled, library, arch, form, role):
    """Every fixture architecture and export form: a prefill, then a batch of a decode and a
    verify window, through the one session and through the segments, each over its own
    arena from the same start. The logits agree and so do the caches they wrote."""
    bundle = open_bundle(compiled[(arch, form)])
    spec = bundle.model(role)
    runs = []
    for fused in (True, False):
        arena = KVArena(bundle.plan)
        pool = role if role in arena.pools else "main"  # a draft may read the main's cache
        model = (FusedModel(bundle, role, arena, pool, library) if fused
                 else SegmentedModel(bundle, role, PagedAttention(arena, pool)))
        rng = np.random.default_rng(7)
        ids = lambda n, r=rng: tuple(int(x) for x in r.integers(3, spec.vocab_size, n))  # noqa: E731
        for seq in (1, 2):
            arena.add_sequence(seq)
        first = _step_logits(model, arena, pool, [SeqChunk(1, 0, ids(21)),
                                                  SeqChunk(2, 0, ids(9))])
        second = _step_logits(model, arena, pool, [SeqChunk(1, 21, ids(1)),
                                                   SeqChunk(2, 9, ids(5))])
        runs.append((first, second, arena.pools[pool].k[-1].clone()))
    for got, want in zip(runs[0], runs[1]):
        assert_close(torch.as_tensor(got), torch.as_tensor(want), 1e-3)


def test_build_falls_back_when_the_vector_math_library_is_missing(monkeypatch, tmp_path):
    """Where the first build cannot link (no libmvec), the plain one still gives an op. The
    builds' order and fallback are what is tested, on one small source (the op's own sources
    take ~40 s a build here; with the plain build's flags they are checked by the compiler's
    front end, which is what those flags could break)."""
    from dspark.kernels import cpu_op

    source = tmp_path / "probe.c"
    source.write_text("int dspark_probe(void) { return 1; }\n")
    monkeypatch.setattr(cpu_op, "SOURCES", (source,))
    fast, plain = cpu_op.BUILDS
    monkeypatch.setattr(cpu_op, "BUILDS", ((fast[0], fast[1], ("-lno-such-library",)), plain))
    built = op_library(str(tmp_path), read_env().cc)
    assert built.path is not None and built.path.parent == tmp_path, built.reason
    monkeypatch.setattr(cpu_op, "BUILDS", ((fast[0], fast[1], ("-lno-such-library",)),))
    failed = op_library(str(tmp_path / "none"), read_env().cc)
    assert failed.path is None and "no-such-library" in failed.reason
    monkeypatch.undo()
    for real in cpu_op.SOURCES:
        flags = [f for f in cpu_op._flags(plain[0], real) if f != "-c"]
        done = subprocess.run([read_env().cc, *flags, "-fsyntax-only", str(real)],
                              capture_output=True, text=True)
        assert done.returncode == 0, (real.name, done.stderr[-500:])


def test_fallbacks_to_segments(compiled, monkeypatch):
    """No compiler, or the op turned off: the segments."""
    bundle = open_bundle(next(iter(compiled.values())))
    arena = KVArena(bundle.plan)
    assert isinstance(cpu_model(bundle, "main", arena, "main"), FusedModel)
    missing = op_library(kernel_cache_dir(), "/nonexistent/cc")
    assert missing.path is None and "no C compiler" in missing.reason
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert isinstance(cpu_model(bundle, "main", arena, "main"), SegmentedModel)
    monkeypatch.delenv("CC")
    monkeypatch.setenv("DSPARK_CPU_OP", "0")
    assert isinstance(cpu_model(bundle, "main", arena, "main"), SegmentedModel)


def test_the_march_must_be_a_name(monkeypatch):
    """DSPARK_CPU_MARCH goes on the compiler's command line: only a -march name is taken."""
    from dspark.runtime.errors import DSparkError

    for bad in ("native -O0", "-fsanitize=address", "x;y"):
        monkeypatch.setenv("DSPARK_CPU_MARCH", bad)
        with pytest.raises(DSparkError, match="DSPARK_CPU_MARCH must be a -march name"):
            read_env()
    monkeypatch.setenv("DSPARK_CPU_MARCH", "x86-64-v3")
    assert read_env().cpu_march == "x86-64-v3"
    monkeypatch.delenv("DSPARK_CPU_MARCH")
    assert read_env().cpu_march == "native"
