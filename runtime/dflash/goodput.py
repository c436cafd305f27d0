"""Goodput: draft and verify the slots whose expected accepted tokens pay for their cost.

From the draft's per-position confidence c_i (its top-1 probability, calibrated per request
against what was actually accepted), the survival probability of position j is
a_j = prod_{i<=j} c_i: the chance the verify keeps it. A round with j drafts per sequence
(the batch's B sequences alike) takes R(j) = j * t_draft(B) + t_main(B * (j + 1)) and yields
1 + sum_{i<=j} a_i tokens per sequence, so one more draft is worth it when it raises that
rate:

    (1 + sum_{i<=j} a_i + a_{j+1}) / R(j + 1)  >  (1 + sum_{i<=j} a_i) / R(j)

with a_{j+1} estimated as a_j * c_j before it is drafted. (Comparing the new token's gain
with plain decoding's rate instead, as a first version did, drafts too long wherever
speculation already pays.) Across
the batch `select_slots` keeps the (request, position) slots, in order of a_j, that maximise
expected tokens per second of the verify: (n + sum a) / t_main(T). Window 0 (plain
decoding) is chosen when even the first draft does not raise the rate; every few plain
rounds one window is drafted to re-measure.
"""

from __future__ import annotations

from dataclasses import dataclass

from dspark.runtime.bundle.config import WindowConfig
from dspark.runtime.dflash.policy import RoundView
from dspark.runtime.model.costs import CostModel

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
        self.batch = 1  # sequences drafting together this round

    def begin_round(self, drafting: int) -> None:
        self.batch = max(1, drafting)

    def survival(self, view: RoundView, drafted: int) -> float:
        state = self.states.setdefault(view.seq_id, GoodputState())
        a = 1.0
        for c in view.confidence[:drafted]:
            a *= min(1.0, state.calibration * c)
        return a

    def _round_time(self, drafted: int) -> float | None:
        n = self.batch
        t_first, t_step = self.costs.seconds("draft", n, n), self.costs.draft_step(n, n)
        t_verify = self.costs.seconds("main", n * (drafted + 1), n)
        if t_first is None or t_step is None or t_verify is None:
            return None
        return (t_first + (drafted - 1) * t_step if drafted else 0.0) + t_verify

    def _improves(self, expected: float, next_a: float, drafted: int) -> bool:
        """Does a draft beyond `drafted` (worth `next_a`) raise tokens per second of the
        round, which already expects `expected` accepted drafts?"""
        now, more = self._round_time(drafted), self._round_time(drafted + 1)
        if now is None or more is None:
            return next_a >= 0.5  # no measurements yet
        return (1 + expected + next_a) * now > (1 + expected) * more

    def window(self, view: RoundView) -> int:
        state = self.states.setdefault(view.seq_id, GoodputState())
        s = view.stats
        first = s.acceptance_rate if s.draft_tokens else PRIOR_ACCEPT
        if self._improves(0.0, first, 0) or state.plain_rounds >= EXPLORE_EVERY:
            state.plain_rounds = 0
            return view.cap
        state.plain_rounds += 1
        return 0

    def keep_drafting(self, view: RoundView, drafted: int) -> bool:
        if drafted == 0 or not view.confidence:
            return True
        survivals = [self.survival(view, j) for j in range(1, drafted + 1)]
        return self._improves(sum(survivals), survivals[-1] * view.confidence[drafted - 1],
                              drafted)

    def observe(self, view: RoundView) -> None:
        s = view.stats
        if not s.last_window:
            return
        state = self.states.setdefault(view.seq_id, GoodputState())
        predicted = sum(self.survival(view, j) for j in range(1, s.last_window + 1))
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
