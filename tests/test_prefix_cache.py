"""Automatic prefix caching (runtime/cache/prefix_cache.py) over the paged arena.

The parts on synthetic geometry: keys, registering and finding, holding and eviction,
copy on write, window groups, admission. Then the engine on the fixture models: output with
the cache is output without it, token for token (plain, draft model, lookup, hybrid,
batched, across sliding windows), a shared prompt is held once, nothing is lost under
eviction pressure, and sampled output keeps the main model's distribution.
"""

from __future__ import annotations

import numpy as np
import pytest

from dspark.runtime.bundle.bundle import open_bundle
from dspark.runtime.bundle.spec import ModelSpec, VerifyOp
from dspark.runtime.cache import prefix_cache
from dspark.runtime.cache.kv_arena import NO_BLOCK, KVArena
from dspark.runtime.cache.layout import arena_layout
from dspark.runtime.cache.manager import KVCache
from dspark.runtime.cache.prefix_cache import PrefixCache, extend_keys
from dspark.runtime.engine.engine import Engine
from dspark.runtime.sequence.request import GenerationRequest, Sequence
from dspark.runtime.sequence.sampling import SamplingParams

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


# -- the engine on the fixture models ------------------------------------------------------

SYSTEM = [int(t) for t in np.random.default_rng(11).integers(3, 300, 45)]


def _conversations(count: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [SYSTEM + [int(t) for t in rng.integers(3, 300, int(rng.integers(2, 12)))]
            for _ in range(count)]


def _engine(path, method: str, cache: bool, **kw) -> Engine:
    return Engine(open_bundle(path), "fixed", 4, max_batch=8, prefix_cache=cache, **kw)


def _generate(engine: Engine, prompts, method: str, max_tokens: int = 12,
              params: SamplingParams | None = None) -> list[Sequence]:
    return engine.generate([GenerationRequest(
        tuple(p), max_tokens, params or SamplingParams(), speculative=method != "plain",
        method=None if method == "plain" else method) for p in prompts])


@pytest.mark.parametrize("method", ["plain", "draft", "lookup", "hybrid"])
@pytest.mark.parametrize("arch", ["llama", "gemma3", "mistral"])
def test_cached_prefixes_give_the_uncached_greedy_tokens(compiled, arch, method):
    """A shared system prompt, then second turns (prompt + reply + a new message), batched:
    the tokens equal a run without the cache, and the cache was used (gemma3 and mistral
    have windows of 8 positions, well inside these prompts)."""
    path = compiled[(arch, "classic")]
    outs = {}
    for cache in (False, True):
        engine = _engine(path, method, cache)
        first = _generate(engine, _conversations(4, 0), method)
        turns = [s.tokens + [5, 6, 7] for s in first]
        second = _generate(engine, turns + _conversations(3, 1), method)
        outs[cache] = [s.generated for s in first + second]
        hits = [s.cached_tokens for s in first + second]
        assert (max(hits) > 0) == cache
        if cache:  # a second turn finds its whole first turn (but the last block)
            assert all(h >= len(t) - 2 * 16 for h, t in zip(hits[4:8], turns))
    assert outs[True] == outs[False]


def test_sixteen_users_hold_one_copy_of_a_shared_prompt(compiled):
    """16 requests with one 45-token system prompt, after a first one: the arena holds the
    prompt's blocks once (each user's own blocks are its question and answer)."""
    path = compiled[("llama", "classic")]
    engine = Engine(open_bundle(path), "fixed", 4, max_batch=16)
    _generate(engine, [SYSTEM + [9]], "plain", 4)
    prompts = _conversations(16, 2)
    for p in prompts:
        engine.submit(GenerationRequest(tuple(p), 8))
    engine.step()  # all admitted, each prompt's rest fed
    pool = engine.arena.main.blocks
    tables = [engine.arena.tables[s.id].blocks["main"] for s in engine.scheduler.running]
    assert len(tables) == 16
    shared = set(tables[0][:2])
    assert all(set(t[:2]) == shared for t in tables)  # 2 full blocks of the 45 tokens
    assert all(pool.refs[b] == 16 for b in shared)
    assert pool.held == 2 + sum(len(t) - 2 for t in tables)
    while engine.busy:
        engine.step()


def test_nothing_is_lost_under_eviction_pressure(compiled):
    """20 conversations of 3 turns take turns on an arena that holds about 3 at once: every
    turn's tokens equal an uncached engine's, blocks were evicted and prefixes still hit."""
    path = compiled[("llama", "classic")]
    bundle = open_bundle(path)
    probe = Engine(bundle, "fixed", 4, max_batch=3, max_seq_len=128)
    cached = Engine(bundle, "fixed", 4, max_batch=3, max_seq_len=128,
                    kv_budget=3 * probe.plan.bytes_per_seq)
    assert cached.plan.max_seqs == 3
    plain = Engine(bundle, "fixed", 4, max_batch=3, prefix_cache=False)
    rng = np.random.default_rng(5)
    chats = [[int(t) for t in rng.integers(3, 300, 20)] for _ in range(20)]
    for _turn in range(3):
        order = rng.permutation(20)
        for start in range(0, 20, 5):
            group = [chats[i] for i in order[start:start + 5]]
            got = _generate(cached, group, "draft", 8)
            want = _generate(plain, group, "draft", 8)
            assert [s.generated for s in got] == [s.generated for s in want]
            for i, s in zip(order[start:start + 5], got):
                chats[i] = s.tokens + [int(t) for t in rng.integers(3, 300, 3)]
    pool = cached.arena.main.blocks
    assert pool.evictions > 0 and cached.kv.prefix.hit > 0
    assert pool.held == 0 and pool.available == pool.num_blocks


def _first_tokens(engine: Engine, prompt: list[int], samples: int) -> np.ndarray:
    params = [SamplingParams(1.0, seed=i) for i in range(samples)]
    seqs = engine.generate([GenerationRequest(tuple(prompt), 2, p, method="draft")
                            for p in params])
    assert all(s.cached_tokens >= 32 for s in seqs)
    return np.array([s.generated[0] for s in seqs])


def test_sampled_tokens_keep_the_distribution_with_a_cached_prefix(compiled, fixture_pairs,
                                                                  monkeypatch):
    """First tokens sampled over a cached prefix follow the original model's softmax at the
    prompt's end (chi-square); with the keys broken so that another prompt's blocks are
    found, they do not."""
    from dspark.compiler.reference import OriginalModel
    from dspark.runtime.sequence.sampling import probabilities

    from chi_square import chi_square

    main, _ = fixture_pairs[("llama", "classic")]
    original = OriginalModel(main)
    prompt = SYSTEM[:40]
    logits, _ = original.forward(prompt, original.empty_past())
    p = probabilities(logits[-1], SamplingParams(1.0))
    engine = Engine(open_bundle(compiled[("llama", "classic")]), "fixed", 3, max_batch=256)
    _generate(engine, [prompt], "plain", 1)
    pvalue = chi_square(_first_tokens(engine, prompt, 1500), p)
    assert pvalue > 1e-3, pvalue
    broken = Engine(open_bundle(compiled[("llama", "classic")]), "fixed", 3, max_batch=256)
    _generate(broken, [list(range(100, 140))], "plain", 1)  # another prompt's blocks ...
    real = prefix_cache.extend_keys

    def ignore_tokens(keys, tokens, blocks, block_size):  # ... found under any tokens
        real(keys, list(range(100, 140)), blocks, block_size)
    monkeypatch.setattr(prefix_cache, "extend_keys", ignore_tokens)
    assert chi_square(_first_tokens(broken, prompt, 1500), p) < 1e-6


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


def test_a_grammar_over_a_cached_prompt_gives_the_uncached_output(json_bundle):
    """The grammar's state is the request's own: a constrained request whose prompt is
    cached writes what it writes without the cache, and the JSON is valid."""
    import json

    from dspark.runtime.bundle.tokenizer import load_tokenizer
    from dspark.runtime.grammar.constraint import GrammarBook
    from dspark.runtime.grammar.formats import schema_grammar

    bundle = open_bundle(json_bundle)
    tokenizer = load_tokenizer(bundle.tokenizer_dir)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    prompt = tuple(SYSTEM[:40])
    outs = {}
    for cache in (False, True):
        engine = Engine(bundle, "fixed", 4, eos_ids=tuple(tokenizer.eos_ids),
                        decode=tokenizer.decode, grammars=GrammarBook.of(bundle, tokenizer),
                        prefix_cache=cache)
        runs = [engine.generate([GenerationRequest(prompt, 60, grammar=schema_grammar(
            schema, "schema"), method=method)])[0] for method in ("draft", "hybrid")]
        assert (runs[1].cached_tokens > 0) == cache
        outs[cache] = [s.generated for s in runs]
        assert all(json.loads(tokenizer.decode(s.generated))["n"] >= 0 for s in runs)
    assert outs[True] == outs[False]


def test_a_mapped_draft_is_not_cached_and_output_is_unchanged(tmp_path):
    """A draft with a token map keeps its own positions: the main's prefix is found, the
    draft reads the prompt again (nothing of its own is cached), and the output is the
    original's greedy tokens either way."""
    from conftest import BUILD

    from dspark.compiler.compile import CompileOptions
    from dspark.compiler.reference import OriginalModel

    from bundle_cache import compiled as compile_bundle
    from model_fixtures import build_mapped_pair

    mapped = build_mapped_pair(BUILD)
    out = tmp_path / "mapped.dsmodel"
    compile_bundle(CompileOptions(mapped["main"], mapped["draft"], out, auto_token_map=True,
                                  max_seq_len=256, kv_budget_mb=8))
    engine = Engine(open_bundle(out), "fixed", 4)
    assert engine.kv.prefix.roles == ("main",)
    prompt = (305, 306, 305, 307, *SYSTEM[:36])
    first, second = (engine.generate([GenerationRequest(prompt, 20, method="draft")])[0]
                     for _ in range(2))
    assert first.cached_tokens == 0 and second.cached_tokens >= 32
    want = OriginalModel(mapped["main"]).greedy(list(prompt), 20)
    assert first.generated == want and second.generated == want
    assert second.stats.accepted_tokens > 0


def test_window_groups_hold_a_windows_worth_through_a_long_prompt(compiled, fixture_pairs):
    """An arena sized for one sequence whose sliding-window layers keep only what their
    window (8) reads: a 230-token prompt fed 16 tokens a step, then 20 more tokens, fits
    (the window group drops blocks as the prefill goes) and gives the original's tokens."""
    from dspark.compiler.reference import OriginalModel

    path = compiled[("gemma3", "classic")]
    bundle = open_bundle(path)
    probe = Engine(bundle, "fixed", 4, max_seq_len=256, prefill_tokens=16)
    engine = Engine(bundle, "fixed", 4, max_batch=1, max_seq_len=256, prefill_tokens=16,
                    kv_budget=probe.plan.bytes_per_seq)
    window = next(g for g in engine.arena.layout.groups if g.window)
    assert window.num_blocks < 256 // 16  # fewer blocks than the sequence's positions
    prompt = [int(t) for t in np.random.default_rng(4).integers(3, 300, 230)]
    [seq] = engine.generate([GenerationRequest(tuple(prompt), 20, method="draft")])
    main = fixture_pairs[("gemma3", "classic")][0]
    assert seq.generated == OriginalModel(main).greedy(prompt, 20)


def test_n_choices_compute_their_prompt_once(compiled):
    """Four choices of one prompt: the first computes it, the others wait for it and find
    it cached (all but its last partly filled block, which the first is still writing),
    each sampling its own output with its own seed."""
    engine = Engine(open_bundle(compiled[("llama", "classic")]), "fixed", 4, max_batch=8)
    prompt = tuple(SYSTEM)
    seqs = engine.submit_group([GenerationRequest(prompt, 10, SamplingParams(1.0, seed=s))
                                for s in range(4)])
    while engine.busy:
        engine.step()
    assert seqs[0].cached_tokens == 0
    assert all(s.cached_tokens == 32 for s in seqs[1:])  # 45 tokens: 2 full blocks
    assert len({tuple(s.generated) for s in seqs}) > 1
    assert engine.kv.prefix.hit == 3 * 32
