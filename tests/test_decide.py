"""The round's decision (engine/decide.py) on a step as a whole: a step that feeds a prompt
does not speculate and is not one VLB measures, a decode step speculates, the slots that
do not speculate come back as the scheduler planned them, and a resting lookup slot gets no
drafting work (fake costs stand in for measured ones; a lookup-only bundle)."""

from __future__ import annotations

import pytest

from dspark.runtime.bundle.config import (
    DFlashConfig,
    DraftingConfig,
    LookupConfig,
    ResourceConfig,
    ResourceRow,
    VerifyBalanceConfig,
)
from dspark.runtime.dflash.ras import Device, ResourceManager
from dspark.runtime.dflash.source import SourceChooser
from dspark.runtime.dflash.vlb import VerifyBalancer
from dspark.runtime.drafting.hybrid import HybridDrafter
from dspark.runtime.drafting.lookup import LookupDrafter
from dspark.runtime.engine.decide import decide
from dspark.runtime.engine.planner import WindowPlanner
from dspark.runtime.engine.round_plan import RoundPlan, Slot
from dspark.runtime.model.costs import CostModel
from dspark.runtime.sequence.request import GenerationRequest, Sequence

REPEATS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4]  # a 4-gram match: the lookup proposes


def _round(plain_prompt_steps: bool, drafting_class=HybridDrafter):
    config = DFlashConfig(verify_balance=VerifyBalanceConfig(
        plain_prompt_steps=plain_prompt_steps))
    costs = CostModel()
    for n in range(1, 10):
        costs.table["main"][n] = (30 + 2 * n) / 1000
    planner = WindowPlanner(config, costs, ResourceManager(
        ResourceConfig(table=(ResourceRow("cpu", 8),)), Device("cpu", "cpu", 24.0, 2), {}),
        has_model=False)
    drafting = drafting_class(LookupDrafter(LookupConfig()), None,
                              SourceChooser(DraftingConfig(), costs))
    return planner, VerifyBalancer(config.verify_balance, costs), drafting


def _decoding(seq_id: int) -> Sequence:
    """A sequence past its prompt: one token generated, not yet cached."""
    seq = Sequence(seq_id, GenerationRequest(tuple(REPEATS), 32))
    seq.tokens.append(5)
    seq.main_cached = len(seq.tokens) - 1
    return seq


@pytest.mark.parametrize("plain_prompt_steps", [True, False])
def test_a_step_that_feeds_a_prompt_speculates_only_where_allowed(plain_prompt_steps):
    planner, balancer, drafting = _round(plain_prompt_steps)
    waiting = Sequence(9, GenerationRequest(tuple(range(10, 30)), 16))
    plan = decide(RoundPlan((Slot(_decoding(1), 1), Slot(waiting, 20))), planner, balancer,
                  drafting)
    decoding, prompt = plan.slots
    assert not plan.measured  # a prompt's step is no measure of either mode
    assert plan.speculated == (not plain_prompt_steps)
    assert (decoding.method != "plain") == (not plain_prompt_steps)
    assert prompt == Slot(waiting, 20)  # a prefilling slot never speculates


def test_a_decode_step_speculates_and_verifies_the_lookup():
    planner, balancer, drafting = _round(True)
    plan = decide(RoundPlan((Slot(_decoding(1), 1),)), planner, balancer, drafting)
    [slot] = plan.slots
    assert plan.measured and plan.speculated
    assert (slot.method, slot.source) == ("lookup", "lookup")
    assert 1 <= slot.verify <= len(slot.pending) and slot.pending.tokens[0] == 6


def test_a_request_without_speculation_stays_plain():
    planner, balancer, drafting = _round(True)
    seq = _decoding(1)
    seq.request = GenerationRequest(tuple(REPEATS), 32, speculative=False)
    plan = decide(RoundPlan((Slot(seq, 1),)), planner, balancer, drafting)
    assert not plan.measured and not plan.speculated
    assert plan.slots == (Slot(seq, 1),)


def test_a_resting_lookup_slot_stays_plain():
    """A lookup slot whose lookups rest this round gets no drafting work: the decision leaves
    it a plain slot and the lookups never see it; the other slot of the batch, not resting,
    is proposed for as usual."""

    class Recording(HybridDrafter):
        resting, jobs = {1}, []

        def rests(self, seq):
            return seq.id in self.resting

        def look_up(self, caps):
            self.jobs.extend(seq.id for seq, _ in caps)
            return super().look_up(caps)

    planner, balancer, drafting = _round(True, Recording)
    a, b = _decoding(1), Sequence(2, GenerationRequest(tuple(range(30, 40)), 32))
    b.tokens.append(7)
    b.main_cached = len(b.tokens) - 1
    plan = decide(RoundPlan((Slot(a, 1), Slot(b, 1))), planner, balancer, drafting)
    assert drafting.jobs == [2]
    [left, proposed] = plan.slots
    assert (left.method, left.lookup, left.verify) == ("plain", 0, 0)
    assert proposed.method == "lookup" and proposed.lookup > 0
