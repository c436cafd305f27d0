"""The draft-model drafter: every sequence drafts up to its window, all in one forward per
position.

A sequence's draft input is what the draft model has not seen of `tokens + pending` (its
catch-up: the prompt, the last round's accepted tokens, held drafts, a lookup prefix), then
each new draft. Long catch-ups are fed in chunks with no draft that round, like prompts are
to the main. Per drafted position the draft's confidence is recorded: its top-1 probability
and the entropy of its renormalised top-3, for the window policies.

A draft with the main's cache geometry and token ids (a quantized copy of the main, the
common self-speculative pair) reads the main's KV cache instead of keeping its own
(`drafting.share_main_kv`): everything the main has cached counts as read, so it never
prefills the prompt or catches up on tokens it sat out, only the main's newest token and
its drafts; it writes their K/V into the main's pool past the main's length, where the
main's verify overwrites them before reading them (append, then attend) and a rejection
leaves them past the main's length again. Output is the main's alone either way; only the
proposals change (an int4 copy reading fp32 K/V).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from dspark.runtime.bundle.token_map import TokenMap
from dspark.runtime.cache.kv_arena import KVArena
from dspark.runtime.drafting.base import DraftWork
from dspark.runtime.model.costs import DRAFT_STEP
from dspark.runtime.model.runner import ModelRunner
from dspark.runtime.sequence.request import Sequence
from dspark.runtime.sequence.sampling import probabilities, sample

SOURCE = "draft"


def confidence(p: np.ndarray) -> tuple[float, float]:
    """(top-1 probability, entropy in nats of the renormalised top-3) of a distribution."""
    top3 = np.partition(p, -3)[-3:]
    top3 = top3 / top3.sum()
    top3 = top3[top3 > 0]
    return float(p.max()), float(-(top3 * np.log(top3)).sum())


def greedy_confidence(logits: np.ndarray) -> tuple[float, float]:
    """confidence() of softmax(logits) without building the float64 distribution (greedy
    drafting needs only these two numbers, every drafted token): one exp pass in place, and
    the top 3 by argmax, not a partition of the vocabulary (nearly half the time a draft
    token on large vocabularies)."""
    first = int(logits.argmax())
    e = np.subtract(logits, logits[first])
    np.exp(e, out=e)
    total = float(e.sum())
    e[first] = -1.0  # exp values are >= 0: the next argmax is the second largest
    second = int(e.argmax())
    top2 = e[second]
    e[second] = -1.0
    top3 = np.array([1.0, top2, e.max()], np.float64) / total
    return 1.0 / total, confidence(top3)[1]


@dataclass
class DraftCache:
    """Where one sequence's draft-model cache stands."""

    role: str
    cached: int = 0  # tokens of `tokens + pending` the draft model has read
    offsets: list[int] = field(default_factory=lambda: [0])  # its positions after each


def _read_main(cache: DraftCache, main_cached: int) -> None:
    """A shared-cache draft has read whatever the main's cache holds (one position per
    token: shared drafts have no token map)."""
    if cache.cached < main_cached:
        cache.offsets.extend(range(len(cache.offsets), main_cached + 1))
        cache.cached = main_cached


class ModelDrafter:
    name = "draft"

    def __init__(self, runners: dict[str, ModelRunner], arena: KVArena, default: str,
                 token_maps: dict[str, TokenMap], shared: frozenset[str] = frozenset(),
                 commit: Callable[[Sequence, str, int], None] | None = None):
        """token_maps: draft role -> its map to main ids (where tokenizers differ); shared:
        the roles that read the main's KV cache (their runners' pool is the main's, see the
        module doc). Each DraftWork says how far a sequence may fill (room) and how many
        tokens a catch-up forward reads. `commit(seq, pool, final)`: a draft's own cache is
        final below `final` (the prefix cache keeps it; its window groups drop what they
        no longer reach)."""
        self.shared = shared
        self.commit = commit
        self.runners = runners
        self.arena = arena
        self.default = default  # RAS may switch it; sequences follow from their next round
        self.token_maps = token_maps
        self.caches: dict[int, DraftCache] = {}
        self.room_stalls = 0  # draft windows cut short by a sequence's reservation

    def _bind(self, w: DraftWork) -> DraftCache:
        """The draft this sequence uses this round. On a change its cache starts empty (it
        catches up in chunks) and pending drafts are dropped; output is unaffected."""
        role = w.seq.request.draft_model or self.default
        cache = self.caches.get(w.seq.id)
        if cache is None or cache.role != role:
            found = 0
            if cache is not None:
                if cache.role not in self.shared:  # never cut the main's own cache
                    self.arena.rollback(w.seq.id, self.runners[cache.role].pool, 0)
                w.state.clear()
            elif self._own(role):  # what the prefix cache found of its prompt
                found = self.arena.tables[w.seq.id].length(self.runners[role].pool)
            cache = self.caches[w.seq.id] = DraftCache(role, found, list(range(found + 1)))
        return cache

    def _own(self, role: str) -> bool:
        """Does `role` keep its own cache at the main's token positions?"""
        return role not in self.shared and role not in self.token_maps

    def propose(self, work: list[DraftWork]) -> None:
        groups: dict[str, list[DraftWork]] = {}
        for w in work:
            groups.setdefault(self._bind(w).role, []).append(w)
        for role, group in groups.items():
            self._draft(self.runners[role], group, self.token_maps.get(role))

    def _draft(self, runner: ModelRunner, work: list[DraftWork], tmap: TokenMap | None) -> None:
        """Draft for every sequence with window > pending, batched per position. With a
        token map the draft reads main tokens translated to its ids (expansions can run
        ahead of the main's positions, up to the sequence's room)."""
        active = [w for w in work if w.window > len(w.state)]
        role = "draft"  # the round's first forward's cost row, then DRAFT_STEP (costs.py)
        while active:
            chunks, rows, fed, live = [], [], [], []
            for w in active:
                cache = self.caches[w.seq.id]
                if cache.role in self.shared:
                    _read_main(cache, w.seq.main_cached)
                behind = w.seq.tokens + w.state.tokens
                if cache.cached >= len(behind):  # all read (pending drafts it read were
                    self.trim(w.seq, len(behind) - 1)  # dropped): re-read the last token
                feed = behind[cache.cached:cache.cached + w.catch_up]
                pieces = [tmap.pieces(t) for t in feed] if tmap else [[t] for t in feed]
                width = sum(len(p) for p in pieces)
                if cache.offsets[-1] + width > w.room:
                    w.window = len(w.state)  # no room left for the draft: no more drafts
                    self.room_stalls += 1
                    continue
                chunks.append((w.seq.id, cache.offsets[-1], [d for p in pieces for d in p]))
                rows.append(1 if cache.cached + len(feed) == len(behind) else 0)
                fed.append(pieces)
                live.append(w)
            if not live:
                return
            t0 = time.perf_counter()
            logits = runner.forward(chunks, rows, record=False)
            for w, pieces, out, row in zip(live, fed, logits, rows):
                cache = self.caches[w.seq.id]
                for p in pieces:
                    cache.offsets.append(cache.offsets[-1] + len(p))
                cache.cached += len(pieces)
                self._commit(w.seq, cache)
                if not row or not draw(w, out[-1], tmap):
                    w.window = len(w.state)  # catching up, or an unmapped token: stop
            if runner.costs is not None:  # a draft costs its forward and its draw
                runner.costs.record(role, sum(len(c[2]) for c in chunks),
                                    time.perf_counter() - t0, len(chunks))
            role = DRAFT_STEP
            active = [w for w in live if w.window > len(w.state)
                      and (w.keep is None or w.keep.keep(w.state.confidence, len(w.state)))]

    def cached(self, seq: Sequence) -> int:
        """Tokens of `tokens + pending` the sequence's draft cache holds (0: none yet)."""
        role = seq.request.draft_model or self.default
        cache = self.caches.get(seq.id)
        cached = cache.cached if cache is not None and cache.role == role else 0
        return max(cached, seq.main_cached) if role in self.shared else cached

    def trim(self, seq: Sequence, valid: int) -> None:
        """`tokens + pending` is unchanged through position `valid`: roll the cache back."""
        cache = self.caches.get(seq.id)
        if cache is None:
            return
        if cache.cached > valid:
            cache.cached = valid
            del cache.offsets[valid + 1:]
            if cache.role not in self.shared:  # the main rolls its own cache back
                self.arena.rollback(seq.id, self.runners[cache.role].pool, cache.offsets[-1])
        self._commit(seq, cache)

    def _commit(self, seq: Sequence, cache: DraftCache) -> None:
        """A draft with a cache of its own: what it read of the sequence's tokens is final
        but the last (a re-read of it rewrites it)."""
        if self.commit is not None and cache.role not in self.shared:
            read = cache.offsets[min(cache.cached, len(seq.tokens))]
            self.commit(seq, self.runners[cache.role].pool, read - 1)

    def release(self, seq: Sequence) -> None:
        self.caches.pop(seq.id, None)


def draw(w: DraftWork, logits: np.ndarray, tmap: TokenMap | None) -> bool:
    """Append one draft token (greedy, or sampled from the processed q) as a main id;
    False when the draft's token has no main equivalent (the window ends). The request's
    logits processors shape the draft's row as they shape the main's (not through a token
    map: its rows are in the draft's ids)."""
    seq, params = w.seq, w.seq.request.sampling
    if seq.processors is not None and tmap is None:  # propose from what the main will score
        logits = seq.processors.row(logits, w.state.tokens)
    if params.greedy:
        token = int(logits.argmax())
        q = None
    else:
        q = probabilities(logits, params)
        if tmap is not None:  # propose only mapped tokens: sample from q restricted to them
            mapped = np.where(tmap.draft_to_main >= 0, q, 0.0)
            if mapped.sum() <= 0:
                return False
            token = sample(mapped / mapped.sum(), seq.rng)
        else:
            token = sample(q, seq.rng)
    if tmap is not None:
        token = int(tmap.draft_to_main[token])
        if token < 0:
            return False
    top1, entropy = greedy_confidence(logits) if q is None else confidence(q)
    proposal = None
    if q is not None:
        proposal = tmap.main_probabilities(q)[0] if tmap is not None else q
    w.state.add(token, SOURCE, proposal, top1, entropy)
    return True


def bundle_drafter(bundle, runners: dict, arena, draft: str, shared_kv, commit
                   ) -> ModelDrafter | None:
    """The bundle's draft models (`runners`) as a drafter, or None without any (each
    round's DraftWork says how far a sequence may fill: its reservation, and how many tokens
    a catch-up reads: a prompt chunk)."""
    if not runners:
        return None
    maps = {"draft": bundle.token_map} if bundle.token_map is not None else {}
    return ModelDrafter(runners, arena, draft, maps, shared_kv, commit)
