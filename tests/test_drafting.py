"""The drafting package's parts: the n-gram index, the lookup drafter, settling pending
drafts, and the model drafter (the hybrid's choice of source: test_hybrid.py)."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest

from dspark.runtime.bundle.config import LookupConfig
from dspark.runtime.cache.kv_arena import SeqTable
from dspark.runtime.dflash.policy import KeepRule, RoundView
from dspark.runtime.drafting.base import DraftWork
from dspark.runtime.drafting.lookup import LookupDrafter, MatchStats
from dspark.runtime.drafting.model import ModelDrafter
from dspark.runtime.drafting.ngram_index import NgramIndex
from dspark.runtime.drafting.state import DraftState, settle
from dspark.runtime.sequence.request import GenerationRequest, Sequence


def test_index_grows_incrementally_like_a_fresh_one():
    stream = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2]
    grown = NgramIndex(1, 3)
    for i in range(1, len(stream) + 1):
        grown.sync(stream[:i])
    fresh = NgramIndex(1, 3)
    fresh.extend(stream)
    assert grown.table == fresh.table and grown.tokens == stream


def test_walk_takes_the_longest_match_and_the_majority_continuation():
    index = NgramIndex(1, 4)
    index.extend([7, 1, 2, 3, 9, 1, 2, 3, 9, 4, 2, 3, 8])
    # "2 3" continues with 9, 9, 8: the 3-gram "1 2 3" matched twice, both followed by 9
    n, tokens, agree = index.walk([5, 1, 2, 3], 3)
    assert n == 3 and tokens[0] == 9 and agree[0] == 1.0
    n, tokens, agree = index.walk([2, 3], 1)  # 2-gram: 9, 9, 8 -> 9 with 2/3 agreement
    assert n == 2 and tokens == [9] and agree == [pytest.approx(2 / 3)]
    assert index.walk([6, 6], 4) == (0, [], [])  # no occurrence of anything


def test_walk_never_proposes_from_the_streams_own_end():
    index = NgramIndex(1, 2)
    index.extend([4, 5])
    assert index.walk([4, 5], 3) == (0, [], [])  # "4 5" occurs only at the end
    index.extend([4, 5])
    assert index.walk([4, 5], 3)[1] == [4, 5]  # now its first occurrence continues


def test_occurrences_are_bounded():
    index = NgramIndex(1, 1, max_occurrences=4)
    index.extend([3] * 100)
    assert len(index.table[(3,)]) <= 8 and len(index.match([3])[1]) == 4


@pytest.mark.parametrize("verified, accepted, main, pending_after, unchanged", [
    (4, 4, 50, [], 4),            # all accepted, the main token is the bonus
    (3, 3, 40, [], 4),            # the main token equals the one held draft: all still right
    (3, 1, 99, [], 1),            # rejected at 2: everything after it is dropped
    (2, 2, 30, [40], 4),          # held drafts continue: the main token equals the first
    (2, 2, 77, [], 2),            # held drafts contradicted by the main token
    (0, 0, 10, [20, 30, 40], 4),  # nothing verified, first held draft confirmed
])
def test_settle_keeps_exactly_the_drafts_still_right(verified, accepted, main, pending_after,
                                                     unchanged):
    state = DraftState()
    for t in (10, 20, 30, 40):
        state.add(t, "lookup")
    assert settle(state, verified, accepted, main) == unchanged
    assert state.tokens == pending_after


def _seq(ids, seq_id=1, tenant="default", max_tokens=64):
    return Sequence(seq_id, GenerationRequest(tuple(ids), max_tokens, tenant=tenant))


class FakeRunner:
    """A draft model's runner: records its forwards, always predicts token 7."""

    pool = "draft"
    costs = None

    def __init__(self):
        self.chunks = []

    def forward(self, chunks, rows, cost_role=None, record=True):
        self.chunks.append(chunks)
        logits = np.zeros((sum(rows), 16), np.float32)
        logits[:, 7] = 1.0
        return np.split(logits, np.cumsum(rows)[:-1])


class FakeArena:
    """Sequences with nothing cached (the drafter reads what a prefix cache found)."""

    def __init__(self):
        self.tables = defaultdict(SeqTable)

    def rollback(self, seq_id, pool, length):
        pass


def test_model_drafter_rereads_the_last_token_when_dropped_drafts_were_all_it_lacked():
    """The draft read the sequence and its pending lookup drafts, then the hybrid dropped
    those drafts (the model alone promised more): its cache holds every token, yet drafting
    needs the last one's logits. It re-reads that token (once a timing-dependent crash:
    "a batch needs at least one token per sequence")."""
    runner = FakeRunner()
    drafter = ModelDrafter({"draft": runner}, FakeArena(), "draft", {})
    seq, state = _seq(list(range(1, 11))), DraftState()
    state.add(11, "lookup")
    state.add(12, "lookup")
    drafter.propose([DraftWork(seq, state, 3, room=1000, catch_up=64)])
    assert runner.chunks[-1] == [(seq.id, 0, list(range(1, 13)))] and state.tokens[-1] == 7
    state.clear()
    drafter.trim(seq, len(seq.tokens))
    drafter.propose([DraftWork(seq, state, 2, room=1000, catch_up=64)])
    assert runner.chunks[-2] == [(seq.id, 9, [10])]
    assert runner.chunks[-1] == [(seq.id, 10, [7])] and state.tokens == [7, 7]


class StopAfter:
    """A window policy's keep rule that records what it was shown."""

    def __init__(self, limit):
        self.limit, self.seen = limit, []

    def keep_drafting(self, view, drafted):
        self.seen.append((view.seq_id, view.confidence, drafted))
        return drafted < self.limit


def test_the_draft_model_asks_the_jobs_keep_rule_with_the_pending_confidences():
    """The draft model stops where the sequence's policy says, asked through the KeepRule
    its job carries (no callback into the planner), and shows the policy the confidences of
    the drafts pending so far, in order."""
    runner, policy = FakeRunner(), StopAfter(2)
    drafter = ModelDrafter({"draft": runner}, FakeArena(), "draft", {})
    seq, state = _seq(list(range(1, 6))), DraftState()
    view = RoundView(seq.id, seq.tenant, seq.prompt_len, 0, seq.stats, 8)
    drafter.propose([DraftWork(seq, state, 5, KeepRule(policy, view), 1000, 64)])
    assert state.tokens == [7, 7]
    assert [(s, len(c), d) for s, c, d in policy.seen] == [(seq.id, 1, 1), (seq.id, 2, 2)]
    assert policy.seen[-1][1] == tuple(state.confidence) and 0 < state.confidence[0] < 1


def test_lookup_proposes_from_the_context_and_stops_at_low_survival():
    drafter = LookupDrafter(LookupConfig(min_survival=0.3))
    seq = _seq([5, 6, 7, 8, 9, 1, 2, 5, 6, 7])
    state = DraftState()
    drafter.propose([DraftWork(seq, state, 8)])
    # "5 6 7" matched (n=3): 8, 9, 1, 2, 5, ... with survival 0.65, 0.55, 0.47, 0.40, 0.34
    assert state.tokens == [8, 9, 1, 2, 5] and set(state.sources) == {"lookup"}
    assert all(q is None for q in state.q)  # deterministic proposals: one-hot q
    assert state.confidence[0] == pytest.approx(MatchStats(4).first_rate(3))


def test_match_stats_learn_from_verification():
    stats = MatchStats(4)
    before = stats.first_rate(1), stats.next_rate()
    for _ in range(50):
        stats.observe(1, verified=3, accepted=3)
    assert stats.first_rate(1) > before[0] and stats.next_rate() > before[1]
    for _ in range(200):
        stats.observe(1, verified=3, accepted=0)
    assert stats.first_rate(1) < 0.3


def test_tenant_corpus_serves_later_requests_of_the_same_tenant():
    drafter = LookupDrafter(LookupConfig(tenant_corpus_size=2, min_survival=0.0))
    done = _seq([1, 2, 3, 4, 5, 6], seq_id=1, tenant="a")
    drafter.index(done)
    drafter.release(done)
    for tenant, want in (("a", [4, 5, 6]), ("b", [])):
        state = DraftState()
        drafter.propose([DraftWork(_seq([9, 2, 3], seq_id=2, tenant=tenant), state, 3)])
        assert state.tokens == want


@pytest.mark.parametrize("case", ["spread", "peaked", "ties"])
def test_greedy_confidence_is_the_softmaxs_top1_and_top3_entropy(case):
    """The greedy drafter's shortcut (argmax for the top 3, one exp pass) gives what
    confidence() gives on the float64 softmax: top-1 probability, renormalised top-3
    entropy; the logits are left as they were."""
    from dspark.runtime.drafting.model import confidence, greedy_confidence

    rng = np.random.default_rng(11)
    logits = {"spread": rng.standard_normal(49152) * 3,
              "peaked": np.concatenate([[40.0], rng.standard_normal(999)]),
              "ties": np.array([2.0, 5.0, 5.0, 1.0, 5.0])}[case].astype(np.float32)
    before = logits.copy()
    p = np.exp(logits.astype(np.float64) - logits.max())
    want = confidence(p / p.sum())
    got = greedy_confidence(logits)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(logits, before)
