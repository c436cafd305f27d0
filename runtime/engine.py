"""The engine: continuous batching with speculative decoding, one batch per step.

    step: admit -> draft w tokens per sequence -> verify w+1 in one main forward
          -> accept (pure function) -> roll back the caches -> emit
Prefill is not a separate phase: a new sequence's prompt rides in the first draft forward
(draft prefill) and the first verify forward (main prefill), flattened with everyone else.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from dspark.runtime.acceptance import Acceptance, accept_greedy, accept_sampled
from dspark.runtime.bundle import Bundle
from dspark.runtime.errors import DSparkError
from dspark.runtime.kv_arena import KVArena
from dspark.runtime.model_runner import ModelRunner
from dspark.runtime.request import GenerationRequest, Sequence
from dspark.runtime.sampling import probabilities, sample
from dspark.runtime.window import FixedWindow, WindowPolicy


class Engine:
    def __init__(self, bundle: Bundle, policy: WindowPolicy | None = None, max_batch: int = 16,
                 eos_ids: tuple[int, ...] = (), decode: Callable[[list[int]], str] | None = None):
        self.plan = bundle.plan
        self.config = bundle.config
        self.arena = KVArena(self.plan)
        self.main = ModelRunner(bundle, "main", self.arena)
        self.draft = ModelRunner(bundle, "draft", self.arena)
        self.vocab_size = bundle.model("main").vocab_size
        self.policy = policy or FixedWindow(self.config.window.initial)
        self.max_batch = max_batch
        self.eos_ids = frozenset(eos_ids)
        self.decode = decode
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.reserved: dict[int, int] = {}  # blocks each running sequence may grow to
        self.ids = itertools.count()

    def step(self) -> list[Sequence]:
        """One engine step; returns the sequences it advanced (finished ones included)."""
        batch = self.schedule()
        if batch:
            self.propose(batch)
            logits = self.verify(batch)
            for seq, rows in zip(batch, logits):
                self.emit(seq, self.accept(seq, rows))
            self.retire(batch)
        return batch

    def submit(self, request: GenerationRequest) -> Sequence:
        self.check(request)
        seq = Sequence(next(self.ids), request)
        self.waiting.append(seq)
        return seq

    def generate(self, requests: list[GenerationRequest]) -> list[Sequence]:
        seqs = [self.submit(r) for r in requests]
        while self.waiting or self.running:
            self.step()
        return seqs

    def check(self, request: GenerationRequest) -> None:
        limit = self.plan.max_seq_len
        bad = [t for t in request.prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise DSparkError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if len(request.prompt_ids) >= limit:
            raise DSparkError(f"prompt has {len(request.prompt_ids)} tokens; the bundle's max "
                              f"sequence length is {limit}")
        if len(request.prompt_ids) + request.max_tokens > limit:
            raise DSparkError(f"prompt ({len(request.prompt_ids)} tokens) + max_tokens "
                              f"({request.max_tokens}) exceeds the max sequence length {limit}")

    def schedule(self) -> list[Sequence]:
        """Admit waiting sequences while batch slots and worst-case KV blocks allow."""
        bs = self.plan.block_size
        while self.waiting and len(self.running) < self.max_batch:
            seq = self.waiting[0]
            need = -(-(seq.prompt_len + seq.request.max_tokens) // bs)
            if sum(self.reserved.values()) + need > self.plan.num_blocks:
                break
            self.waiting.popleft()
            self.arena.add_sequence(seq.id)
            self.reserved[seq.id] = need
            self.running.append(seq)
        return list(self.running)

    def window_for(self, seq: Sequence) -> int:
        req = seq.request
        if not req.speculative:
            return 0
        w = self.policy.window(seq.stats, seq.prompt_len, len(seq.generated))
        caps = [self.config.window.max_window, req.max_window or w,
                req.max_tokens - len(seq.generated) - 1]
        return max(0, min(w, *caps))

    def propose(self, batch: list[Sequence]) -> None:
        """Draft w tokens for each speculative sequence, all sequences per forward."""
        t0 = time.perf_counter()
        plan = [(seq, self.window_for(seq)) for seq in batch]
        for seq, _ in plan:
            seq.drafts, seq.draft_probs = [], []
        active = [(seq, w) for seq, w in plan if w > 0]
        while active:
            # first forward: the tokens the draft has not seen (prompt or catch-up); then
            # each previous draft token (tokens[draft_cached:] is empty by then)
            chunks = [(s.id, s.draft_cached, s.tokens[s.draft_cached:] + s.drafts[-1:])
                      for s, _ in active]
            rows = self.draft.forward(chunks, [1] * len(chunks))
            for (seq, _), (_, start, tokens), row in zip(active, chunks, rows):
                seq.draft_cached = start + len(tokens)
                self._draw_draft(seq, row[-1])
            active = [(s, w) for s, w in active if len(s.drafts) < w]
        self.last_draft_s = time.perf_counter() - t0

    def _draw_draft(self, seq: Sequence, logits: np.ndarray) -> None:
        params = seq.request.sampling
        if params.greedy:
            seq.drafts.append(int(logits.argmax()))
            return
        q = probabilities(logits, params)
        seq.drafts.append(sample(q, seq.rng))
        seq.draft_probs.append(q)

    def verify(self, batch: list[Sequence]) -> list[np.ndarray]:
        """One main forward: each sequence's uncached tokens plus its drafts."""
        chunks = [(s.id, s.main_cached, s.tokens[s.main_cached:] + s.drafts) for s in batch]
        return self.main.forward(chunks, [len(s.drafts) + 1 for s in batch])

    def accept(self, seq: Sequence, logits: np.ndarray) -> Acceptance:
        params = seq.request.sampling
        if params.greedy:
            result = accept_greedy(seq.drafts, logits)
        else:
            q = np.array(seq.draft_probs) if seq.drafts else np.zeros((0, logits.shape[-1]))
            result = accept_sampled(seq.drafts, q, probabilities(logits, params), seq.rng)
        seq.stats.record(result.drafted, result.accepted)
        kept = len(seq.tokens) + result.accepted
        seq.main_cached = kept
        self.arena.rollback(seq.id, "main", kept)
        if result.drafted:
            seq.draft_cached = min(seq.draft_cached, kept)
            self.arena.rollback(seq.id, "draft", seq.draft_cached)
        return result

    def emit(self, seq: Sequence, result: Acceptance) -> None:
        req = seq.request
        for token in result.tokens:
            if token in self.eos_ids:
                seq.finish_reason = "stop"
                return
            seq.tokens.append(token)
            if seq.first_token_at is None:
                seq.first_token_at = time.perf_counter()
            if len(seq.generated) >= req.max_tokens:
                seq.finish_reason = "length"
            if req.stop and self.decode is not None:
                text = self.decode(seq.generated)
                hits = [i for i in (text.find(s) for s in req.stop) if i >= 0]
                if hits:
                    seq.finish_reason, seq.text_end = "stop", min(hits)
            if seq.finish_reason:
                return

    def cancel(self, seq: Sequence) -> None:
        """Stop a sequence (client gone); its blocks are freed."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        seq.finish_reason = seq.finish_reason or "cancelled"
        self.retire([seq])

    def retire(self, batch: list[Sequence]) -> None:
        for seq in batch:
            if seq.done and seq.id in self.reserved:
                seq.finished_at = time.perf_counter()
                self.arena.release(seq.id)
                del self.reserved[seq.id]
                self.running.remove(seq)
