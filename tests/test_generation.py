"""Lossless: greedy output with speculation equals plain greedy and the original model's loop.

A batch of 8 prompts of mixed lengths runs together, 64 new tokens, at windows 1, 4 and 8,
under the dflash and goodput policies, with prompts fed in small chunks, drafting with the
draft model, the lookup (window 8) and the hybrid of both, on every fixture pair (both
export forms) and on the real SmolLM2 pair.
"""

from __future__ import annotations

import numpy as np
import pytest
from lossless import first_fork

from dspark.compiler.reference import OriginalModel
from dspark.runtime.bundle.bundle import open_bundle
from dspark.runtime.bundle.config import (
    DFlashConfig,
    ResourceConfig,
    ResourceRow,
    VerifyBalanceConfig,
)
from dspark.runtime.bundle.tokenizer import BundleTokenizer
from dspark.runtime.engine.engine import Engine
from dspark.runtime.sequence.request import GenerationRequest
from dspark.runtime.sequence.stats import SourceStats

from model_fixtures import PAIRS

LENGTHS = (1, 3, 5, 8, 13, 21, 34, 55)
# no RAS cap, and speculation at every batch size (VLB would turn it off under load)
WIDE = DFlashConfig(resources=ResourceConfig(table=(ResourceRow("cpu", 8),)),
                    verify_balance=VerifyBalanceConfig(batch_cap=False, batch_modes=False,
                                                       plain_prompt_steps=False))
MAX_FORKS = 1  # forgiven near-tie forks per setting (none seen on the fixtures or SmolLM2)
# (policy, window, speculative, prefill tokens per step, drafting method)
SETTINGS = [("fixed", 1, False, 256, "draft"), ("fixed", 1, True, 256, "draft"),
            ("fixed", 4, True, 16, "draft"), ("fixed", 8, True, 256, "draft"),
            ("dflash", None, True, 256, "draft"), ("goodput", None, True, 32, "draft"),
            ("fixed", 8, True, 256, "lookup"), ("dflash", None, True, 16, "hybrid"),
            ("goodput", None, True, 256, "hybrid")]
# SmolLM2 (~5 s a setting): every drafting method and policy, without the window-1 and plain
# settings and the goodput-draft one, which the fixtures cover and which add no path here
SMOLLM2_SETTINGS = [s for s in SETTINGS if s[1] != 1 and s[:2] != ("goodput", None)
                    or s[4] == "hybrid"]


def _check_lossless(bundle_path, main_path, prompts, eos=frozenset(), max_tokens=64,
                    settings=tuple(SETTINGS)):
    bundle = open_bundle(bundle_path)
    original = OriginalModel(main_path)
    refs = [original.greedy(p, max_tokens) for p in prompts]
    report = []
    for policy, window, spec, chunk, method in settings:
        engine = Engine(bundle, policy, window, max_batch=8, eos_ids=tuple(eos),
                        prefill_tokens=chunk, config=WIDE)
        seqs = engine.generate([GenerationRequest(tuple(p), max_tokens, speculative=spec,
                                                  method=method) for p in prompts])
        forks = [f for p, seq, ref in zip(prompts, seqs, refs)
                 if (f := first_fork(seq.generated, ref, p, original, set(eos), seq.finish_reason))]
        # a near-tie fork is forgiven once per setting: batched sums differ from the
        # reference's by ~1e-6, so more than one in a batch points at a real difference
        assert len(forks) <= MAX_FORKS, (policy, window, method, forks)
        report += [f"{policy} window {window} spec {spec}: {f}" for f in forks]
        assert engine.arena.free_blocks == engine.plan.num_blocks  # every block came back
        if spec:
            assert sum(s.stats.draft_tokens for s in seqs) > 0
        if spec and method != "draft":  # the lookup proposed and was verified
            assert sum(s.stats.sources.get("lookup", SourceStats()).drafted for s in seqs) > 0
    print("\n".join(report) or "no forks")
    return report


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: "-".join(p))
def test_greedy_lossless_on_fixtures(fixture_pairs, compiled, pair):
    rng = np.random.default_rng(7)
    prompts = [[int(t) for t in rng.integers(0, 320, n)] for n in LENGTHS]
    _check_lossless(compiled[pair], fixture_pairs[pair][0], prompts)


def test_speculation_accepts_when_draft_is_main(self_bundle):
    """Draft == main: every draft token is accepted, the bonus path runs every round."""
    out, main = self_bundle
    want = OriginalModel(main).greedy([5, 6, 7], 41)
    engine = Engine(open_bundle(out), "fixed", 4)
    engine.balancer.config = VerifyBalanceConfig(steady_tokens_low=8, steady_tokens_mid=8)
    [seq] = engine.generate([GenerationRequest((5, 6, 7), 41, method="draft")])
    # round 1 is the prefill; then 8 rounds of 4 accepted drafts + the bonus token
    assert seq.generated == want
    assert seq.stats.rounds == 8 and seq.stats.accepted_tokens == seq.stats.draft_tokens == 32
    # VLB admitting 1 + 2 per round: the 4th draft is held, and it equals the bonus token
    engine.balancer.config = VerifyBalanceConfig(steady_tokens_low=2, steady_tokens_mid=1)
    [seq] = engine.generate([GenerationRequest((5, 6, 7), 41, method="draft")])
    assert seq.generated == want
    assert seq.stats.rounds == 10 and seq.stats.accepted_tokens == seq.stats.draft_tokens == 30


def test_eos_inside_an_accepted_draft_run(self_bundle):
    """EOS as the 4th token of a round of 8 accepted drafts + the bonus: generation stops
    right there (EOS not emitted, finish "stop"), equal to the reference up to it, with the
    drafts after it dropped and every cache block back."""
    out, main = self_bundle
    want = OriginalModel(main).greedy([5, 6, 7], 60)
    # round 1 (the prompt) gives want[0]; each later round 9 tokens: 8 drafts and a bonus
    j = next((i for i in range(10, 60) if (i - 1) % 9 == 3 and want[i] not in want[:i]), None)
    assert j is not None, "no token first seen mid-round in the reference"
    bundle = open_bundle(out)
    engine = Engine(bundle, "fixed", 8, eos_ids=(want[j],), config=WIDE)
    engine.balancer.config = VerifyBalanceConfig(steady_tokens_low=8, steady_tokens_mid=8,
                                                 batch_cap=False)
    [seq] = engine.generate([GenerationRequest((5, 6, 7), 60, method="draft")])
    assert seq.generated == want[:j] and seq.finish_reason == "stop"
    # the EOS round verified all 8 drafts (EOS the 4th): the output was cut inside the run
    rounds = (j - 1) // 9 + 1
    assert seq.stats.draft_tokens == seq.stats.accepted_tokens == 8 * rounds
    assert engine.arena.free_blocks == engine.plan.num_blocks


def test_cancel_while_waiting_mid_prefill_and_mid_draft(fixture_pairs, compiled):
    """Engine.cancel in each phase: a waiting sequence never runs, a half-read prompt and a
    drafting sequence stop where they are, the sequence beside them finishes exactly as the
    reference, and every block, reservation and draft state comes back."""
    pair = ("llama", "classic")
    bundle = open_bundle(compiled[pair])
    engine = Engine(bundle, "fixed", 4, max_batch=3, prefill_tokens=8, config=WIDE)
    keeper = engine.submit(GenerationRequest((5, 6, 7), 30, method="draft"))
    prefill = engine.submit(GenerationRequest(tuple(range(1, 120)), 30, method="draft"))
    drafting = engine.submit(GenerationRequest((9, 8, 7), 40, method="draft"))
    waiting = engine.submit(GenerationRequest((4, 4, 4), 30, method="draft"))
    engine.step()
    engine.step()
    assert 0 < prefill.main_cached < prefill.prompt_len and not prefill.generated
    assert waiting.id not in engine.arena.tables  # max_batch 3: still queued
    engine.cancel(prefill)
    engine.cancel(waiting)
    while drafting.stats.rounds < 3:
        engine.step()
    assert len(engine.drafting.state(drafting)) or drafting.stats.draft_tokens
    engine.cancel(drafting)
    cut = list(drafting.generated)
    while engine.busy:
        engine.step()
    assert keeper.generated == OriginalModel(fixture_pairs[pair][0]).greedy([5, 6, 7], 30)
    assert drafting.generated == cut and 0 < len(cut) < 40
    assert not prefill.generated and not waiting.generated
    for seq in (prefill, waiting, drafting):
        assert seq.finish_reason == "cancelled"
        assert seq.id not in engine.arena.tables and seq.id not in engine.drafting.states
    assert engine.arena.free_blocks == engine.plan.num_blocks and not engine.scheduler.running


@pytest.mark.slow
def test_greedy_lossless_on_smollm2(smollm2_pair, smollm2_bundle):
    from dspark.runtime.sequence.prompt import entry_ids, load_prompts

    tokenizer = BundleTokenizer(smollm2_bundle / "tokenizer")
    prompts = [entry_ids(tokenizer, p) for p in load_prompts(None)]
    assert len({len(p) for p in prompts}) > 4  # mixed lengths
    _check_lossless(smollm2_bundle, smollm2_pair / "main.onnx", prompts, tokenizer.eos_ids,
                    settings=SMOLLM2_SETTINGS)
