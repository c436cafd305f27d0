"""The hybrid drafter: per sequence and round, the lookup, the draft model, both (a lookup
prefix extended by the model) or nothing, by expected accepted tokens per second.

    lookup   the lookup drafter proposes (free) up to the slot's lookup cap; a proposal whose
             first draft is at least `lookup_trust` likely is verified alone (letting the
             model compete there cost edit prompts a good part of their gain)
    extend   otherwise, with P the pending drafts' survivals (lookup, held drafts), the model may
             add w drafts, w in 0..window, scored by SourceChooser:
                 (1 + sum P + P_last * sum_j b_j) / (w t_draft + t_main(|P| + w + 1))
             or replace them (P dropped, w >= 1), whichever promises more; w = 0 with
             nothing pending is a plain round (re-measured now and then)
    model    method "draft": the window policy's window, as it decides, no cost gate

It owns every sequence's DraftState and hands each drafter its part; `settle` is the one
place where verification's outcome reaches the drafters (statistics, calibration, caches).
"""

from __future__ import annotations

from dspark.runtime.dflash.source import STEADY_BEHIND, SourceChooser
from dspark.runtime.drafting.base import DraftJob, DraftWork, Proposed
from dspark.runtime.drafting.lookup import LookupDrafter
from dspark.runtime.drafting.model import ModelDrafter
from dspark.runtime.drafting.state import DraftState, settle
from dspark.runtime.sequence.request import Sequence

FORCED = "grammar"  # the source name of forced drafts


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


def _forced(st: DraftState) -> int:
    """How many pending drafts, from the first, a grammar forced (sure, free)."""
    return next((i for i, s in enumerate(st.sources) if s != FORCED), len(st.sources))


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
        st = self.states.get(seq.id)
        if st is None:
            st = self.states[seq.id] = DraftState()
        return st

    def rests(self, seq: Sequence) -> bool:
        """A lookup-only sequence with nothing pending, no grammar, and its lookups backed
        off this round (the round's skip is spent): a plain round with nothing to do. Asked
        once per round, before `propose` (the planner leaves such a slot plain)."""
        st = self.states.get(seq.id)
        return ((st is None or not len(st)) and seq.constraint is None
                and not self.backoff.ready(seq.id))

    def survivals(self, seq: Sequence, count: int | None = None) -> list[float]:
        st = self.state(seq)
        n = len(st) if count is None else count
        return self.chooser.survivals(seq.id, st.sources[:n], st.confidence[:n])

    def propose(self, jobs: list[DraftJob]) -> list[Proposed]:
        """Fill each job's pending drafts; per job the source used (plain, lookup, draft or
        lookup+draft; held drafts count as what proposed them), its lookup cap, raised to
        take a grammar's forced tokens, and the pending drafts. A grammar's sequence starts
        from the tokens it forces (free drafts), and its drafts end at the first one the
        grammar forbids. The jobs are those the planner did not leave plain (`rests`)."""
        working = [self._force(j) for j in jobs]
        self._fill(working)
        return [self._proposed(j) for j in working]

    def _proposed(self, job: DraftJob) -> Proposed:
        st = self.state(job.seq)
        survivals = tuple(self.survivals(job.seq)) if "lookup" in st.sources else ()
        return Proposed(self._used(st), job.lookup, st, survivals)

    def _fill(self, jobs: list[DraftJob]) -> None:
        """The lookup's drafts, those not worth their verify dropped, then the model's."""
        caps = {j.seq.id: j.lookup for j in jobs if j.method != "draft" and j.lookup
                and self.backoff.ready(j.seq.id)}
        self.lookup.propose([DraftWork(j.seq, self.state(j.seq),
                                       len(self.state(j.seq)) + caps[j.seq.id])
                             for j in jobs if j.seq.id in caps])
        model_work = []
        for seq, method, window, _, _, room, catch_up, keep in jobs:
            st = self.state(seq)
            if method != "draft":  # pending drafts that would not pay their verify go
                before = len(st)
                survivals = self.survivals(seq)
                paying = self.chooser.worth(survivals, _forced(st))
                if not paying and before and st.sources[0] == "lookup":
                    self.shadow[seq.id] = (st.tokens[0], survivals[0])
                self.truncate(seq, paying)
                if seq.id in caps:
                    self.backoff.record(seq.id, kept=len(st) > _forced(st) and before > 0)
            extra = self._extension(seq, window) if method == "hybrid" else window
            if method == "draft":
                extra = window - len(st)
            if extra > 0 and self.model is not None and method != "lookup":
                model_work.append(DraftWork(seq, st, len(st) + extra, keep, room, catch_up))
        if self.model is not None:
            self.model.propose(model_work)
        for j in jobs:
            if j.seq.constraint is not None:
                self.truncate(j.seq, j.seq.constraint.valid_prefix(self.state(j.seq).tokens))

    def _force(self, job: DraftJob) -> DraftJob:
        """A grammar's forced tokens become pending drafts when nothing is pending and the
        sequence is at its end; the lookup cap lets the verify take them all."""
        seq = job.seq
        if seq.constraint is None or len(self.state(seq)) or not job.at_end:
            return job
        left = seq.request.max_tokens - len(seq.generated) - 1
        forced = seq.constraint.forced()[:max(0, left)]
        for token in forced:
            self.state(seq).add(token, FORCED)
        return job._replace(lookup=max(job.lookup, len(forced)))

    def _extension(self, seq: Sequence, window: int) -> int:
        """How many model drafts to add after what is pending (see the module doc); drops
        the pending drafts when the model alone promises more."""
        pending = self.survivals(seq)
        if self.model is None or window <= 0:
            return 0
        if (pending and pending[0] >= self.chooser.config.lookup_trust
                and not self.lookup.from_store(seq)):
            return 0  # a confident lookup: verified as is, no draft forward spent
        # The model's catch-up beyond a round's usual one or two tokens: a prompt it never
        # read is paid once (spread over the output left), output it sat out in lookup
        # rounds is charged to this round (SourceChooser.catch_up).
        lag = len(seq.tokens) - min(self.model.cached(seq), len(seq.tokens))
        left = seq.request.max_tokens - len(seq.generated)
        read_prompt = self.model.cached(seq) >= seq.prompt_len
        overhead = self.chooser.catch_up(lag, left, seq.stats, once=not read_prompt)
        if overhead is None:
            return 0 if pending else window
        behind = min(STEADY_BEHIND, lag)
        choose = self.chooser
        keep = choose.extension(seq.id, pending, window - len(pending), seq.stats,
                                behind + len(pending), overhead)
        if keep is None:  # costs unmeasured: the policy's window where nothing is pending
            return 0 if pending else window
        chosen = (pending, keep, behind + len(pending))
        if pending:
            alone = choose.extension(seq.id, [], window, seq.stats, behind, overhead)
            if alone and choose.rate([], alone, seq.stats, behind, overhead) > choose.rate(
                    pending, keep, seq.stats, behind + len(pending), overhead):
                self._drop_pending(seq)
                chosen = ([], alone, behind)
        elif not keep and choose.explore(seq.id, choose.seconds(0, 1, behind, overhead)):
            chosen = ([], 1, behind)
        survivals, extra, read = chosen
        if extra and (lag <= STEADY_BEHIND or read_prompt):  # a prompt catch-up says little
            choose.expect(seq.id, choose.seconds(len(survivals), extra, read, overhead))
        elif not extra and not survivals:
            choose.expect(seq.id, choose.seconds(0), "plain")
        return extra

    def truncate(self, seq: Sequence, keep: int) -> None:
        """Keep only the first `keep` pending drafts."""
        st = self.state(seq)
        if keep < len(st):
            st.truncate(keep)
            for drafter in self.drafters:
                drafter.trim(seq, len(seq.tokens) + keep)

    def _drop_pending(self, seq: Sequence) -> None:
        self.state(seq).clear()
        for drafter in self.drafters:
            drafter.trim(seq, len(seq.tokens))

    @staticmethod
    def _used(st: DraftState) -> str:
        used = sorted(set(st.sources))
        return "+".join(used) if used else "plain"

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
