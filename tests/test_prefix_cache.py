"""Automatic prefix caching (runtime/cache/prefix_cache.py) over the paged arena.

On synthetic geometry: keys, registering and finding, holding and eviction, copy on write,
window groups, admission, and cache health moving shared and cached blocks. The engine over
the cache, on the fixture models: tests/test_prefix_cache_engine.py.
"""

from __future__ import annotations

import pytest

from dspark.runtime.bundle.spec import ModelSpec, VerifyOp
from dspark.runtime.cache.kv_arena import NO_BLOCK, KVArena
from dspark.runtime.cache.layout import arena_layout
from dspark.runtime.cache.manager import KVCache
from dspark.runtime.cache.prefix_cache import PrefixCache, extend_keys
from dspark.runtime.sequence.request import GenerationRequest, Sequence

BS = 16


def _spec(role: str, windows: tuple[int, ...]) -> ModelSpec:
    ops = tuple(VerifyOp(f"/{role}/{i}", i, "q", "k", "v", "o", 2, 1, 8, 0.3, i, window=w)
                for i, w in enumerate(windows))
    return ModelSpec(role, len(windows), 2, 1, 8, 100, "float32", ("input_ids",), "g", "w",
                     (), ops)


def _cache(blocks: int = 12, windows=(0, 0), max_seq_len: int = 64, in_flight: int = 2
           ) -> KVCache:
    spec = _spec("main", windows)
    per_block = BS * spec.kv_bytes_per_token
    layout = arena_layout([spec], blocks * per_block, BS, max_seq_len)
    arena = KVArena(layout)
    return KVCache(arena, PrefixCache(arena, ("main",)), lambda: in_flight)


def _seq(seq_id: int, tokens: list[int], max_tokens: int = 8, cache: bool = True) -> Sequence:
    return Sequence(seq_id, GenerationRequest(tuple(tokens), max_tokens, cache_prompt=cache))


def _run(kv: KVCache, seq: Sequence, final: int | None = None) -> None:
    """Admit `seq`, write its uncached prompt and commit it (as a prefill would)."""
    assert kv.admit(seq)
    kv.arena.reserve(seq.id, "main", seq.main_cached, len(seq.tokens) - seq.main_cached)
    seq.main_cached = len(seq.tokens) if final is None else final
    kv.commit(seq, "main", seq.main_cached)


def test_keys_name_the_whole_prefix():
    a, b, c = [], [], []
    extend_keys(a, list(range(64)), 4, BS)
    extend_keys(b, list(range(64)), 2, BS)
    extend_keys(b, list(range(64)), 4, BS)  # extended later: the same keys
    extend_keys(c, [99] + list(range(1, 64)), 4, BS)  # block 0 differs: every key does
    assert a == b and len(set(a)) == 4
    assert not set(a) & set(c)


def test_a_committed_prefix_is_found_held_and_kept_after_release():
    kv = _cache()
    pool = kv.arena.main.blocks
    first = _seq(1, list(range(50)))
    _run(kv, first)
    assert first.cached_tokens == 0 and pool.cached == 3  # 3 full blocks of 50 tokens
    second = _seq(2, list(range(48)) + [7, 7, 7])
    assert kv.admit(second)
    assert second.main_cached == second.cached_tokens == 48
    table = kv.arena.tables[2].blocks["main"]
    assert table == kv.arena.tables[1].blocks["main"][:3]
    assert all(pool.refs[b] == 2 for b in table)
    kv.release(first)
    kv.release(second)
    # kept, held by nobody: 3 full blocks, and the first's partly filled last one (the
    # second computed nothing past what it found)
    assert pool.available == pool.num_blocks and pool.cached == 4
    third = _seq(3, list(range(40)))  # 2 full blocks, then 7 of the third's 16 tokens
    assert kv.admit(third) and third.cached_tokens == 39
    assert kv.prefix.hit == 48 + 39 and kv.prefix.queried == 50 + 51 + 40


def test_at_least_one_prompt_token_is_left_to_compute():
    kv = _cache()
    _run(kv, _seq(1, list(range(40))))
    again = _seq(2, list(range(32)))  # two cached blocks: the second's last token computed
    assert kv.admit(again) and again.main_cached == 31 and again.uncached == 1
    table = list(kv.arena.tables[2].blocks["main"])
    assert table == kv.arena.tables[1].blocks["main"][:2]
    kv.arena.reserve(2, "main", 31, 1)  # the write copies the block it shares
    assert kv.arena.tables[2].blocks["main"][1] != table[1] and kv.arena.copies == 1


def test_a_finished_conversation_is_found_to_its_last_token():
    """A turn's sequence ends in a partly filled block: released, it is kept under its own
    key, so the next turn (the same tokens, then a new message) finds every final position
    and copies that block before writing into it."""
    kv = _cache()
    turn = _seq(1, list(range(44)))
    _run(kv, turn, final=43)  # as a finished sequence: its last token has no KV yet
    kv.release(turn)
    assert kv.arena.main.blocks.cached == 3  # 2 full blocks, and 11 tokens of the third
    following = _seq(2, list(range(43)) + [500, 501, 502])
    assert kv.admit(following) and following.cached_tokens == 43
    kv.arena.reserve(2, "main", 43, 3)
    assert kv.arena.copies == 1 and kv.arena.main.blocks.cached == 3


def test_uncommitted_positions_are_not_cached():
    """Only positions below `final` (what verification kept) are registered."""
    kv = _cache()
    _run(kv, _seq(1, list(range(48))), final=20)
    assert kv.arena.main.blocks.cached == 1
    other = _seq(2, list(range(48)))
    assert kv.admit(other) and other.cached_tokens == 16


def test_cached_blocks_are_evicted_least_recent_first_and_held_ones_never():
    kv = _cache(blocks=8, max_seq_len=32, in_flight=1)
    pool = kv.arena.main.blocks
    old, recent = _seq(1, list(range(33))), _seq(2, list(range(100, 133)))
    for seq in (old, recent):
        _run(kv, seq)  # 3 blocks each, 2 of them full and registered
    kv.release(old)
    kv.release(recent)
    # each kept its 2 full blocks; its third holds position 32, the last prompt token's,
    # which is computed again (its logits start the output): not kept
    assert pool.cached == 4 and len(pool.free) == 4
    held = _seq(3, list(range(100, 133)))
    assert kv.admit(held) and held.cached_tokens == 32  # recent's prefix, held again
    taken = [pool.take() for _ in range(6)]  # 4 free, then old's 2 cached blocks
    assert pool.evictions == 2 and not set(taken) & set(kv.arena.tables[3].blocks["main"])
    with pytest.raises(Exception, match="KV arena full"):
        pool.take()  # the held prefix is never evicted
    assert kv.prefix.find(list(range(33)), []).positions["main"] == 0  # old is gone
    assert kv.prefix.find(list(range(100, 133)), []).positions["main"] == 32


def test_a_write_into_a_shared_block_copies_it():
    """A fork shares every block; the first write into the partly filled last one copies
    it, and the parent's copy is left as it was."""
    kv = _cache()
    arena = kv.arena
    parent = _seq(1, list(range(20)))
    _run(kv, parent)
    arena.pools["main"].k[1][arena.tables[1].blocks["main"][1], 0, 3] = 5.0
    arena.fork(1, 2)
    last = arena.tables[1].blocks["main"][1]
    assert arena.tables[2].blocks["main"] == arena.tables[1].blocks["main"]
    arena.reserve(2, "main", 20, 1)
    copy = arena.tables[2].blocks["main"][1]
    assert copy != last and arena.copies == 1
    assert arena.tables[2].blocks["main"][0] == arena.tables[1].blocks["main"][0]
    assert float(arena.pools["main"].k[1][copy, 0, 3, 0]) == 5.0  # the copy has the data
    arena.pools["main"].k[1][copy, 0, 4] = 9.0
    assert float(arena.pools["main"].k[1][last, 0, 4, 0]) == 0.0  # the parent's is untouched


def test_a_registered_block_is_never_rewritten_in_place():
    """A sequence rewriting a position of a block it alone holds but registered (a draft
    re-reading its last token) writes into a copy: the cached prefix stays as it was."""
    kv = _cache()
    _run(kv, _seq(1, list(range(40))))
    arena, pool = kv.arena, kv.arena.main.blocks
    block = arena.tables[1].blocks["main"][1]
    arena.pools["main"].k[0][block, 0, 15] = 2.0
    arena.reserve(1, "main", 31, 1)
    arena.pools["main"].k[0][arena.tables[1].blocks["main"][1], 0, 15] = 5.0
    assert arena.tables[1].blocks["main"][1] != block and block in pool.key_of
    assert float(arena.pools["main"].k[0][block, 0, 15, 0]) == 2.0
    assert kv.prefix.find(list(range(40)), []).positions["main"] == 32


def test_window_group_drops_unreachable_blocks_and_finds_only_what_it_reads():
    """Layer 1 attends to its last 20 positions: its group keeps the blocks a window can
    still read, and a prefix is found only where those are cached."""
    kv = _cache(blocks=12, windows=(0, 20), max_seq_len=128)
    arena = kv.arena
    assert [g.name for g in arena.layout.groups] == ["main", "main@20"]
    seq = _seq(1, list(range(90)))
    _run(kv, seq, final=80)
    window = arena.tables[1].blocks["main@20"]
    # final 80: the query at 79 reads 60..79; blocks 0-2 (positions 0-47) are dropped
    assert window[:3] == [NO_BLOCK] * 3 and NO_BLOCK not in window[3:]
    assert arena.groups["main@20"].blocks.held == len(window) - 3
    assert NO_BLOCK not in arena.tables[1].blocks["main"]
    kv.release(seq)
    again = _seq(2, list(range(90)))  # 5 full blocks cached in both groups: found whole
    assert kv.admit(again) and again.cached_tokens == 80
    assert arena.tables[2].blocks["main@20"][:3] == [NO_BLOCK] * 3
    kv.release(again)
    # the window group loses a block it would read at 80 (evicted): only a shorter prefix
    pool = arena.groups["main@20"].blocks
    keys: list[bytes] = []
    extend_keys(keys, list(range(90)), 5, BS)
    pool.forget(pool.block_of[keys[4]])
    shorter = _seq(3, list(range(90)))
    assert kv.admit(shorter) and shorter.cached_tokens == 64
    # ...and one it would not read any more is not needed
    kv.release(shorter)
    pool.forget(pool.block_of[keys[0]])
    assert kv.prefix.find(list(range(90)), []).positions["main"] == 64


def test_admission_counts_a_shared_prefix_once():
    """16 users of one 48-token prompt: its 3 blocks are held once, each user reserves only
    its own; without the prefix they would not all fit."""
    prompt = list(range(49))
    kv = _cache(blocks=22, max_seq_len=64, in_flight=1)
    _run(kv, _seq(0, prompt))
    users = [_seq(i, prompt + [i], max_tokens=8) for i in range(1, 17)]
    assert all(kv.admit(u) for u in users)
    held = kv.arena.main.blocks.held
    assert held == 4  # the first's 4 blocks; the users have written nothing yet
    assert all(u.cached_tokens == 48 for u in users)
    assert not kv.admit(_seq(99, list(range(200, 249)), max_tokens=8))  # full: refused
    uncached = _cache(blocks=22, max_seq_len=64, in_flight=1)
    admitted = sum(uncached.admit(_seq(i, prompt + [i], 8, cache=False)) for i in range(16))
    assert admitted < 16


def test_opt_out_neither_finds_nor_caches():
    kv = _cache()
    _run(kv, _seq(1, list(range(40)), cache=False))
    assert kv.arena.main.blocks.cached == 0
    _run(kv, _seq(2, list(range(40))))
    private = _seq(3, list(range(40)), cache=False)
    assert kv.admit(private) and private.cached_tokens == 0


def test_cache_health_repairs_shared_and_cached_blocks():
    """Defragmenting moves a block several tables hold, and a cached one nobody holds: every
    table and the prefix cache follow it, and the data moves with it."""
    from dspark.runtime.bundle.config import CacheHealthConfig
    from dspark.runtime.dflash.che import CacheHealth

    kv = _cache(blocks=12, max_seq_len=64, in_flight=1)
    arena, pool = kv.arena, kv.arena.main.blocks
    filler = _seq(9, list(range(500, 560)))
    _run(kv, filler)  # blocks 0-3, released below: a hole at the bottom
    shared = _seq(1, list(range(40)))
    _run(kv, shared)  # blocks 4-6; 4 and 5 registered
    arena.pools["main"].k[0][arena.tables[1].blocks["main"][0], 0, 0] = 3.0
    reader = _seq(2, list(range(40)))
    assert kv.admit(reader)  # holds 4 and 5 too
    kv.release(filler)
    for b in range(4):  # the filler's prefix and its last block: forgotten, free holes
        pool.forget(b)
    before = arena.tables[1].blocks["main"][:2]
    che = CacheHealth(arena, CacheHealthConfig(vfi_max=0.01))
    assert che.defragment() > 0
    after = arena.tables[1].blocks["main"][:2]
    assert after != before and arena.tables[2].blocks["main"] == after
    assert float(arena.pools["main"].k[0][after[0], 0, 0, 0]) == 3.0
    assert all(pool.refs[b] == 2 for b in after)
    found = kv.prefix.find(list(range(40)), [])
    assert found.blocks["main"] == after
