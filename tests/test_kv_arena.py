"""The unified arena: one allocation, shared block tables, O(1) rollback, blocks returned."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dspark.runtime.bundle.memory_plan import plan_memory
from dspark.runtime.bundle.spec import ModelSpec, VerifyOp
from dspark.runtime.cache.kv_arena import ArenaFullError, Delta, KVArena
from dspark.runtime.model.attention_ref import verify_attention
from dspark.runtime.model.batch import FlatBatch, SeqChunk
from dspark.runtime.model.contiguous_cache import ContiguousKVCache
from dspark.runtime.model.paged_attention import PagedAttention


def _spec(role: str, layers=2, heads=4, kv_heads=2, dim=16, windows=()) -> ModelSpec:
    windows = windows or (0,) * layers
    ops = tuple(VerifyOp(f"/{role}/{i}", i, "q", "k", "v", "o", heads, kv_heads, dim, 0.25, i,
                         window=windows[i]) for i in range(layers))
    return ModelSpec(role, layers, heads, kv_heads, dim, 100, "float32", ("input_ids",),
                     "g", "w", (), ops)


@pytest.fixture
def arena():
    specs = [_spec("main"), _spec("draft", layers=1, heads=2, kv_heads=1, dim=8)]
    per_block = 16 * sum(s.kv_bytes_per_token for s in specs)
    return KVArena(plan_memory(specs, 12 * per_block, 16, 64))


def test_one_allocation_viewed_per_pool_and_layer(arena):
    assert arena.layout.num_blocks == 12
    assert [g.num_blocks for g in arena.layout.groups] == [12, 12]
    main, draft = arena.pools["main"], arena.pools["draft"]
    assert main.k[0].shape == (12, 2, 16, 16) and draft.v[0].shape == (12, 1, 16, 8)
    for t in (*main.k, *main.v, *draft.k, *draft.v):
        assert t.untyped_storage().data_ptr() == arena.buffer.untyped_storage().data_ptr()
    main.v[1][3, 1, 2, 5] = 7.0  # views do not overlap
    assert float(arena.buffer.view(torch.float32).sum()) == 7.0


def test_reserve_rollback_release(arena):
    arena.add_sequence(0)
    arena.add_sequence(1)
    arena.reserve(0, "main", 0, 20)  # 2 blocks
    arena.reserve(1, "main", 0, 5)  # 1 block
    arena.reserve(0, "draft", 0, 33)  # the draft's own group: 3 blocks
    assert arena.tables[0].blocks == {"main": [0, 1], "draft": [0, 1, 2]}
    assert arena.tables[1].blocks["main"] == [2]
    arena.rollback(0, "draft", 18)  # O(1): block 2 stays as slack until compaction
    assert arena.tables[0].blocks["draft"] == [0, 1, 2]
    assert arena.groups["draft"].blocks.available == 9
    assert arena.release_slack(0) == 1 and arena.tables[0].blocks["draft"] == [0, 1]
    arena.reserve(0, "main", 20, 5)
    arena.rollback(0, "main", 21)  # 4 rejected slots released, none copied
    assert arena.tables[0].lengths == {"main": 21, "draft": 18}
    assert list(arena.tables[0].log)[-1] == Delta("main", 20, 5, 1)
    arena.release(0)
    arena.release(1)
    assert arena.free_blocks == 12 and not arena.tables


def test_arena_full_is_a_clear_error(arena):
    arena.add_sequence(0)
    with pytest.raises(ArenaFullError, match="KV arena full"):
        arena.reserve(0, "main", 0, 16 * 13)


@pytest.mark.parametrize("windows", [(0, 0), (0, 6)])
@pytest.mark.parametrize("new", [(1, 1, 1), (3, 1, 7), (16, 5, 1)])
def test_paged_attention_matches_contiguous_reference(arena, new, windows):
    """Interleaved (non-contiguous) block tables, partial blocks, mixed new-token counts;
    windows (0, 6): layer 1 attends to the last 6 positions (the numba kernel and numpy's
    masked windows both cut it)."""
    spec = _spec("main", windows=windows)
    ref_cache = ContiguousKVCache(spec, 3, 64)
    paged = PagedAttention(arena, "main")
    rng = np.random.default_rng(0)
    for s in range(3):
        arena.add_sequence(s)
    starts = [0, 0, 0]
    for step in range(3):
        lens = [int(rng.integers(1, 18)) if step == 0 else n for n in new]
        batch = FlatBatch.build([SeqChunk(s, starts[s], tuple(range(n)))
                                 for s, n in enumerate(lens)])
        for s, n in enumerate(lens):
            arena.reserve(s, "main", starts[s], n)
        t = batch.num_tokens
        for op in spec.verify_ops:
            q = rng.standard_normal((t, 4, 16)).astype(np.float32)  # token rows
            k = rng.standard_normal((t, 2, 16)).astype(np.float32)
            v = rng.standard_normal((t, 2, 16)).astype(np.float32)
            got = paged(op, q, k, v, batch)
            heads_first = lambda x: torch.from_numpy(x).transpose(0, 1)  # noqa: E731
            ref_cache.append(op.layer, heads_first(k), heads_first(v), batch)
            want = verify_attention(heads_first(q), ref_cache, op.layer, batch, op.scale,
                                    op.window)
            np.testing.assert_allclose(got, want.transpose(0, 1).numpy(), rtol=1e-5, atol=1e-5)
        starts = [a + n for a, n in zip(starts, lens)]
    assert any(np.diff(arena.tables[s].blocks["main"]).max(initial=1) > 1 for s in range(3))


@pytest.mark.parametrize("window", [0, 20])
@pytest.mark.parametrize("heads,kv_heads,n,cached", [(9, 3, 70, 30), (4, 4, 65, 0), (8, 2, 1, 99)])
def test_onnxruntime_window_attention_matches_numpy(heads, kv_heads, n, cached, window):
    """Both long-window paths against the torch reference, with the bias visible_bias makes
    (window 20: a sliding-window layer; a decode step past it gets a bias too)."""
    from dspark.runtime.model.attention_ref import causal_window_mask
    from dspark.runtime.model.ort_attention import ort_attend
    from dspark.runtime.model.paged_attention import attend, visible_bias

    rng = np.random.default_rng(3)
    length = cached + n
    q = rng.standard_normal((heads, n, 16)).astype(np.float32)
    k = rng.standard_normal((kv_heads, length, 16)).astype(np.float32)
    v = rng.standard_normal((kv_heads, length, 16)).astype(np.float32)
    bias = visible_bias(cached, n, window)
    assert (bias is None) == (n == 1 and not window)
    want = torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(x)[None] for x in (q, k, v)),
        attn_mask=causal_window_mask(cached, n, window), scale=0.25, enable_gqa=True)[0]
    np.testing.assert_allclose(attend(q, k, v, bias, 0.25), want.numpy(), rtol=1e-5, atol=1e-5)
    if bias is not None:
        np.testing.assert_allclose(ort_attend(q, k, v, bias, 0.25), want.numpy(), rtol=1e-5,
                                   atol=1e-5)
