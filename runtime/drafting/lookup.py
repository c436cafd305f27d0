"""The lookup drafter: proposes what followed earlier occurrences of the sequence's last
tokens in its own prompt + output, and (optionally) in its tenant's recent requests. No
forward pass: its proposals go straight to verification.

How far to trust a proposal is learned from verification: the first token's acceptance
by match length n (longer matches hold far more often; the priors below), and the chance
each next token holds once the previous did. A step's confidence is that rate times the
step's agreement among the matched occurrences. It drafts until the proposal's estimated
survival (the product of
step confidences) drops below `min_survival`; how many of those drafts are verified is
decided with the others' (the round's slot selection weighs each by its survival against
the verify's cost).

Where the sequence's own context (and its tenant's corpus) has no match, the bundle's
datastore of the model's own outputs (`datastore.py`) may propose; its proposals learn their
own rates (a corpus match is a weaker promise than a copy in the context), and the hybrid
does not take one as sure enough to skip the draft model (`from_store`).
"""

from __future__ import annotations

from collections import OrderedDict

from dspark.runtime.bundle.config import LookupConfig
from dspark.runtime.bundle.datastore import Datastore
from dspark.runtime.drafting.base import DraftWork
from dspark.runtime.drafting.ngram_index import NgramIndex
from dspark.runtime.sequence.request import Sequence

SOURCE = "lookup"
FIRST_PRIOR = {1: 0.15, 2: 0.4, 3: 0.65}  # n >= 4: LONG_PRIOR
LONG_PRIOR = 0.75
NEXT_PRIOR = 0.85
# a datastore match (the model's outputs on other prompts), measured on the q4 bundle's
# greedy outputs of the 12 peer prompts against a 60-prompt store: the first token held
# 20 / 34 / 32 / 62% of the time after a 1- / 2- / 3- / 4-token match (times the step's
# agreement, as here, 75% at n = 4)
STORE_FIRST_PRIOR = {1: 0.2, 2: 0.35, 3: 0.4}
STORE_LONG_PRIOR = 0.75
STORE_NEXT_PRIOR = 0.7
PRIOR_WEIGHT = 20.0  # observations the priors are worth


class MatchStats:
    """What verification taught about lookup proposals (engine-wide), from priors."""

    def __init__(self, max_n: int, first: dict[int, float] | None = None,
                 longer: float = LONG_PRIOR, following: float = NEXT_PRIOR):
        self.first = {n: [0, 0] for n in range(1, max_n + 1)}  # n -> [accepted, verified]
        self.next = [0, 0]  # a later token held, given the one before it did
        self.priors = (FIRST_PRIOR if first is None else first, longer, following)

    def first_rate(self, n: int) -> float:
        acc, tries = self.first.get(n, (0, 0))
        first, longer, _ = self.priors
        return (acc + PRIOR_WEIGHT * first.get(n, longer)) / (tries + PRIOR_WEIGHT)

    def next_rate(self) -> float:
        acc, tries = self.next
        return (acc + PRIOR_WEIGHT * self.priors[2]) / (tries + PRIOR_WEIGHT)

    def observe(self, n: int, verified: int, accepted: int) -> None:
        """A proposal (match length n) had `verified` tokens checked, `accepted` held."""
        if n not in self.first or not verified:
            return
        self.first[n][0] += accepted > 0
        self.first[n][1] += 1
        tried = min(accepted, verified - 1)  # later tokens whose predecessor held
        self.next[0] += max(0, accepted - 1)
        self.next[1] += tried


class TenantCorpus:
    """The last `size` finished sequences of each tenant, indexed (LRU by tenant)."""

    def __init__(self, size: int, tenants: int = 64):
        self.size, self.tenants = size, tenants
        self.corpora: OrderedDict[str, list[NgramIndex]] = OrderedDict()

    def add(self, tenant: str, index: NgramIndex) -> None:
        if self.size == 0:
            return
        corpus = self.corpora.setdefault(tenant, [])
        self.corpora.move_to_end(tenant)
        corpus.append(index)
        del corpus[:-self.size]
        while len(self.corpora) > self.tenants:
            self.corpora.popitem(last=False)

    def walk(self, tenant: str, tail: list[int], k: int) -> tuple[int, list[int], list[float]]:
        for index in reversed(self.corpora.get(tenant, [])):
            n, tokens, agree = index.walk(tail, k)
            if tokens:
                return n, tokens, agree
        return 0, [], []


class LookupDrafter:
    name = "lookup"

    def __init__(self, config: LookupConfig, store: Datastore | None = None):
        self.config = config
        self.indexes: dict[int, NgramIndex] = {}
        self.corpus = TenantCorpus(config.tenant_corpus_size)
        self.store = store
        # greedy and sampled requests learn apart: a sample follows the context less often;
        # context matches and datastore matches too
        self.stats = {(greedy, origin): MatchStats(
            max(config.max_ngram, store.max_n if store else 0),
            *((STORE_FIRST_PRIOR, STORE_LONG_PRIOR, STORE_NEXT_PRIOR) if origin else ()))
            for greedy in (True, False) for origin in (False, True)}
        self.match_len: dict[int, tuple[bool, int]] = {}  # seq id -> (from store, n) pending

    def configure(self, config) -> None:
        self.config = config.drafting.lookup

    def index(self, seq: Sequence) -> NgramIndex:
        cfg = self.config
        index = self.indexes.get(seq.id)
        if index is None:
            index = self.indexes[seq.id] = NgramIndex(cfg.min_ngram, cfg.max_ngram,
                                                      cfg.max_occurrences)
        index.sync(seq.tokens)
        return index

    def propose(self, work: list[DraftWork]) -> None:
        for w in work:
            want = w.window - len(w.state)
            if want <= 0:
                continue
            tail = (w.seq.tokens[-self.config.max_ngram:] + w.state.tokens)[
                -self.config.max_ngram:]
            n, tokens, agree = self.index(w.seq).walk(tail, want)
            if not tokens:
                n, tokens, agree = self.corpus.walk(w.seq.tenant, tail, want)
            stored = not tokens and self.store is not None and self.config.use_store
            if stored:
                n, tokens, agree = self.store.walk(
                    (w.seq.tokens[-self.store.max_n:] + w.state.tokens)[-self.store.max_n:],
                    want)
            stats = self.stats[w.seq.request.sampling.greedy, stored]
            survival, rate, added = 1.0, stats.first_rate(n), 0
            for token, a in zip(tokens, agree):
                survival *= rate * a
                if survival < self.config.min_survival:
                    break
                w.state.add(token, SOURCE, None, rate * a)
                rate, added = stats.next_rate(), added + 1
            if added:
                self.match_len[w.seq.id] = (stored, n)

    def from_store(self, seq: Sequence) -> bool:
        """Whether the sequence's pending lookup proposal came from the datastore."""
        return self.match_len.get(seq.id, (False, 0))[0]

    def observe(self, seq: Sequence, verified: int, accepted: int) -> None:
        """Verification of the sequence's leading pending lookup drafts."""
        stored, n = self.match_len.get(seq.id, (False, 0))
        self.stats[seq.request.sampling.greedy, stored].observe(n, verified, accepted)

    def trim(self, seq: Sequence, valid: int) -> None:
        pass  # the index covers accepted tokens only, which never roll back

    def release(self, seq: Sequence) -> None:
        self.match_len.pop(seq.id, None)
        index = self.indexes.pop(seq.id, None)
        if index is not None:
            index.sync(seq.tokens)
            self.corpus.add(seq.tenant, index)
