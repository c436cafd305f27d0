"""One round's decision: which method each sequence drafts with, how many drafts it proposes,
which slots verify and how far. The engine enters it once per step (`decide`).

Everything it weighs is an input, read through narrow calls:
    planner      each sequence's method, caps, hybrid floor and its tenant's window policy
                 (engine/planner.py)
    balancer     VLB: the batch modes it measured, its batch cap, its verify lanes
                 (dflash/vlb.py)
    chooser      the hybrid's scores of lookup, model and plain rounds from measured costs
                 and the sequence's acceptance (dflash/source.py); select_slots across the
                 batch (dflash/goodput.py)
and the drafting (drafting/hybrid.py) proposes, cuts and drops drafts as this module says.

In order:
    speculate    a step that feeds a prompt chunk does not speculate (the chunk would wait
                 for the drafts and their verify; `verify_balance.plain_prompt_steps`), nor
                 one whose batch size VLB finds faster plain
    windows      per speculating slot: its method, model window (its policy's, within every
                 cap, at least the hybrid floor, lowered by VLB's batch cap) and lookup cap;
                 a lookup slot whose lookups rest stays plain (no drafting work at all)
    lookups      a grammar's forced tokens first, then the lookups propose (free)
    keep         the pending drafts worth their verify (SourceChooser.worth); the rest go
    extend       a hybrid slot's model drafts after them, or instead of them (`extension`;
                 in a batch, with nothing pending, its window); a draft slot's up to its
                 window, as its policy decides token by token
    draft        the model proposes; a grammar cuts the drafts at the first it forbids
    verify       VLB's lanes admit; where the policy models survival or a lookup proposed,
                 select_slots keeps the slots across the batch with the most expected
                 tokens per second of the verify
"""

from __future__ import annotations

from typing import NamedTuple

from dspark.runtime.dflash.goodput import select_slots
from dspark.runtime.dflash.source import STEADY_BEHIND
from dspark.runtime.dflash.vlb import VerifyBalancer
from dspark.runtime.drafting.base import Drafting, DraftWork
from dspark.runtime.engine.planner import WindowPlanner
from dspark.runtime.engine.round_plan import RoundPlan, Slot


class Extension(NamedTuple):
    """A hybrid slot's model drafts this round."""

    extra: int  # model drafts to add after what stays pending
    drop: bool = False  # the pending drafts go first: the model alone promises more
    expect: tuple[str, float] | None = None  # the round's kind and predicted seconds


def decide(plan: RoundPlan, planner: WindowPlanner, balancer: VerifyBalancer,
           drafting: Drafting) -> RoundPlan:
    """The round before its verify: every slot's method, windows, pending drafts and how
    many of them the verify checks."""
    measured, speculated = _speculates(plan, balancer)
    planned = _windows(plan, planner, balancer, drafting, speculated)
    drafted = drafts([s for s in planned if s.method != "plain"], drafting, planner)
    by_id = {s.seq.id: s for s in drafted}
    planned = RoundPlan(tuple(by_id.get(s.seq.id, s) for s in planned), speculated, measured)
    return _verify(planned, planner, balancer, drafting)


def _speculates(plan: RoundPlan, balancer: VerifyBalancer) -> tuple[bool, bool]:
    """(a step VLB measures: it has a speculative request and feeds no prompt, may it
    speculate)."""
    feeds_prompt = any(s.seq.prefilling and s.chunk for s in plan)
    wanted = any(not s.seq.prefilling and s.seq.request.speculative for s in plan)
    measured = wanted and not feeds_prompt
    if feeds_prompt:
        return measured, wanted and not balancer.config.plain_prompt_steps
    return measured, measured and balancer.speculate(len(plan))


def _windows(plan: RoundPlan, planner: WindowPlanner, balancer: VerifyBalancer,
             drafting: Drafting, speculated: bool) -> RoundPlan:
    """Each speculating slot's method and windows."""
    methods = {s.seq.id: planner.method(s.seq) for s in plan if speculated
               and not s.seq.prefilling and s.seq.request.speculative}
    speculating = [s for s in plan if s.seq.id in methods and not (
        methods[s.seq.id] == "lookup" and drafting.rests(s.seq))]
    planner.begin_round(len(speculating))
    slots = {}
    for s in speculating:
        method = methods[s.seq.id]
        window = 0
        if method != "lookup":
            window = planner.policy(s.seq.tenant).window(planner.view(s.seq))
            if method == "hybrid" and planner.policy_name != "fixed":
                window = max(window, planner.hybrid_floor(s.seq))
            window = min(planner.cap(s.seq), window)
        lookup = planner.lookup_cap(s.seq) if method != "draft" else 0
        slots[s.seq.id] = s.but(method=method, window=window, lookup=lookup)
    cap = balancer.batch_cap(len(speculating), max((s.window for s in slots.values()), default=0))
    return plan.with_slots(slots[s.seq.id].but(window=min(cap, slots[s.seq.id].window))
                           if s.seq.id in slots else s for s in plan)


def drafts(slots: list[Slot], drafting: Drafting, planner: WindowPlanner | None = None
           ) -> list[Slot]:
    """The drafting of the round for slots whose method and windows are set: lookups, the
    pending drafts worth their verify, the model's drafts; each slot with what proposed
    (its source) and its pending buffer. `planner`: the slots' keep rules (None: none)."""
    slots = [_forced(s, drafting) for s in slots]
    looked_up = drafting.look_up([(s.seq, s.lookup) for s in slots
                                  if s.method != "draft" and s.lookup])
    work = []
    for s in slots:
        pending = drafting.state(s.seq)
        if s.method != "draft":
            drafting.cut(s.seq, drafting.chooser.worth(drafting.survivals(s.seq),
                                                       pending.forced),
                         s.seq.id in looked_up)
        extra = s.window - len(pending)
        if s.method == "hybrid":
            extra = _apply(s, extension(s, drafting, batched=len(slots) > 1), drafting)
        if extra > 0 and drafting.has_model and s.method != "lookup":
            keep = planner.keep_rule(s.seq) if planner is not None else None
            work.append(DraftWork(s.seq, pending, len(pending) + extra, keep, s.room,
                                  s.catch_up))
    drafting.draft(work)
    out = []
    for s in slots:
        drafting.constrain(s.seq)
        pending = drafting.state(s.seq)
        out.append(s.but(source=pending.used, pending=pending))
    return out


def _forced(slot: Slot, drafting: Drafting) -> Slot:
    """A grammar's forced tokens become pending drafts (free, sure) when nothing is pending
    and the round's chunk reaches the sequence's end; the lookup cap lets the verify take
    them all."""
    if not slot.finishes_prompt:
        return slot
    seq = slot.seq
    forced = drafting.force(seq, seq.request.max_tokens - len(seq.generated) - 1)
    return slot.but(lookup=max(slot.lookup, forced)) if forced else slot


def extension(slot: Slot, drafting: Drafting, batched: bool = False) -> Extension:
    """How many model drafts a hybrid slot adds after what is pending, or whether the model
    alone replaces them. A lookup proposal whose first draft is at least `lookup_trust`
    likely is verified alone (letting the model compete there cost edit prompts a good part
    of their gain). Otherwise, with P the pending drafts' survivals, the model may add w
    drafts, w in 0..window, scored by SourceChooser (dflash/source.py):
        (1 + sum P + P_last * sum_j b_j) / (w t_draft + t_main(|P| + w + 1))
    or replace them (P dropped, w >= 1), whichever promises more; w = 0 with nothing pending
    is a plain round, re-measured now and then (SourceChooser.explore).

    In a batch (`batched`) a slot with nothing pending drafts its window: the batch
    speculates only where VLB measured speculating steps faster at its size, with windows
    its batch cap sized at the batch's costs. Priced alone, at single-sequence costs and a
    new sequence's prior acceptance, the model came out at plain's rate (fp32 sample: 41-45
    against 43 x 1.05 tok/s), so sequences admitted during plain steps never drafted: at 4
    requests, 14 of 15 trials of speculation after plain steps realized 114-168 tok/s,
    where speculation's own runs had realized 160-215, and plain (140-150) stayed ahead."""
    seq, window, choose = slot.seq, slot.window, drafting.chooser
    pending = drafting.survivals(seq)
    lag = drafting.model_lag(seq)
    if lag is None or window <= 0:
        return Extension(0)
    if (pending and pending[0] >= choose.config.lookup_trust
            and not drafting.from_store(seq)):
        return Extension(0)  # a confident lookup: verified as is, no draft forward spent
    if batched and not pending:
        return Extension(window)
    # The model's catch-up beyond a round's usual one or two tokens: a prompt it never read
    # is paid once (spread over the output left), output it sat out in lookup rounds is
    # charged to this round (SourceChooser.catch_up).
    behind, read_prompt = lag
    left = seq.request.max_tokens - len(seq.generated)
    overhead = choose.catch_up(behind, left, seq.stats, once=not read_prompt)
    if overhead is None:
        return Extension(0 if pending else window)
    steady = min(STEADY_BEHIND, behind)
    keep = choose.extension(seq.id, pending, window - len(pending), seq.stats,
                            steady + len(pending), overhead)
    if keep is None:  # costs unmeasured: the policy's window where nothing is pending
        return Extension(0 if pending else window)
    chosen, drop = (pending, keep, steady + len(pending)), False
    if pending:
        alone = choose.extension(seq.id, [], window, seq.stats, steady, overhead)
        if alone and choose.rate([], alone, seq.stats, steady, overhead) > choose.rate(
                pending, keep, seq.stats, steady + len(pending), overhead):
            chosen, drop = ([], alone, steady), True
    elif not keep and choose.explore(seq.id, choose.seconds(0, 1, steady, overhead)):
        chosen = ([], 1, steady)
    survivals, extra, read = chosen
    expect = None
    if extra and (behind <= STEADY_BEHIND or read_prompt):  # a prompt's catch-up says little
        expect = ("model", choose.seconds(len(survivals), extra, read, overhead))
    elif not extra and not survivals:
        expect = ("plain", choose.seconds(0))
    return Extension(extra, drop, expect)


def _apply(slot: Slot, ext: Extension, drafting: Drafting) -> int:
    """Carry out an Extension's drop and expectation; its model drafts."""
    if ext.drop:
        drafting.drop(slot.seq)
    if ext.expect is not None:
        kind, seconds = ext.expect
        drafting.chooser.expect(slot.seq.id, seconds, kind)
    return ext.extra


def _verify(plan: RoundPlan, planner: WindowPlanner, balancer: VerifyBalancer,
            drafting: Drafting) -> RoundPlan:
    """How many pending drafts each slot verifies."""
    slots = [s.but(verify=balancer.admit(min(len(s.pending), max(s.window, s.lookup))))
             for s in plan]
    chosen = [i for i, s in enumerate(slots) if s.verify and _selects(s, planner)]
    if chosen:
        survival = [_survival(slots[i], planner, drafting) for i in chosen]
        keep = select_slots(survival, sum(s.chunk for s in slots), planner.costs)
        for i, k in zip(chosen, keep):
            slots[i] = slots[i].but(verify=k)
    return plan.with_slots(slots)


def _selects(slot: Slot, planner: WindowPlanner) -> bool:
    """Is the slot's verify length chosen across the batch: a lookup proposed, or its
    policy models survival?"""
    return "lookup" in slot.pending.sources[:slot.verify] or planner.policy(
        slot.seq.tenant).survival(planner.view(slot.seq, slot.pending.confidence), 1) is not None


def _survival(slot: Slot, planner: WindowPlanner, drafting: Drafting) -> list[float]:
    """Each verified draft's chance to hold: the lookup's calibrated survivals where a
    lookup proposed, else the policy's."""
    seq, state = slot.seq, slot.pending
    if "lookup" not in state.sources[:slot.verify]:
        policy, view = planner.policy(seq.tenant), planner.view(seq, state.confidence)
        return [policy.survival(view, j) for j in range(1, slot.verify + 1)]
    return drafting.survivals(seq)[:slot.verify]
