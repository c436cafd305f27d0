"""Which drafting source pays for a sequence this round (the hybrid drafter's decision).

Every source is scored by expected tokens per second of the round, from measured costs
(costs.py) and the sequence's own running acceptance per position:

    plain            1 token for t_main(1)
    lookup, k        1 + sum_j a_j tokens for t_main(k + 1)           (drafting is free)
    model, w         1 + sum_j b_j tokens for t_draft(c) + (w - 1) t_step + t_main(w + 1)
                     (c: tokens the draft model reads in its first forward, at least the
                     main model's newest one; t_step: a draft forward after the round's
                     first, costs.py)

a_j is the lookup's survival to draft j (the product of its step confidences, calibrated
per sequence by what was accepted), b_j the model's survival to position j on this
sequence: the product of its acceptance at each position up to j among the rounds that
reached it, each shrunk toward its acceptance over all positions (_model_survival). A
source must beat plain decoding by MARGIN. A model that loses is re-measured with one
cheap round after `explore_every` rounds without it, and only once those rounds' time pays
for the trial's extra seconds EXPLORE_SHARE times over: a draft dearer than the main (a CPU
where its kernel is slow, a core taken by other work) is tried rarely enough that the
trials cost at most that share (re-tried at a fixed period, such a draft cost a quarter of
plain decoding's speed).

The costs leave out the engine's own per-round work and drift with the context, so rounds
take longer than predicted: for model rounds and for plain rounds alike, each tracked as
predicted / realized seconds. The model is scored by its own ratio relative to plain's;
scoring it by its own alone charged it for what plain decoding pays too, and turned most
rounds plain where the model was faster. Seconds, not tokens per second: a round's tokens
are luck the survivals already model, and a ratio of realized to predicted rates swung with
every rejected draft (a window-1 round realizes 1 or 2 tokens), so a few unlucky rounds
turned the model off for a sequence where drafting paid.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dspark.runtime.bundle.config import DraftingConfig
from dspark.runtime.model.costs import CostModel
from dspark.runtime.sequence.stats import SeqStats

PRIOR_ACCEPT = 0.7
PRIOR_WEIGHT = 2.0
POSITION_WEIGHT = 4.0  # rounds the pooled acceptance is worth at each draft position
MARGIN = 1.05
STEADY_BEHIND = 2  # tokens a draft model used every round reads before drafting
SMOOTHING = 0.2
EXPLORE_SHARE = 0.03  # of a sequence's time without the model, at most, for trials of it
LOOKUP = "lookup"  # the lookup drafter's source name (drafting/lookup.py)


@dataclass
class SourceState:
    calibration: dict[str, float] = field(default_factory=dict)  # observed / predicted, EWMA
    idle_rounds: int = 0  # rounds since the model was last tried
    idle_seconds: float = 0.0  # their predicted time as plain rounds
    speed: dict[str, float] = field(default_factory=dict)  # predicted / realized seconds
    predicted: tuple[str, float] | None = None  # this round's kind and predicted seconds

    def relative_speed(self) -> float:
        """The model rounds' predicted / realized seconds over plain rounds' (1 until both
        are measured)."""
        model, plain = self.speed.get("model"), self.speed.get("plain")
        return 1.0 if model is None or plain is None else model / plain


class SourceChooser:
    def __init__(self, config: DraftingConfig, costs: CostModel):
        self.config = config
        self.costs = costs
        self.states: dict[int, SourceState] = {}

    def configure(self, config) -> None:
        self.config = config.drafting

    def state(self, seq_id: int) -> SourceState:
        return self.states.setdefault(seq_id, SourceState())

    def survivals(self, seq_id: int, sources: list[str], confidence: list[float]) -> list[float]:
        """Calibrated survival to each pending draft. A calibration above 1 lifts only the
        first of a run of lookup drafts: it is learned mostly from first drafts (the cut
        proposals' shadows, the short verifies), and times the later drafts' step rates it
        made every step after the first certain: an unlikely first guess was priced as
        likely for each of its drafts, verified whole, and kept none. A calibration below 1
        lowers them all."""
        cal, a, out = self.state(seq_id).calibration, 1.0, []
        for i, (source, c) in enumerate(zip(sources, confidence)):
            factor = cal.get(source, 1.0)
            if source == LOOKUP and i and sources[i - 1] == LOOKUP:
                factor = min(1.0, factor)
            a *= min(1.0, factor * c)
            out.append(a)
        return out

    def observe(self, seq_id: int, source: str, predicted: float, accepted: int) -> None:
        """After a verify of drafts from `source` that predicted `predicted` accepted."""
        cal = self.state(seq_id).calibration
        old = cal.get(source, 1.0)
        ratio = (accepted + 0.5) / (predicted + 0.5)
        cal[source] = min(1.5, max(0.2, old + SMOOTHING * (old * ratio - old)))

    def expect(self, seq_id: int, seconds: float | None, kind: str = "model") -> None:
        """This round is a `kind` round (model or plain), predicted to take `seconds`."""
        self.state(seq_id).predicted = None if seconds is None else (kind, seconds)

    def observe_round(self, seq_id: int, seconds: float) -> None:
        """A round's realized seconds: what the cost model left out (context length,
        catch-up chunks, the engine's own work) shows as predicted / realized for its kind
        of round."""
        state = self.state(seq_id)
        if state.predicted and seconds > 0:
            kind, predicted = state.predicted
            ratio = predicted / seconds
            old = state.speed.get(kind)
            new = ratio if old is None else old + SMOOTHING * (ratio - old)
            state.speed[kind] = min(1.5, max(0.3, new))
        state.predicted = None

    def forget(self, seq_id: int) -> None:
        self.states.pop(seq_id, None)

    def rate(self, survivals: list[float], extra: int = 0, stats: SeqStats | None = None,
             behind: int = 0, overhead: float = 0.0) -> float | None:
        """Expected tokens per second of a round verifying the pending drafts (survivals)
        plus `extra` model drafts after them, the model first reading the `behind` tokens
        it has not seen; None while a needed cost is unmeasured. With nothing pending and
        no extra this is plain decoding's rate."""
        seconds = self.seconds(len(survivals), extra, behind, overhead)
        if seconds is None:
            return None
        last = survivals[-1] if survivals else 1.0
        return (1 + sum(survivals) + last * self._model_survival(stats, extra)) / seconds

    def seconds(self, pending: int, extra: int = 0, behind: int = 0,
                overhead: float = 0.0) -> float | None:
        """The predicted time of such a round (see rate); None while a cost is unmeasured."""
        tokens = pending + extra + 1
        t_main = self.costs.after_draft(tokens) if extra else self.costs.seconds("main", tokens)
        t_draft = 0.0
        if extra:
            first, step = self.costs.seconds("draft", max(1, behind)), self.costs.draft_step()
            if first is None or step is None:
                return None
            t_draft = first + (extra - 1) * step + overhead
        return None if t_main is None else t_draft + t_main

    @staticmethod
    def _model_survival(stats: SeqStats | None, extra: int) -> float:
        """sum_{j<=extra} b_j: the model's survival per position on this sequence,
        b_j = c_1 ... c_j with c_j the draft's acceptance at position j among the rounds
        that reached it (every draft before it held), shrunk toward its acceptance pooled
        over all positions (Leviathan's i.i.d. alpha) by POSITION_WEIGHT rounds.

        Survival measured per position directly (accepted / verified there, prior the
        position before times alpha, worth PRIOR_WEIGHT rounds) let one rejection at a
        rarely tried position end the trials there: a draft that held its first two tokens
        nearly always, its third tried once and rejected, priced that third low and never
        tried it again, where longer fixed windows made more.
        Counted among the rounds that reached it, the same third draft is 0 of 1 tried,
        which the pooled acceptance outweighs until it is tried again."""
        src = stats.sources.get("draft") if stats is not None else None
        accepted_at = src.accepted_at if src else []
        reached_at = src.reached_at if src else []
        alpha = (sum(accepted_at) + PRIOR_WEIGHT * PRIOR_ACCEPT) / (
            sum(reached_at) + PRIOR_WEIGHT)
        total, b = 0.0, 1.0
        for j in range(extra):
            reached = reached_at[j] if len(reached_at) > j else 0
            accepted = accepted_at[j] if len(accepted_at) > j else 0
            b *= (accepted + POSITION_WEIGHT * alpha) / (reached + POSITION_WEIGHT)
            total += b
        return total

    def catch_up(self, behind: int, left: int, stats: SeqStats, once: bool = True
                 ) -> float | None:
        """Seconds per round charged for reading `behind` tokens beyond a round's usual
        STEADY_BEHIND. `once` (the prompt the model never read): paid once, so spread over
        the rounds the model would serve in the `left` tokens still to generate (a long
        prompt is read only when enough output is left to earn it back). Otherwise (output
        it sat out while lookup rounds ran) all to this round: such a lag comes back with
        every switch from lookup to model, and spreading it made the hybrid switch too
        often (on edit prompts it fell well behind lookup alone)."""
        if behind <= STEADY_BEHIND:
            return 0.0
        full, steady = self.costs.seconds("draft", behind), self.costs.seconds(
            "draft", STEADY_BEHIND)
        if full is None or steady is None:
            return None
        if not once:
            return full - steady
        per_round = 1 + self._model_survival(stats, 2)
        return (full - steady) * per_round / max(1, left)

    def worth(self, survivals: list[float], sure: int = 0) -> int:
        """How many of the pending drafts (their survivals) to verify: the prefix with the
        most expected tokens per second, which must beat plain decoding by MARGIN (a
        verify of k+1 tokens costs more than a decode: a lookup that is seldom right loses
        to plain decoding); the first `sure` (forced by a grammar) always stay. All of
        them while a cost is unmeasured."""
        plain = self.rate([])
        if plain is None or len(survivals) <= sure:
            return len(survivals)
        best, best_rate = sure, (self.rate(survivals[:sure]) if sure else plain * MARGIN)
        for k in range(sure + 1, len(survivals) + 1):
            r = self.rate(survivals[:k])
            if r is not None and r > best_rate:
                best, best_rate = k, r
        return best

    def extension(self, seq_id: int, survivals: list[float], room: int, stats: SeqStats,
                  behind: int, overhead: float = 0.0) -> int | None:
        """Model drafts (0..room) to add after the pending ones for the most tokens per
        second; None while costs are unmeasured. Starting from nothing pending, the model
        must beat plain decoding by MARGIN."""
        base = self.rate(survivals)
        if base is None or self.rate(survivals, 1, stats, behind) is None:
            return None
        best, best_rate = 0, base * (1.0 if survivals else MARGIN)
        speed = self.state(seq_id).relative_speed()
        for extra in range(1, room + 1):
            r = speed * self.rate(survivals, extra, stats, behind, overhead)
            if r > best_rate:
                best, best_rate = extra, r
        return best

    def explore(self, seq_id: int, trial: float | None = None) -> bool:
        """Count a round without the model; True once `explore_every` such rounds have
        passed and their time covers `trial` (the predicted seconds of a one-draft model
        round) beyond a plain round's EXPLORE_SHARE times over."""
        state, plain = self.state(seq_id), self.seconds(0) or 0.0
        state.idle_rounds += 1
        state.idle_seconds += plain
        extra = max(0.0, (trial or plain) - plain)
        if (state.idle_rounds >= self.config.explore_every
                and state.idle_seconds * EXPLORE_SHARE >= extra):
            state.idle_rounds, state.idle_seconds = 0, 0.0
            return True
        return False
