"""Goodput: draft and verify the slots whose expected accepted tokens pay for their cost.

From the draft's per-position confidence c_i (its top-1 probability, calibrated per request
against what was actually accepted), the survival probability of position j is
a_j = prod_{i<=j} c_i: the chance the verify keeps it. Drafting one more token costs a share
of a draft forward plus the verify's marginal cost; it is worth an expected a_{j+1} main
decode steps. So a sequence keeps drafting while

    a_j * c_j * t_main(1)  >  t_draft / batch + (t_main(T + 1) - t_main(T))

and across the batch `select_slots` keeps the (request, position) slots, in order of a_j,
that maximise expected tokens per second of the verify: (n + sum a) / t_main(T). Window 0
(plain decoding) is chosen when even the first slot does not pay; every few plain rounds
one token is drafted to re-measure.
"""

from __future__ import annotations

from dataclasses import dataclass

from dspark.runtime.config import WindowConfig
from dspark.runtime.dflash.costs import CostModel
from dspark.runtime.dflash.policy import RoundView

PRIOR_ACCEPT = 0.7  # first-round guess of a draft token's acceptance
EXPLORE_EVERY = 8  # plain rounds between re-measurements


@dataclass
class GoodputState:
    calibration: float = 1.0  # observed accepted / predicted, EWMA
    plain_rounds: int = 0


class GoodputWindow:
    name = "goodput"

    def __init__(self, config: WindowConfig | None = None, costs: CostModel | None = None, **_):
        self.config = config or WindowConfig()
        self.costs = costs or CostModel()
        self.states: dict[int, GoodputState] = {}
        self.batch = 1  # sequences drafting together this round (set by the engine)

    def _survival(self, view: RoundView, drafted: int) -> float:
        state = self.states.setdefault(view.seq_id, GoodputState())
        a = 1.0
        for c in view.stats.draft_top1[:drafted]:
            a *= min(1.0, state.calibration * c)
        return a

    def _pays(self, expected: float, tokens_in_verify: int) -> bool:
        t_main = self.costs.seconds("main", 1)
        t_draft = self.costs.seconds("draft", self.batch)
        if t_main is None or t_draft is None:
            return expected >= 0.5  # no measurements yet
        marginal = (self.costs.seconds("main", tokens_in_verify + 1)
                    - self.costs.seconds("main", tokens_in_verify))
        return expected * t_main > t_draft / self.batch + max(0.0, marginal)

    def window(self, view: RoundView) -> int:
        state = self.states.setdefault(view.seq_id, GoodputState())
        s = view.stats
        first = s.acceptance_rate if s.draft_tokens else PRIOR_ACCEPT
        if self._pays(first, self.batch) or state.plain_rounds >= EXPLORE_EVERY:
            state.plain_rounds = 0
            return view.cap
        state.plain_rounds += 1
        return 0

    def keep_drafting(self, view: RoundView, drafted: int) -> bool:
        s = view.stats
        if drafted == 0 or not s.draft_top1:
            return True
        expected = self._survival(view, drafted) * s.draft_top1[drafted - 1]
        return self._pays(expected, self.batch * (drafted + 1))

    def observe(self, view: RoundView) -> None:
        s = view.stats
        if not s.last_window:
            return
        state = self.states.setdefault(view.seq_id, GoodputState())
        predicted = sum(self._survival(view, j) for j in range(1, s.last_window + 1))
        ratio = (s.last_accepted + 0.5) / (predicted + 0.5)
        state.calibration = min(1.5, max(0.3, state.calibration + 0.2 * (
            state.calibration * ratio - state.calibration)))

    def forget(self, seq_id: int) -> None:
        self.states.pop(seq_id, None)


def select_slots(survivals: list[list[float]], base_tokens: int, costs: CostModel) -> list[int]:
    """How many drafts to verify per sequence: the prefix of slots, by survival, that
    maximises expected tokens per second. survivals[i][j] = a_{j+1} of sequence i."""
    slots = sorted(((a, i) for i, seq in enumerate(survivals) for a in seq), reverse=True)
    keep = [0] * len(survivals)
    if costs.seconds("main", base_tokens) is None:
        return [len(s) for s in survivals]
    expected, best, chosen = float(len(survivals)), None, 0
    for k, (a, _) in enumerate([(0.0, -1)] + slots):
        expected += a
        rate = expected / costs.seconds("main", base_tokens + k)
        if best is None or rate > best:
            best, chosen = rate, k
    for _, i in slots[:chosen]:
        keep[i] += 1
    return keep
