"""The hybrid drafter's choice of source: when a draft model, a lookup or nothing pays, its
re-tries, pending drafts kept as far as they pay, and the lookup's back-off (fake costs
stand in for measured ones)."""

from __future__ import annotations

import math

import pytest

from dspark.runtime.bundle.config import DraftingConfig, LookupConfig
from dspark.runtime.dflash.source import (
    MARGIN,
    POSITION_WEIGHT,
    PRIOR_ACCEPT,
    PRIOR_WEIGHT,
    SourceChooser,
)
from dspark.runtime.drafting.hybrid import HybridDrafter
from dspark.runtime.drafting.lookup import LookupDrafter
from dspark.runtime.engine.decide import drafts
from dspark.runtime.engine.round_plan import Slot
from dspark.runtime.model.costs import DRAFT_STEP, CostModel
from dspark.runtime.sequence.request import GenerationRequest, Sequence


def _seq(ids, seq_id=1, tenant="default", max_tokens=64):
    return Sequence(seq_id, GenerationRequest(tuple(ids), max_tokens, tenant=tenant))


def _costs(main_ms=(30, 32, 34, 36, 38, 40, 42, 44, 46), draft_ms=15.0) -> CostModel:
    costs = CostModel()
    for n, ms in enumerate(main_ms, 1):
        costs.table["main"][n] = ms / 1000
    for n in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        costs.table["draft"][n] = (draft_ms + 2.5 * (n - 1)) / 1000
    return costs


class FakeModel:
    """Stands in for the draft-model drafter: records what it was asked to draft."""

    def __init__(self, cached=0):
        self.asked, self.cached_len = [], cached

    def cached(self, seq):
        return self.cached_len

    def propose(self, work):
        for w in work:
            self.asked.append(w.window - len(w.state))
            while len(w.state) < w.window:
                w.state.add(3, "draft", None, 0.9)

    def trim(self, seq, valid):
        pass

    def release(self, seq):
        pass


def _sources(proposed):
    return [p.source for p in proposed]


def _propose(hybrid, seq, method, window, lookup):
    """The round's drafting for one slot whose method and windows are set."""
    return drafts([Slot(seq, 0, method=method, window=window, lookup=lookup)], hybrid)


def _hybrid(costs, model=None):
    return HybridDrafter(LookupDrafter(LookupConfig()), model,
                         SourceChooser(DraftingConfig(explore_every=1000), costs))


def test_hybrid_keeps_plain_when_the_draft_model_does_not_pay():
    model = FakeModel(cached=10)
    hybrid = _hybrid(_costs(draft_ms=40.0), model)  # a draft step dearer than a main step
    seq = _seq(list(range(10, 20)))  # nothing repeats: no lookup proposal
    assert _sources(_propose(hybrid, seq, "hybrid", 4, 8)) == ["plain"]
    assert model.asked == []


def test_in_a_batch_the_slot_drafts_its_window_and_the_batch_decides():
    """Priced alone, a model at a fresh sequence's prior acceptance loses to plain; in a
    batch that speculates (VLB measured it faster at that size, and sized the windows at the
    batch's costs) each slot with nothing pending drafts its window: single-sequence costs
    say nothing of a batch's, where drafts and verify tokens share the forwards."""
    model = FakeModel(cached=10)
    hybrid = _hybrid(_costs(draft_ms=40.0), model)
    seqs = [_seq(list(range(10, 20)), seq_id=i) for i in (1, 2)]
    batch = drafts([Slot(s, 0, method="hybrid", window=4, lookup=8) for s in seqs], hybrid)
    assert _sources(batch) == ["draft", "draft"] and model.asked == [4, 4]
    assert _sources(_propose(hybrid, _seq(list(range(30, 40)), seq_id=3), "hybrid", 4, 8)) == [
        "plain"]  # alone, the cost model still decides


@pytest.mark.parametrize("draft_ms,rounds", [(3.0, 8), (40.0, 8), (180.0, 8)])
def test_a_model_that_did_not_pay_is_retried_within_a_budget(draft_ms, rounds):
    """Re-trials of a model that lost: after `explore_every` rounds without it, and only when
    those rounds' time covers the trial's extra seconds 1/EXPLORE_SHARE times over: a draft
    forward dearer than 6 main steps (a slow kernel, a busy core) is tried every ~200
    rounds, a cheap one every 8."""
    from dspark.runtime.dflash.source import EXPLORE_SHARE

    costs = _costs(draft_ms=draft_ms)
    chooser = SourceChooser(DraftingConfig(explore_every=rounds), costs)
    trial = chooser.seconds(0, 1)
    tries = [i for i in range(1, 2001) if chooser.explore(1, trial)]
    plain = costs.seconds("main", 1)
    gap = max(rounds, math.ceil((trial - plain) / (plain * EXPLORE_SHARE)))
    assert tries[:3] == [gap, 2 * gap, 3 * gap]
    assert len(tries) * (trial - plain) <= EXPLORE_SHARE * 2000 * plain + trial


def test_hybrid_drafts_with_a_cheap_model_and_prefers_a_strong_lookup():
    model = FakeModel(cached=10)
    hybrid = _hybrid(_costs(draft_ms=3.0), model)
    seq = _seq(list(range(10, 20)))
    assert _sources(_propose(hybrid, seq, "hybrid", 4, 8)) == ["draft"]
    hybrid.release(seq)
    repeated = _seq([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4], seq_id=2)  # a 4-gram match
    model.cached_len = len(repeated.tokens)
    used = _sources(_propose(hybrid, repeated, "hybrid", 2, 8))
    assert used == ["lookup"] and hybrid.state(repeated).tokens[:3] == [5, 6, 7]


def test_drafts_after_the_first_are_charged_their_own_cost():
    """A round's first draft forward follows a main forward and costs more than the ones
    after it: once both are measured, a window is priced first + (w - 1) steps, and a
    cheaper step makes a longer model window pay."""
    costs = _costs(draft_ms=8.0)
    chooser = SourceChooser(DraftingConfig(), costs)
    seq = _seq(list(range(10, 20)))
    assert costs.draft_step() == costs.seconds("draft", 1)  # unmeasured: the first's
    before = chooser.extension(seq.id, [], 6, seq.stats, 1)
    for _ in range(40):
        costs.record(DRAFT_STEP, 1, 0.002)
    assert costs.draft_step() == pytest.approx(0.002, rel=1e-3)
    t_main = costs.seconds("main", 4)
    assert chooser.rate([], 3, seq.stats, 1) == pytest.approx(
        (1 + chooser._model_survival(seq.stats, 3)) / (costs.seconds("draft", 1) + 2 * 0.002
                                                       + t_main))
    assert chooser.extension(seq.id, [], 6, seq.stats, 1) > before


def test_model_catch_up_is_spread_over_the_output_left():
    chooser = SourceChooser(DraftingConfig(), _costs())
    seq = _seq([1, 2, 3])
    assert chooser.catch_up(2, 100, seq.stats) == 0.0  # a usual round's catch-up is free
    long_left, short_left = (chooser.catch_up(200, n, seq.stats) for n in (500, 5))
    assert 0 < long_left < short_left
    # output sat out in lookup rounds comes back at every switch: charged to the round
    sat_out = chooser.catch_up(9, 500, seq.stats, once=False)
    assert sat_out == pytest.approx(chooser.costs.seconds("draft", 9)
                                    - chooser.costs.seconds("draft", 2))
    assert sat_out > chooser.catch_up(9, 500, seq.stats)


def test_plain_rate_must_be_beaten_by_the_margin():
    chooser = SourceChooser(DraftingConfig(), _costs())
    plain = chooser.rate([])
    assert plain == pytest.approx(1 / 0.030)
    seq = _seq([1])
    best = chooser.extension(seq.id, [], 4, seq.stats, behind=1)
    if best:
        assert chooser.rate([], best, seq.stats, 1) > MARGIN * plain


def test_model_speed_is_judged_against_plain_rounds_realized_speed():
    """Plain and model rounds both take 1/0.7 of their predicted time (costs that leave out
    the engine's own work): the model keeps drafting. Only a model whose rounds fall short
    of their prediction by more than plain rounds do loses to plain."""
    chooser = SourceChooser(DraftingConfig(), _costs(draft_ms=8.0))
    seq = _seq([1])
    plain, model = chooser.rate([]), chooser.rate([], 2, seq.stats, 1)
    assert model > MARGIN * plain  # the model pays on the table's costs
    t_plain, t_model = chooser.seconds(0), chooser.seconds(0, 2, 1)
    for _ in range(20):
        chooser.expect(seq.id, t_plain, "plain")
        chooser.observe_round(seq.id, t_plain / 0.7)
        chooser.expect(seq.id, t_model, "model")
        chooser.observe_round(seq.id, t_model / 0.7)
    assert chooser.state(seq.id).relative_speed() == pytest.approx(1.0)
    assert chooser.extension(seq.id, [], 4, seq.stats, behind=1) > 0
    for _ in range(20):  # model rounds now take twice as long as plain rounds' shortfall
        chooser.expect(seq.id, t_model, "model")
        chooser.observe_round(seq.id, t_model / 0.35)
    assert chooser.state(seq.id).relative_speed() == pytest.approx(0.5, rel=0.05)
    assert chooser.extension(seq.id, [], 4, seq.stats, behind=1) == 0


def test_untried_positions_follow_the_sequences_own_acceptance():
    """A draft whose first token held 19 times in 20 (only windows of 1 so far) is expected
    to hold its third and fourth as a chain of such tokens, not at a fixed 0.7^j, so the
    chooser tries a longer window; a draft that mostly fails is not."""
    chooser = SourceChooser(DraftingConfig(), _costs(draft_ms=4.0))
    strong, weak = _seq([1]), _seq([1], seq_id=2)
    for i in range(20):
        strong.stats.record_sources(["draft"], int(i > 0))
        weak.stats.record_sources(["draft"], int(i % 4 == 0))
    b = [chooser._model_survival(strong.stats, w) - chooser._model_survival(strong.stats, w - 1)
         for w in range(1, 5)]
    alpha = (19 + PRIOR_WEIGHT * PRIOR_ACCEPT) / (20 + PRIOR_WEIGHT)  # pooled over positions
    assert b[0] == pytest.approx((19 + POSITION_WEIGHT * alpha) / (20 + POSITION_WEIGHT))
    assert b[3] == pytest.approx(b[0] * alpha ** 3) and b[3] > 0.7
    assert chooser._model_survival(weak.stats, 4) < 0.5
    assert chooser.extension(strong.id, [], 4, strong.stats, behind=1) == 4
    assert chooser.extension(weak.id, [], 4, weak.stats, behind=1) <= 1


def test_one_rejection_at_a_rarely_tried_position_does_not_end_its_trials():
    """40 rounds of two drafts held 90% and 95% of the time they were reached; the one
    round that tried a third rejected it. Counted among the rounds that reached it (0 of 1,
    against the pooled acceptance) the third stays likely enough to be tried again where
    drafts are cheap; per-position survival (0 of 1 verified) priced it at half."""
    chooser = SourceChooser(DraftingConfig(), _costs(draft_ms=3.0))
    seq = _seq([1])
    for i in range(40):
        first = i % 10 != 0
        seq.stats.record_sources(["draft", "draft"], (1 + (i % 20 != 1)) if first else 0)
    seq.stats.record_sources(["draft", "draft", "draft"], 2)
    src = seq.stats.sources["draft"]
    assert src.reached_at[:3] == [41, 37, 1] and src.accepted_at[:3] == [37, 35, 0]
    third = chooser._model_survival(seq.stats, 3) - chooser._model_survival(seq.stats, 2)
    second = chooser._model_survival(seq.stats, 2) - chooser._model_survival(seq.stats, 1)
    assert third > 0.65 * second > 0.5  # per-position survival: 0.51, 0.6 of the second
    assert chooser.extension(seq.id, [], 3, seq.stats, behind=1) == 3


@pytest.mark.parametrize(("trust", "used"), [(0.3, "lookup"), (1.0, "draft")])
def test_a_confident_lookup_runs_without_the_model(trust, used):
    """A 2-token match (first draft ~40% likely) is verified alone, no draft forward, when
    lookup_trust is below that; else a model cheap enough to beat it replaces it."""
    model = FakeModel(cached=0)
    hybrid = HybridDrafter(LookupDrafter(LookupConfig()), model, SourceChooser(
        DraftingConfig(explore_every=1000, lookup_trust=trust), _costs(draft_ms=0.5)))
    seq = _seq([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 1, 2])
    model.cached_len = len(seq.tokens)
    assert hybrid.survivals(seq) == []
    assert _sources(_propose(hybrid, seq, "hybrid", 4, 8)) == [used]
    assert (model.asked == []) == (used == "lookup")


def test_lookup_trust_is_validated():
    from dspark.runtime.bundle.config import ConfigError

    with pytest.raises(ConfigError, match="drafting.lookup_trust"):
        DraftingConfig(lookup_trust=1.5).validate("drafting")
    with pytest.raises(ConfigError, match="drafting.hybrid_min_window"):
        DraftingConfig(hybrid_min_window=-1).validate("drafting")


def test_pending_drafts_are_kept_only_as_far_as_they_pay():
    """A verify of k+1 tokens costs more than a decode: drafts unlikely to survive go
    (plain decoding must be beaten by MARGIN), likely ones stay, forced ones always."""
    chooser = SourceChooser(DraftingConfig(), _costs())  # 30 ms a decode, +2 ms a token
    assert chooser.worth([0.03, 0.01]) == 0
    assert chooser.worth([0.9, 0.8, 0.6]) == 3
    assert chooser.worth([0.9, 0.05, 0.01]) == 1  # the prefix with the best rate
    assert chooser.worth([1.0, 1.0, 0.01], sure=2) == 2
    assert SourceChooser(DraftingConfig(), CostModel()).worth([0.01]) == 1  # unmeasured


def test_lookup_backs_off_while_it_pays_nothing():
    """Rounds whose lookup kept nothing double the rounds skipped before the next (up to
    MAX_SKIP); a kept draft starts over."""
    from dspark.runtime.drafting.hybrid import Backoff

    backoff, looked = Backoff(), []
    for round_ in range(100):
        if backoff.ready(7):
            looked.append(round_)
            backoff.record(7, kept=round_ >= 60)
    gaps = [b - a for a, b in zip(looked, looked[1:])]
    assert gaps[:4] == [1, 4, 8, 16] and max(gaps) == Backoff.MAX_SKIP + 1
    assert looked[-3:] == [97, 98, 99]  # a kept draft (round 63): every round again


def test_a_backed_off_lookup_rests_on_exactly_the_skipped_rounds():
    """A lookup-only sequence whose lookups kept nothing rests (`rests`: a plain round, no
    lookup walked) on exactly the rounds the back-off skips, and looks up on the rest;
    pending drafts never rest."""
    from dspark.runtime.drafting.hybrid import Backoff

    hybrid, reference = _hybrid(_costs()), Backoff()
    seq = _seq(list(range(10, 20)))  # nothing repeats: every lookup keeps nothing
    rested = 0
    for _ in range(40):
        looks = reference.ready(seq.id)
        assert hybrid.rests(seq) == (not looks)
        if looks:
            proposed = _propose(hybrid, seq, "lookup", 0, 8)
            assert _sources(proposed) == ["plain"] and proposed[0].lookup == 8
            reference.record(seq.id, kept=False)
        rested += not looks
    assert rested > 20  # the back-off did skip
    hybrid.state(seq).add(3, "lookup", None, 0.9)
    assert not hybrid.rests(seq)


@pytest.mark.parametrize("held", [True, False])
def test_a_lookup_cut_before_its_verify_still_calibrates(held):
    """A lookup proposal no verify would pay for is dropped, and the round's own token says
    whether its first draft would have held: the sequence's lookup calibration learns from
    it as from a verified draft, up when it would have held, down when not."""
    hybrid = _hybrid(_costs(main_ms=(30,) + (300,) * 8))  # a verify of 2+ tokens: 10x a decode
    seq = _seq([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 1, 2])  # "1, 2" matched: 3 proposed
    [proposed] = _propose(hybrid, seq, "lookup", 0, 8)
    assert len(proposed.pending) == 0 and hybrid.shadow[seq.id][0] == 3  # cut, remembered
    hybrid.settle(seq, len(seq.tokens), 0, 0, 3 if held else 99, 0.03)
    calibration = hybrid.chooser.state(seq.id).calibration["lookup"]
    assert (calibration > 1.0) if held else (calibration < 1.0)
    assert seq.id not in hybrid.shadow


def test_a_calibration_above_one_lifts_only_the_first_of_a_lookup_run():
    """Learned mostly from first drafts, a lookup calibration above 1 once made every later
    step of a proposal certain (0.85 x 1.3 capped at 1): a 40% first guess priced its 7
    drafts at 0.52 each. It lifts the first draft only; below 1 it lowers every step; a
    draft model's calibration applies to each of its drafts."""
    chooser = SourceChooser(DraftingConfig(), _costs())
    chooser.state(1).calibration.update(lookup=1.3, draft=1.1)
    assert chooser.survivals(1, ["lookup"] * 3, [0.4, 0.85, 0.85]) == pytest.approx(
        [0.52, 0.52 * 0.85, 0.52 * 0.85 ** 2])
    assert chooser.survivals(1, ["draft"] * 2, [0.8, 0.8]) == pytest.approx([0.88, 0.88 ** 2])
    assert chooser.survivals(1, ["draft", "lookup"], [0.8, 0.5]) == pytest.approx(
        [0.88, 0.88 * 0.65])  # a lookup after a model draft is a run's first
    chooser.state(1).calibration["lookup"] = 0.5
    assert chooser.survivals(1, ["lookup"] * 2, [0.4, 0.8]) == pytest.approx([0.2, 0.08])
