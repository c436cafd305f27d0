"""Automatic prefix caching (runtime/cache/prefix_cache.py) in the engine, on the fixture
models: output with the cache is output without it, token for token (plain, draft model,
lookup, hybrid, batched, across sliding windows), a shared prompt is held once, nothing is
lost under eviction pressure, sampled output keeps the main model's distribution, grammars,
mapped drafts, window groups and n choices over a cached prompt. The cache's mechanism on
synthetic geometry: tests/test_prefix_cache.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from dspark.runtime.bundle.bundle import open_bundle
from dspark.runtime.cache import prefix_cache
from dspark.runtime.engine.engine import Engine
from dspark.runtime.sequence.request import GenerationRequest, Sequence
from dspark.runtime.sequence.sampling import SamplingParams

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
