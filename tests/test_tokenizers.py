"""Tokenizer alignment: ds-tokenizer-check, dsc compile's gate, and a mapped draft that stays
lossless while its acceptance rises."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from dspark.compiler.reference import OriginalModel
from dspark.runtime.bundle.bundle import open_bundle
from dspark.runtime.bundle.token_map import TokenMap
from dspark.runtime.engine.engine import Engine
from dspark.runtime.sequence.request import GenerationRequest
from dspark.runtime.sequence.sampling import SamplingParams

from bundle_cache import compiled
from cli_helpers import run_dsc
from model_fixtures import EMOJI, SHIFT, build_mapped_pair

SEED_STRING = "🛒 Add to cart"


@pytest.fixture(scope="module")
def mapped():
    from conftest import BUILD

    return build_mapped_pair(BUILD)


def _check(*args) -> subprocess.CompletedProcess:
    exe = os.path.join(os.path.dirname(sys.executable), "ds-tokenizer-check")
    return subprocess.run([exe, *map(str, args)], capture_output=True, text=True)


def test_check_reports_the_seeds_emoji(mapped, tmp_path):
    r = _check("--draft-model", mapped["draft_tok"], "--main-model", mapped["main_tok"],
               "--test-string", SEED_STRING, "--write-mapping", tmp_path / "map.json")
    assert r.returncode == 1, r.stderr
    assert f'"{SEED_STRING}"' in r.stdout and "first divergence at token 0" in r.stdout
    assert f">>{EMOJI}<< | Add | to | cart" in r.stdout and "aligned: NO" in r.stdout
    m = TokenMap.load(tmp_path / "map.json")
    assert m.draft_to_main[(7 + SHIFT) % 320] == 7  # a shifted word maps back
    # only the emoji's four byte tokens have no main token
    assert int((m.draft_to_main == -1).sum()) == 4
    r = _check("--draft-model", mapped["draft_tok"], "--main-model", mapped["main_tok"],
               "--json")
    report = json.loads(r.stdout)
    assert not report["aligned"] and report["differing_ids"] > 0
    seg = next(s for s in report["segmentations"] if s["text"] == SEED_STRING)
    assert seg["main"] == [EMOJI, "Add", "to", "cart"] and len(seg["draft"]) == 7


def test_check_passes_aligned_and_refuses_usage(mapped, tmp_path):
    r = _check("--draft-model", mapped["main_tok"] / "tokenizer.json",
               "--main-model", mapped["main_tok"])
    assert r.returncode == 0 and "aligned: yes" in r.stdout
    r = _check("--draft-model", tmp_path / "nope", "--main-model", mapped["main_tok"])
    assert r.returncode == 2 and r.stderr.startswith("ds-tokenizer-check: error: --draft-model")
    r = _check("--main-model", mapped["main_tok"])
    assert r.returncode == 2 and "--draft-model" in r.stderr


def _compile(capsys, mapped, out, *flags):
    return run_dsc(capsys, "compile", mapped["main"], mapped["draft"], "-o", out, *flags)


def test_compile_refuses_different_tokenizers_without_a_map(capsys, mapped, tmp_path):
    r = _compile(capsys, mapped, tmp_path / "b.dsmodel")
    assert r.code == 2 and "differs from the main one" in r.err and "ds-tokenizer-check" in r.err
    assert not (tmp_path / "b.dsmodel").exists()
    r = _compile(capsys, mapped, tmp_path / "b.dsmodel", "--auto-token-map")
    assert r.code == 0, r.err
    assert (tmp_path / "b.dsmodel" / "token_map.json").is_file()
    assert open_bundle(tmp_path / "b.dsmodel").token_map is not None


def _acceptance_and_check(bundle, main_path, prompts):
    original = OriginalModel(main_path)
    engine = Engine(open_bundle(bundle), "fixed", 4)
    seqs = engine.generate([GenerationRequest(tuple(p), 40, method="draft") for p in prompts])
    for p, seq in zip(prompts, seqs):
        assert seq.generated == original.greedy(p, 40)  # lossless either way
    return sum(s.stats.accepted_tokens for s in seqs) / sum(s.stats.draft_tokens for s in seqs)


@pytest.mark.slow
def test_mapping_raises_acceptance_and_stays_lossless(capsys, mapped, tmp_path):
    """The seed's case: "🛒 Add to cart" prompts, and plain-word prompts, through a bundle that
    ignores the tokenizer difference (identity map) and one with the draft->main map."""
    emoji, add, to, cart = 305, 306, 307, 308
    rng = np.random.default_rng(4)
    emoji_prompts = [[emoji, add, to, cart, *map(int, rng.integers(0, 300, n))]
                     for n in (2, 5, 9, 14)]
    word_prompts = [[add, to, cart, *map(int, rng.integers(0, 300, n))] for n in (3, 8)]
    identity = TokenMap(np.arange(320), 320)  # ignoring the difference, as in the seed
    identity.save(tmp_path / "identity.json")
    _compile(capsys, mapped, tmp_path / "before.dsmodel", "--token-map",
             tmp_path / "identity.json")
    _compile(capsys, mapped, tmp_path / "after.dsmodel", "--auto-token-map")
    # control: the same map without the emoji's spelling, so the draft reads its fallback
    # token where the main has the emoji
    spelled = open_bundle(tmp_path / "after.dsmodel").token_map
    assert len(spelled.pieces(emoji)) == 4
    unspelled = {m: p for m, p in spelled.expand.items() if m != emoji}
    TokenMap(spelled.draft_to_main, 320, spelled.fallback, unspelled).save(
        tmp_path / "unspelled.json")
    _compile(capsys, mapped, tmp_path / "unspelled.dsmodel", "--token-map",
             tmp_path / "unspelled.json")
    runs = ("before", "unspelled", "after")
    rates = {(name, which): _acceptance_and_check(tmp_path / f"{which}.dsmodel",
                                                  mapped["main"], prompts)
             for name, prompts in (("emoji", emoji_prompts), ("words", word_prompts))
             for which in runs}
    print("acceptance without the map / map without the emoji's spelling / full map: "
          + ", ".join(f"{n} prompts " + " / ".join(f"{rates[(n, w)]:.2f}" for w in runs)
                      for n in ("emoji", "words")))
    # with the map the draft reads the main's emoji as its own four byte tokens, whose
    # embeddings the fixture distilled (a byte-level draft's are trained); its positions then
    # run 3 ahead of the main's, so it agrees less after an emoji than on plain words. How
    # much the spelling adds over the fallback token depends on that distillation, which
    # trains to a different point on each CPU (top-1 agreement after the emoji 0.22 on an
    # AVX2 EPYC, where the spelled and unspelled maps measured 0.12 alike): the map must
    # help, the spelling never hurt.
    assert rates[("words", "after")] > 0.9 > 0.1 > rates[("words", "before")]
    assert rates[("emoji", "after")] > rates[("emoji", "before")] + 0.05
    assert rates[("emoji", "after")] >= rates[("emoji", "unspelled")]


def test_mapped_sampling_runs_and_restricted_q_is_a_distribution(capsys, mapped, tmp_path):
    _compile(capsys, mapped, tmp_path / "b.dsmodel", "--auto-token-map")
    bundle = open_bundle(tmp_path / "b.dsmodel")
    q = np.random.default_rng(0).dirichlet(np.ones(320))
    main_q, mass = bundle.token_map.main_probabilities(q)
    assert main_q.sum() == pytest.approx(1.0) and 0 < mass < 1
    assert main_q[7] == pytest.approx(q[(7 + SHIFT) % 320] / mass)
    engine = Engine(bundle, "fixed", 4)
    [seq] = engine.generate([GenerationRequest((305, 306, 307), 24,
                                               SamplingParams(temperature=0.8, seed=1),
                                               method="draft")])
    assert len(seq.generated) == 24 and seq.stats.draft_tokens > 0


def test_draft_reads_the_emoji_as_its_own_byte_tokens(mapped, tmp_path):
    from dspark.compiler.tokenizer.check import load, token_map

    m = token_map(load(mapped["draft_tok"], "d"), load(mapped["main_tok"], "m"))
    emoji_pieces = m.pieces(305)
    assert len(emoji_pieces) == 4 and all(m.draft_to_main[d] == -1 for d in emoji_pieces)
    assert m.to_draft([306, 305, 307]) == [(306 + SHIFT) % 320, *emoji_pieces,
                                           (307 + SHIFT) % 320]
    m.save(tmp_path / "m.json")
    assert TokenMap.load(tmp_path / "m.json", 320, 320).pieces(305) == emoji_pieces


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_mapped_draft_at_the_exact_length_limit_in_a_small_arena(mapped, tmp_path, sampled):
    """Emoji prompts expand to four draft tokens each, so the mapped draft's positions run
    ahead of the main's; generating to exactly max_seq_len, batched in an arena that holds
    only a few sequences, the draft must stop at each sequence's reservation (the stall is
    counted) while the output stays the original model's and every block comes back."""
    from dspark.compiler.compile import CompileOptions

    out = tmp_path / "small.dsmodel"
    compiled(CompileOptions(mapped["main"], mapped["draft"], out, auto_token_map=True,
                            max_seq_len=48, kv_budget_mb=0.2))
    bundle = open_bundle(out)
    emoji = 305
    rng = np.random.default_rng(11)
    prompts = [[emoji, 306, emoji, 307, emoji, *map(int, rng.integers(0, 300, n))]
               for n in (1, 4, 9, 16, 23)]
    params = SamplingParams(temperature=0.8, seed=3) if sampled else SamplingParams(0.0)
    engine = Engine(bundle, "fixed", 4, max_batch=5)
    assert engine.plan.num_blocks * engine.plan.block_size < 5 * 48  # not all at once
    seqs = engine.generate([GenerationRequest(tuple(p), 48 - len(p), params, method="draft")
                            for p in prompts])
    original = OriginalModel(mapped["main"])
    for p, seq in zip(prompts, seqs):
        assert len(seq.generated) == 48 - len(p) and seq.finish_reason == "length"
        if not sampled:
            assert seq.generated == original.greedy(p, 48 - len(p))
    assert engine.drafting.model.room_stalls > 0
    assert sum(s.stats.accepted_tokens for s in seqs) > 0
    assert engine.arena.free_blocks == engine.plan.num_blocks and not engine.scheduler.running
