"""Per round, each slot's drafting method and windows, then how many drafts are verified.

    plan      method (request, else config; hybrid means lookup on a draftless bundle),
              model window = the tenant's window policy within every cap, lowered by VLB's
              batch cap; lookup cap = the lookup's max within the request/tenant caps.
              A hybrid slot's model window is the most the hybrid may draft; its cost
              model picks how many (0 included). Under an adaptive policy it is at least
              a floor: DWC's late window is small on a 2-core CPU (its rules scaled to the
              device row's 4), and the hybrid's own survival estimates decide better. While
              the draft's tokens hold on the sequence (>= LONG_ACCEPTANCE of them) the floor
              is `drafting.hybrid_min_window` (the whole cap: a draft that holds the main's
              weights exactly keeps most of a long window); else SHORT_FLOOR, since a draft
              that holds less is over-predicted on long windows (the most optimistic of
              noisy estimates wins). The runs behind both: docs/experiments.md.
    propose   the drafting's one call of the round (DraftJob per slot, each with its keep
              rule: the policy's per-token rule for the draft model)
    balance   VLB's fast + steady lanes; then, where the policy models survival (goodput) or
              a lookup proposed, the slots across the batch that maximise expected tokens
              per second of the verify (select_slots)
Policies are reached only through the WindowPolicy protocol.
"""

from __future__ import annotations

from dspark.runtime.bundle.config import DFlashConfig
from dspark.runtime.dflash.goodput import select_slots
from dspark.runtime.dflash.policies import make_policy
from dspark.runtime.dflash.policy import KeepRule, RoundView, WindowPolicy
from dspark.runtime.dflash.ras import ResourceManager
from dspark.runtime.dflash.vlb import VerifyBalancer
from dspark.runtime.drafting.base import Drafting, DraftJob
from dspark.runtime.engine.round_plan import RoundPlan, Slot
from dspark.runtime.model.costs import CostModel
from dspark.runtime.sequence.request import Sequence

NO_CAP = 64
LONG_ACCEPTANCE = 0.85  # a draft whose tokens hold this often is offered hybrid_min_window
SHORT_FLOOR = 4  # else at least this (the floor measured best for a 70-80% draft)
PRIOR_DRAFTS = 4  # the threshold counts as this many drafts before a sequence's own


class WindowPlanner:
    def __init__(self, config: DFlashConfig, costs: CostModel, resources: ResourceManager,
                 balancer: VerifyBalancer, has_model: bool, policy: str | None = None,
                 window: int | None = None):
        self.config = config
        self.costs = costs
        self.resources = resources
        self.balancer = balancer
        self.has_model = has_model
        self.policies: dict[str, WindowPolicy] = {}
        self.set_policy(policy or config.window.policy, window)
        self.speculated = False  # whether the last planned step could speculate
        self.decided = False  # whether it had a speculative request to decide for
        self.feeds_prompt = False  # whether it fed a prompt chunk

    def configure(self, config: DFlashConfig) -> None:
        self.config = config
        for policy in self.policies.values():
            if hasattr(policy, "config"):
                policy.config = config.window

    def set_policy(self, name: str, window: int | None = None, device_cap: bool = True) -> None:
        """Use another window policy for new rounds (per-tenant state starts afresh).
        device_cap=False lifts RAS's device window cap (a benchmark measuring fixed windows
        beyond it); the config's and the request's caps still apply."""
        make_policy(name, window=window or 1)  # an unknown name fails here, listing the known
        self.policy_name, self.fixed_window = name, window or self.config.window.initial
        self.policies = {}
        self.device_cap = device_cap

    def policy(self, tenant: str) -> WindowPolicy:
        if tenant not in self.policies:
            self.policies[tenant] = make_policy(self.policy_name, window=self.fixed_window,
                                                start=self.resources.row.window,
                                                config=self.config.window, costs=self.costs)
        return self.policies[tenant]

    def _caps(self, seq: Sequence) -> tuple[int, int]:
        """(tenant's cap, left for the request: its own cap and its remaining tokens)."""
        tenant = next((t.max_window for t in self.config.tenants if t.name == seq.tenant),
                      self.config.window.max_window)
        req = seq.request
        left = min(req.max_window or NO_CAP, req.max_tokens - len(seq.generated) - 1)
        return tenant, left

    def cap(self, seq: Sequence) -> int:
        """The model window's cap: config, tenant, request, device (RAS), tokens left."""
        tenant, left = self._caps(seq)
        device = self.resources.window_cap if self.device_cap else NO_CAP
        return max(0, min(self.config.window.max_window, tenant, left, device))

    def hybrid_floor(self, seq: Sequence) -> int:
        """The least model window a hybrid slot is offered: `drafting.hybrid_min_window` while
        the draft model's tokens hold on this sequence, else SHORT_FLOOR (see the module
        doc). The estimate starts at the threshold and follows the sequence's own drafts."""
        src = seq.stats.sources.get("draft")
        # per draft reached (every draft before it held), not per draft verified: a long
        # window's drafts past a rejection would read as rejected
        reached, accepted = (sum(src.reached_at), src.accepted) if src is not None else (0, 0)
        held = (accepted + PRIOR_DRAFTS * LONG_ACCEPTANCE) / (reached + PRIOR_DRAFTS)
        long = self.config.drafting.hybrid_min_window
        return long if held >= LONG_ACCEPTANCE else min(long, SHORT_FLOOR)

    def lookup_cap(self, seq: Sequence) -> int:
        tenant, left = self._caps(seq)
        return max(0, min(self.config.drafting.lookup.max_tokens, tenant, left))

    def view(self, seq: Sequence, confidence: list[float] | None = None) -> RoundView:
        """What a policy sees of `seq`; `confidence`: the pending drafts' (default: the
        last verified window's)."""
        return RoundView(seq.id, seq.tenant, seq.prompt_len, len(seq.generated), seq.stats,
                         self.cap(seq), tuple(seq.stats.draft_top1 if confidence is None
                                              else confidence))

    def method(self, seq: Sequence) -> str:
        """The request's method; else the draft model it names; else the config's."""
        req = seq.request
        method = req.method or ("draft" if req.draft_model else self.config.drafting.method)
        if method == "auto":
            method = self.resources.row.method
        return "lookup" if method == "hybrid" and not self.has_model else method

    def plan(self, plan: RoundPlan, drafting: Drafting) -> RoundPlan:
        """The round before its verify: each slot's method and windows, the drafts the
        drafting proposes for them (its one call this round), and how many the verify
        checks."""
        planned = self._windows(plan, drafting)
        jobs = [s for s in planned if s.method != "plain"]
        proposed = drafting.propose([
            DraftJob(s.seq, s.method, s.window, s.lookup, s.finishes_prompt, s.room,
                     s.catch_up, self._keep_rule(s.seq) if s.method != "lookup" else None)
            for s in jobs])
        filled = {s.seq.id: s.but(source=p.source, lookup=p.lookup, pending=p.pending)
                  for s, p in zip(jobs, proposed)}
        survivals = {s.seq.id: p.survivals for s, p in zip(jobs, proposed)}
        return self._balance(planned.with_slots(filled.get(s.seq.id, s) for s in planned),
                             survivals)

    def _windows(self, plan: RoundPlan, drafting: Drafting) -> RoundPlan:
        """Each speculating slot's method and windows. A lookup slot whose lookups rest this
        round (`Drafting.rests`) stays a plain slot: no drafting work at all, the same step
        as plain decoding's (a chat's lookups rest in most rounds, and the drafting path's
        bookkeeping would cost each of them). No slot speculates in a step that feeds a
        prompt (its chunk would wait for the drafts and their verify;
        `verify_balance.plain_prompt_steps`), nor where VLB finds plain steps faster at this
        batch size (`speculated`)."""
        self.feeds_prompt = any(s.seq.prefilling and s.chunk for s in plan)
        wanted = any(not s.seq.prefilling and s.seq.request.speculative for s in plan)
        self.decided = wanted and not self.feeds_prompt  # a step VLB measures (engine.step)
        self.speculated = (wanted and not self.balancer.config.plain_prompt_steps
                           if self.feeds_prompt else
                           self.decided and self.balancer.speculate(len(plan)))
        methods = {s.seq.id: self.method(s.seq) for s in plan if self.speculated
                   and not s.seq.prefilling and s.seq.request.speculative}
        speculating = [s for s in plan if s.seq.id in methods and not (
            methods[s.seq.id] == "lookup" and drafting.rests(s.seq))]
        for policy in self.policies.values():
            policy.begin_round(len(speculating))
        slots = {}
        for s in speculating:
            method = methods[s.seq.id]
            window = 0
            if method != "lookup":
                window = self.policy(s.seq.tenant).window(self.view(s.seq))
                if method == "hybrid" and self.policy_name != "fixed":
                    window = max(window, self.hybrid_floor(s.seq))
                window = min(self.cap(s.seq), window)
            lookup = self.lookup_cap(s.seq) if method != "draft" else 0
            slots[s.seq.id] = s.but(method=method, window=window, lookup=lookup)
        cap = self.balancer.batch_cap(len(speculating),
                                      max((s.window for s in slots.values()), default=0))
        return plan.with_slots(
            slots[s.seq.id].but(window=min(cap, slots[s.seq.id].window))
            if s.seq.id in slots else s for s in plan)

    def _keep_rule(self, seq: Sequence) -> KeepRule:
        """The sequence's per-token drafting rule this round, carried by its DraftJob."""
        return KeepRule(self.policy(seq.tenant), self.view(seq))

    def _balance(self, plan: RoundPlan, survivals: dict[int, tuple[float, ...]]) -> RoundPlan:
        """How many pending drafts each slot verifies; `survivals`: the drafting's
        calibrated ones by sequence, where a lookup proposed."""
        slots = [s.but(verify=self.balancer.admit(
            min(len(s.pending), max(s.window, s.lookup)))) for s in plan]
        chosen = [i for i, s in enumerate(slots) if s.verify and self._selects(s)]
        if chosen:
            survival = [self._survival(slots[i], survivals.get(slots[i].seq.id, ()))
                        for i in chosen]
            keep = select_slots(survival, sum(s.chunk for s in slots), self.costs)
            for i, k in zip(chosen, keep):
                slots[i] = slots[i].but(verify=k)
        return plan.with_slots(slots)

    def _selects(self, slot: Slot) -> bool:
        return "lookup" in slot.pending.sources[:slot.verify] or self.policy(
            slot.seq.tenant).survival(self.view(slot.seq, slot.pending.confidence), 1) is not None

    def _survival(self, slot: Slot, drafting: tuple[float, ...]) -> list[float]:
        seq, state = slot.seq, slot.pending
        if "lookup" not in state.sources[:slot.verify]:
            policy, view = self.policy(seq.tenant), self.view(seq, state.confidence)
            return [policy.survival(view, j) for j in range(1, slot.verify + 1)]
        return list(drafting[:slot.verify])

    def observe(self, seq: Sequence) -> None:
        """After a round: the window policy learns from the drafts it verified. A round
        that verified none (plain decoding, a lookup that rested) has nothing to teach, and
        building its view costs time every token."""
        if seq.stats.last_window:
            self.policy(seq.tenant).observe(self.view(seq))

    def forget(self, seq: Sequence) -> None:
        self.policy(seq.tenant).forget(seq.id)
