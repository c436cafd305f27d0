"""The hybrid drafting: every sequence's pending drafts and the drafters that fill them (the
lookup, a draft model), doing what the round's decision (engine/decide.py) tells it:

    force, look_up      a grammar's forced tokens; the lookups' proposals (free)
    cut, drop           keep the drafts worth their verify; drop them all
    draft, constrain    the draft model's proposals; a grammar's cut at its first forbidden
    model_lag, ...      the facts the decision reads (what the model has not read, the
                        pending drafts' calibrated survivals, the SourceChooser)

It owns every sequence's DraftState and hands each drafter its part; `settle` is the one
place where verification's outcome reaches the drafters (statistics, calibration, caches).
"""

from __future__ import annotations

from dspark.runtime.dflash.source import SourceChooser
from dspark.runtime.drafting.base import DraftWork
from dspark.runtime.drafting.lookup import LookupDrafter
from dspark.runtime.drafting.model import ModelDrafter
from dspark.runtime.drafting.state import FORCED, DraftState, settle
from dspark.runtime.sequence.request import Sequence


class Backoff:
    """When to look up again for a sequence whose lookups paid nothing: each round whose
    lookup kept no draft (no match, or none worth its verify) doubles the rounds skipped
    before the next lookup, up to MAX_SKIP; one kept draft resets it. The lookup's walk
    costs a few percent of a small model's step: a chat whose drafts never paid ran slower
    than plain decoding."""

    MAX_SKIP = 16

    def __init__(self):
        self.misses: dict[int, int] = {}
        self.skip: dict[int, int] = {}

    def ready(self, seq_id: int) -> bool:
        left = self.skip.get(seq_id, 0)
        if left:
            self.skip[seq_id] = left - 1
        return not left

    def record(self, seq_id: int, kept: bool) -> None:
        misses = 0 if kept else self.misses.get(seq_id, 0) + 1
        self.misses[seq_id] = misses
        self.skip[seq_id] = min(self.MAX_SKIP, (1 << misses) - 1) if misses > 1 else 0

    def forget(self, seq_id: int) -> None:
        self.misses.pop(seq_id, None)
        self.skip.pop(seq_id, None)


class HybridDrafter:
    name = "hybrid"

    def __init__(self, lookup: LookupDrafter, model: ModelDrafter | None,
                 chooser: SourceChooser):
        self.lookup = lookup
        self.model = model
        self.chooser = chooser
        self.states: dict[int, DraftState] = {}
        self.backoff = Backoff()
        # seq id -> (first lookup draft, its survival) of a proposal cut before its verify:
        # the round's own token says whether it would have held, and the calibration learns
        # from it for free (on chat prompts a verified lookup's drafts held 2-3x less often
        # than predicted, and most proposals are cut, so verifies alone taught it too late)
        self.shadow: dict[int, tuple[int, float]] = {}

    def configure(self, config) -> None:
        """A new DFlashConfig, between steps."""
        self.lookup.configure(config)
        self.chooser.configure(config)

    def use_draft(self, role: str) -> None:
        """The draft model sequences use from their next round (RAS's choice)."""
        if self.model is not None:
            self.model.default = role

    @property
    def default_draft(self) -> str | None:
        return self.model.default if self.model is not None else None

    @property
    def drafters(self) -> list:
        return [d for d in (self.lookup, self.model) if d is not None]

    def state(self, seq: Sequence) -> DraftState:
        """The sequence's pending drafts (an empty buffer on first use)."""
        st = self.states.get(seq.id)
        if st is None:
            st = self.states[seq.id] = DraftState()
        return st

    def rests(self, seq: Sequence) -> bool:
        """A lookup-only sequence with nothing pending, no grammar, and its lookups backed
        off this round (the round's skip is spent): a plain round with nothing to do. Asked
        once per round, before any drafting (the decision leaves such a slot plain)."""
        st = self.states.get(seq.id)
        return ((st is None or not len(st)) and seq.constraint is None
                and not self.backoff.ready(seq.id))

    def survivals(self, seq: Sequence, count: int | None = None) -> list[float]:
        st = self.state(seq)
        n = len(st) if count is None else count
        return self.chooser.survivals(seq.id, st.sources[:n], st.confidence[:n])

    @property
    def has_model(self) -> bool:
        return self.model is not None

    def force(self, seq: Sequence, limit: int) -> int:
        """A grammar's forced tokens (at most `limit`) as pending drafts, where the sequence
        has a grammar and nothing pending; how many."""
        if seq.constraint is None or len(self.state(seq)):
            return 0
        forced = seq.constraint.forced()[:max(0, limit)]
        for token in forced:
            self.state(seq).add(token, FORCED)
        return len(forced)

    def look_up(self, caps: list[tuple[Sequence, int]]) -> set[int]:
        """The lookups propose, each up to its cap after what is pending, for the sequences
        whose lookups are not backed off this round; their ids."""
        ready = [(seq, cap) for seq, cap in caps if self.backoff.ready(seq.id)]
        self.lookup.propose([DraftWork(seq, self.state(seq), len(self.state(seq)) + cap)
                             for seq, cap in ready])
        return {seq.id for seq, _ in ready}

    def cut(self, seq: Sequence, keep: int, looked_up: bool) -> None:
        """Keep the first `keep` pending drafts (those worth their verify). A lookup's
        proposal cut whole is remembered (`shadow`); a sequence that looked up this round
        backs off its lookups while they keep nothing."""
        st = self.state(seq)
        before = len(st)
        if not keep and before and st.sources[0] == "lookup":
            self.shadow[seq.id] = (st.tokens[0], self.survivals(seq)[0])
        self.truncate(seq, keep)
        if looked_up:
            self.backoff.record(seq.id, kept=len(st) > st.forced and before > 0)

    def model_lag(self, seq: Sequence) -> tuple[int, bool] | None:
        """(tokens the draft model has not read, whether it read the prompt); None without
        a draft model."""
        if self.model is None:
            return None
        cached = self.model.cached(seq)
        return len(seq.tokens) - min(cached, len(seq.tokens)), cached >= seq.prompt_len

    def from_store(self, seq: Sequence) -> bool:
        """Did the pending lookup drafts come from the bundle's datastore?"""
        return self.lookup.from_store(seq)

    def draft(self, work: list[DraftWork]) -> None:
        """The draft model proposes (`work`: each sequence's target and rule)."""
        if self.model is not None:
            self.model.propose(work)

    def constrain(self, seq: Sequence) -> None:
        """A grammar's sequence keeps its drafts up to the first the grammar forbids."""
        if seq.constraint is not None:
            self.truncate(seq, seq.constraint.valid_prefix(self.state(seq).tokens))

    def drop(self, seq: Sequence) -> None:
        """Drop every pending draft."""
        self.state(seq).clear()
        for drafter in self.drafters:
            drafter.trim(seq, len(seq.tokens))

    def truncate(self, seq: Sequence, keep: int) -> None:
        """Keep only the first `keep` pending drafts."""
        st = self.state(seq)
        if keep < len(st):
            st.truncate(keep)
            for drafter in self.drafters:
                drafter.trim(seq, len(seq.tokens) + keep)

    def settle(self, seq: Sequence, old_len: int, verified: int, accepted: int,
               main_token: int, seconds: float) -> None:
        """Verification's outcome: statistics per source, calibration, drafters' caches.
        `old_len`: the sequence's length before this round's tokens were appended;
        `seconds`: the round's drafting and verify time."""
        self.chooser.observe_round(seq.id, seconds)
        shadow = self.shadow.pop(seq.id, None)
        if shadow is not None and not verified:  # a lookup cut unverified: would it have held?
            token, survival = shadow
            self.chooser.observe(seq.id, "lookup", survival, int(token == main_token))
        st = self.state(seq)
        if not verified and not len(st):  # a plain round: nothing more to learn or to trim
            return
        sources = st.sources[:verified]
        survivals = self.survivals(seq, verified)
        seq.stats.record_sources(sources, accepted)
        lead = next((i for i, s in enumerate(sources) if s != "lookup"), len(sources))
        if lead:
            self.lookup.observe(seq, lead, min(accepted, lead))
        for source in set(sources):
            mine = [i for i, s in enumerate(sources) if s == source]
            self.chooser.observe(seq.id, source, sum(survivals[i] for i in mine),
                                 sum(i < accepted for i in mine))
        valid = old_len + settle(st, verified, accepted, main_token)
        for drafter in self.drafters:
            drafter.trim(seq, valid)

    def release(self, seq: Sequence) -> None:
        self.states.pop(seq.id, None)
        self.shadow.pop(seq.id, None)
        self.backoff.forget(seq.id)
        self.chooser.forget(seq.id)
        for drafter in self.drafters:
            drafter.release(seq)
