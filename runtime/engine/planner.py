"""What the round's decision (engine/decide.py) reads of each sequence: its drafting method,
its window caps, the hybrid's floor, and its tenant's window policy (and what the policies
learn after a round).

    method    the request's, else the draft model it names, else the config's; hybrid means
              lookup on a draftless bundle; auto is the device row's
    caps      model window: config, tenant, request, device (RAS), tokens left; lookup: the
              lookup's max within the request's and the tenant's caps
    floor     a hybrid slot's model window is the most the hybrid may draft; its cost model
              picks how many (0 included). Under an adaptive policy it is at least a floor:
              DWC's late window is small on a 2-core CPU (its rules scaled to the device
              row's 4), and the hybrid's own survival estimates decide better. While the
              draft's tokens hold on the sequence (>= LONG_ACCEPTANCE of them) the floor is
              `drafting.hybrid_min_window` (the whole cap: a draft that holds the main's
              weights exactly keeps most of a long window); else SHORT_FLOOR, since a draft
              that holds less is over-predicted on long windows (the most optimistic of
              noisy estimates wins). The runs behind both: docs/experiments.md.
Policies are reached only through the WindowPolicy protocol.
"""

from __future__ import annotations

from dspark.runtime.bundle.config import DFlashConfig
from dspark.runtime.dflash.policies import make_policy
from dspark.runtime.dflash.policy import KeepRule, RoundView, WindowPolicy
from dspark.runtime.dflash.ras import ResourceManager
from dspark.runtime.model.costs import CostModel
from dspark.runtime.sequence.request import Sequence

NO_CAP = 64
LONG_ACCEPTANCE = 0.85  # a draft whose tokens hold this often is offered hybrid_min_window
SHORT_FLOOR = 4  # else at least this (the floor measured best for a 70-80% draft)
PRIOR_DRAFTS = 4  # the threshold counts as this many drafts before a sequence's own


class WindowPlanner:
    def __init__(self, config: DFlashConfig, costs: CostModel, resources: ResourceManager,
                 has_model: bool, policy: str | None = None, window: int | None = None):
        self.config = config
        self.costs = costs
        self.resources = resources
        self.has_model = has_model
        self.policies: dict[str, WindowPolicy] = {}
        self.set_policy(policy or config.window.policy, window)

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

    def begin_round(self, drafting: int) -> None:
        """Tell every policy how many sequences draft together this round."""
        for policy in self.policies.values():
            policy.begin_round(drafting)

    def keep_rule(self, seq: Sequence) -> KeepRule:
        """The sequence's per-token drafting rule this round, carried by its DraftWork."""
        return KeepRule(self.policy(seq.tenant), self.view(seq))

    def observe(self, seq: Sequence) -> None:
        """After a round: the window policy learns from the drafts it verified. A round
        that verified none (plain decoding, a lookup that rested) has nothing to teach, and
        building its view costs time every token."""
        if seq.stats.last_window:
            self.policy(seq.tenant).observe(self.view(seq))

    def forget(self, seq: Sequence) -> None:
        self.policy(seq.tenant).forget(seq.id)
