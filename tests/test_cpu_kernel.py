"""The compiled CPU verify kernel (kernels/cpu_verify.py) against the torch reference that
also checks the Triton kernel: append, then attend, over interleaved block tables."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_kernels import GEOMETRIES, _seeded, assert_close

from dspark.kernels.cpu_verify import cpu_verify_attention
from dspark.kernels.verify_attention import verify_attention_reference

BLOCKS = 40


def _case(rng, heads: int, kv: int, dim: int, block: int, news: list[int]):
    """Sequences with odd cached lengths and shuffled, interleaved blocks."""
    starts = [int(rng.integers(0, 3 * block)) for _ in news]
    need = [-(-(s + n) // block) for s, n in zip(starts, news)]
    perm = rng.permutation(BLOCKS)
    tables = np.zeros((len(news), max(need)), np.int64)
    pos = 0
    for i, n in enumerate(need):
        tables[i, :n] = perm[pos:pos + n]
        pos += n
    tokens = sum(news)
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    pools = f32(BLOCKS, kv, block, dim), f32(BLOCKS, kv, block, dim)
    qoffs = np.concatenate([[0], np.cumsum(news)[:-1]]).astype(np.int64)
    return (f32(tokens, heads, dim), f32(tokens, kv, dim), f32(tokens, kv, dim), *pools, tables,
            np.array(starts, np.int64), qoffs, np.array(news, np.int64))


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("news", [[1], [1, 1, 1], [5], [3, 1, 8], [17, 2]])
@pytest.mark.parametrize("block", [16, 7])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: f"d{g[0]}h{g[1]}kv{g[2]}")
def test_cpu_verify_matches_reference(geometry, block, news, window):
    """window 5: a sliding-window layer (cached lengths up to 3 blocks cross it)."""
    dim, heads, kv = geometry
    rng, _ = _seeded("cpu", geometry, block, news, window)
    q, k, v, k_pool, v_pool, tables, starts, qoffs, lens = _case(rng, heads, kv, dim, block, news)
    want_k, want_v = k_pool.copy(), v_pool.copy()
    for s in range(len(news)):  # the append the kernel must make
        for j in range(lens[s]):
            p = starts[s] + j
            want_k[tables[s, p // block], :, p % block] = k[qoffs[s] + j]
            want_v[tables[s, p // block], :, p % block] = v[qoffs[s] + j]
    out = np.full_like(q, np.nan)
    cpu_verify_attention(q, k, v, k_pool, v_pool, tables, starts, qoffs, lens,
                         np.arange(len(news), dtype=np.int64), dim ** -0.5, out, window)
    np.testing.assert_array_equal(k_pool, want_k)
    np.testing.assert_array_equal(v_pool, want_v)
    t = torch.from_numpy
    want = verify_attention_reference(t(q), t(want_k), t(want_v), t(tables), t(starts), t(lens),
                                      t(qoffs), dim ** -0.5, window)
    assert_close(t(out), want, 2e-5)


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("news", [[1], [3, 1, 8], [17, 2]])
def test_cpu_verify_soft_caps_its_scores(news, window):
    """Gemma 2's soft-cap (a small one, so that it changes the output)."""
    dim, heads, kv = GEOMETRIES[0]
    rng, _ = _seeded("cpu-softcap", news, window)
    q, k, v, k_pool, v_pool, tables, starts, qoffs, lens = _case(rng, heads, kv, dim, 16, news)
    q *= 3
    out = np.full_like(q, np.nan)
    cpu_verify_attention(q, k, v, k_pool, v_pool, tables, starts, qoffs, lens,
                         np.arange(len(news), dtype=np.int64), dim ** -0.5, out, window, 1.5)
    t = torch.from_numpy
    args = (t(q), t(k_pool), t(v_pool), t(tables), t(starts), t(lens), t(qoffs), dim ** -0.5,
            window)
    assert_close(t(out), verify_attention_reference(*args, 1.5), 2e-5)
    assert not torch.allclose(t(out), verify_attention_reference(*args), atol=1e-3)


def test_cpu_verify_leaves_other_sequences_alone():
    """Only the chosen sequences are appended and attended (the others take the
    onnxruntime path in the same forward)."""
    rng, _ = _seeded("subset")
    q, k, v, k_pool, v_pool, tables, starts, qoffs, lens = _case(rng, 4, 2, 16, 16, [2, 3])
    before = k_pool.copy()
    out = np.full_like(q, np.nan)
    cpu_verify_attention(q, k, v, k_pool, v_pool, tables, starts, qoffs, lens,
                         np.array([1], np.int64), 0.25, out)
    assert np.isnan(out[:2]).all() and not np.isnan(out[2:]).any()
    touched = {int(b) for b in np.nonzero((k_pool != before).any(axis=(1, 2, 3)))[0]}
    assert touched <= set(tables[1].tolist()) and touched
