"""The engine: continuous batching with speculative decoding, one batch per step.

    step: plan (scheduler: who runs, prompt chunks; then the round's decision, decide.py:
                method and windows -> the drafts -> how many the verify checks)
          -> verify w+1 in one main forward -> accept (pure function)
          -> commit (main cache; the drafting's settle; the policies observe) -> emit
          -> retire
Prefill is not a separate phase: prompt chunks ride in the verify forward with everyone's
drafts; the draft model catches up in its first forward of a later round. Maintenance
(config reload, cache health, resources) runs between steps.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from dspark.runtime.bundle.bundle import Bundle
from dspark.runtime.bundle.config import DFlashConfig
from dspark.runtime.cache.kv_arena import KVArena
from dspark.runtime.cache.layout import ArenaLayout
from dspark.runtime.cache.manager import KVCache
from dspark.runtime.cache.prefix_cache import PrefixCache
from dspark.runtime.dflash.che import CacheHealth
from dspark.runtime.dflash.ras import ResourceManager, probe_device
from dspark.runtime.dflash.reload import ConfigSource, ConfigWatcher
from dspark.runtime.dflash.source import SourceChooser
from dspark.runtime.dflash.vlb import VerifyBalancer
from dspark.runtime.drafting.base import Drafting
from dspark.runtime.drafting.hybrid import HybridDrafter
from dspark.runtime.drafting.lookup import LookupDrafter
from dspark.runtime.drafting.model import SOURCE as MODEL_SOURCE
from dspark.runtime.drafting.model import bundle_drafter
from dspark.runtime.engine.acceptance import Acceptance, accept, scored_rows
from dspark.runtime.engine.choices import Choices
from dspark.runtime.engine.decide import decide
from dspark.runtime.engine.emit import emit
from dspark.runtime.engine.kv_setup import cached_roles, engine_layout, shared_kv_roles
from dspark.runtime.engine.planner import WindowPlanner
from dspark.runtime.engine.round_plan import RoundPlan, Slot
from dspark.runtime.engine.scheduler import Scheduler, in_flight
from dspark.runtime.engine.snapshot import EngineGauges, RoundRecord, StepReport
from dspark.runtime.engine.warmup import DRAFT_SIZES, MAIN_SIZES, warm_up
from dspark.runtime.errors import RequestError
from dspark.runtime.grammar.constraint import GrammarBook
from dspark.runtime.model.costs import AFTER_DRAFT, CostModel
from dspark.runtime.model.device import resolve_device
from dspark.runtime.model.runner import ModelRunner
from dspark.runtime.sequence.logprobs import output_logprobs, score_prompt
from dspark.runtime.sequence.request import GenerationRequest, Sequence
from dspark.runtime.sequence.validate import Limits, validate

log = logging.getLogger("dspark.runtime")
IDLE_GAP_S = 0.25  # a step this long after the last one's end: not measured (batch_modes.py)


class Engine:
    def __init__(self, bundle: Bundle, policy: str | None = None, window: int | None = None,
                 max_batch: int = 16, eos_ids: tuple[int, ...] = (),
                 decode: Callable[[list[int]], str] | None = None,
                 prefill_tokens: int | None = None,
                 config: DFlashConfig | None = None, device: str = "auto",
                 kernels: bool = False, grammars: GrammarBook | None = None,
                 kv_budget: int | str | None = None, kv_dtype: str | None = None,
                 prefix_cache: bool = True, max_seq_len: int | None = None,
                 windowed_kv: bool = True):
        """device: auto, cpu or cuda (model/device.py). kernels: on the CPU, run the DSpark
        Triton kernels under Triton's interpreter instead of the numpy attention (tests).
        grammars: the bundle tokenizer for requests with a grammar (structured output).
        kv_budget: the KV arena's bytes (default: the bundle's plan; "auto": RAS sizes it
        from the memory available, dflash/ras.py); kv_dtype: its values' type (default:
        each model's own); prefix_cache: keep prompts' KV for later ones; max_seq_len: the
        longest sequence served (default and most: the bundle's); windowed_kv=False keeps
        sliding-window layers' blocks with the others (every position held, as before KV
        groups: for measurements)."""
        self.bundle = bundle
        self.config: DFlashConfig = config or bundle.config
        self.costs = CostModel()
        self.device = resolve_device(device)
        self.shared_kv = shared_kv_roles(bundle, self.config.drafting.share_main_kv)
        flight = in_flight(prefill_tokens or self.config.scheduling.prefill_chunk_tokens)
        self.arena = KVArena(engine_layout(bundle, self.shared_kv, self.config.resources,
                                           self.device, max_batch, flight, kv_budget,
                                           kv_dtype, max_seq_len, windowed_kv),
                             device=self.device)
        self.arena.zero_rejected = self.config.cache_health.zero_rejected_slots
        self.main = ModelRunner(bundle, "main", self.arena, self.costs, kernels=kernels)
        self.draft_models = {r: ModelRunner(bundle, r, self.arena, self.costs, kernels=kernels,
                                            pool="main" if r in self.shared_kv else None)
                             for r in bundle.draft_models}
        gate = getattr(self.main.model, "gate", None)
        if gate is not None:  # forwards leave the pool under load: a cost table per mode
            self.costs.mode = lambda: gate.solo
        self.resources = ResourceManager(self.config.resources, probe_device(self.device),
                                         bundle.draft_models)
        self.vocab_size = bundle.model("main").vocab_size
        self.balancer = VerifyBalancer(self.config.verify_balance, self.costs)
        self._stepped = 0.0  # when the last step ended
        prefix = PrefixCache(self.arena, cached_roles(bundle, self.shared_kv), prefix_cache)
        self.kv = KVCache(self.arena, prefix, lambda: self.scheduler.in_flight)
        self.scheduler = Scheduler(self.kv, self.config, max_batch, prefill_tokens)
        self.planner = WindowPlanner(self.config, self.costs, self.resources,
                                     bool(self.draft_models), policy or (
                                         "fixed" if window else None), window)
        lookup = LookupDrafter(self.config.drafting.lookup, bundle.datastore)
        model = bundle_drafter(bundle, self.draft_models, self.arena, self.resources.draft,
                               self.shared_kv, self.kv.commit)
        self.drafting: Drafting = HybridDrafter(lookup, model,
                                                SourceChooser(self.config.drafting, self.costs))
        self.eos_ids = frozenset(eos_ids)
        self.decode = decode
        self.grammars = grammars
        self.ids = itertools.count()
        self.health = CacheHealth(self.arena, self.config.cache_health)
        self.choices = Choices()  # choices waiting for their first's prompt (submit_group)
        self._watcher: ConfigSource | None = None

    @property
    def plan(self) -> ArenaLayout:
        return self.scheduler.plan

    @property
    def draft_model(self) -> ModelRunner | None:
        """The draft model sequences use by default (RAS may switch it)."""
        role = self.drafting.default_draft
        return self.draft_models[role] if role is not None else None

    @property
    def limits(self) -> Limits:
        return Limits(self.vocab_size, self.plan.max_seq_len, tuple(sorted(self.draft_models)))

    def watch(self, source: Path | ConfigSource) -> ConfigSource:
        """Take new configs between steps from `source`: a file to hot-reload (the bundle's
        dflash_config.json or --config) or anything with `poll()` and `reloads` (a cluster
        replica's inbox). Returns the source (SIGHUP-style `requested` on a file's)."""
        self._watcher = source if hasattr(source, "poll") else ConfigWatcher(source, self.config)
        return self._watcher

    def apply_config(self, config: DFlashConfig) -> None:
        """Swap in a validated config; called between steps only."""
        self.config = config
        self.arena.zero_rejected = config.cache_health.zero_rejected_slots
        for part in (self.scheduler, self.planner, self.balancer, self.health, self.resources,
                     self.drafting):
            part.configure(config)

    # -- the loop ---------------------------------------------------------------------
    def step(self) -> StepReport:
        """One engine step: what it advanced (finished sequences included), each speculative
        sequence's round, the verify's time."""
        self.maintain()
        for seq in self.choices.ready():  # choices whose prompt their first has computed
            self.scheduler.submit(seq)
        self.scheduler.admit()
        scheduled = self.scheduler.plan_step()
        t0 = time.perf_counter()  # the round's planning, drafting and verify
        plan = decide(scheduled, self.planner, self.balancer, self.drafting)
        if not plan:
            return StepReport()
        logits, verify_ms = self._verify(plan)
        seconds = time.perf_counter() - t0
        rounds, before = [], sum(len(s.seq.generated) for s in plan)
        # a round's time calibrates its sequence's hybrid (SourceChooser.observe_round) only
        # where it ran alone: a batch step's time is every sequence's work
        alone = seconds if len(plan) == 1 else 0.0
        for slot, rows in zip(plan, logits):
            try:
                if (record := self._advance(slot, rows, alone)) is not None:
                    rounds.append(record)
            except Exception as e:  # noqa: BLE001 - one sequence's fault ends it alone
                slot.seq.finish_reason, slot.seq.error = "error", e
        if plan.measured and (not plan.speculated or any(s.verify for s in plan)):
            # a prompt's step is plain, not a measure; nor one that verified no drafts
            self.balancer.observe_step(len(plan), plan.speculated, sum(
                len(s.seq.generated) for s in plan) - before, time.perf_counter() - t0,
                after_idle=t0 - self._stepped > IDLE_GAP_S)
        self._stepped = time.perf_counter()
        for seq in plan.seqs:
            if seq.done:
                self.scheduler.finish(seq)
                self._release(seq)
        return StepReport(tuple(plan.seqs), tuple(rounds), verify_ms)

    def gauges(self) -> EngineGauges:
        """The engine's state between steps, frozen (what the server and metrics read)."""
        reloads = None if self._watcher is None else tuple(sorted(self._watcher.reloads.items()))
        return EngineGauges.of(self, reloads)

    def maintain(self) -> None:
        """Between steps: config reload, cache health, resources (nothing reads the arena)."""
        if self._watcher is not None and (config := self._watcher.poll()) is not None:
            self.apply_config(config)
        self.health.maybe_run()
        if self.resources.tick(time.perf_counter(), self.arena.usage()):
            self.arena.delta_log = not self.resources.degraded
            self.drafting.use_draft(self.resources.draft)  # from each sequence's next round

    def _verify(self, plan: RoundPlan) -> tuple[list[np.ndarray], float]:
        """One main forward: prompt chunks, uncached tokens and the verified drafts; the
        logits rows per sequence and the forward's milliseconds."""
        chunks, rows = [], []
        for s in plan:
            seq = s.seq
            feed = seq.tokens[seq.main_cached:seq.main_cached + s.chunk]
            drafts = s.pending.tokens[:s.verify] if s.finishes_prompt else []
            chunks.append((seq.id, seq.main_cached, feed + drafts))
            rows.append(_rows(s))
        self.health.observe_batch([s.seq.id for s in plan])
        drafted = any("draft" in s.source for s in plan)  # draft forwards ran just before
        t0 = time.perf_counter()
        logits = self.main.forward(chunks, rows, AFTER_DRAFT if drafted else None)
        elapsed = time.perf_counter() - t0
        self.balancer.observe(sum(len(c[2]) for c in chunks), elapsed)
        return logits, 1000 * elapsed

    def _advance(self, slot: Slot, logits: np.ndarray, seconds: float) -> RoundRecord | None:
        """Accept, commit and emit one sequence's verified tokens; its round's record when
        it speculates."""
        seq = slot.seq
        self.scheduler.account(seq, slot.chunk + slot.verify)
        if seq.request.echo and seq.prefilling:  # the prompt's rows score its tokens
            score_prompt(seq, logits[:slot.chunk])
            logits = logits[slot.chunk - 1:] if slot.finishes_prompt else logits[:0]
        if not len(logits):  # a prompt chunk: the cache grew, nothing to emit yet
            seq.main_cached += slot.chunk
            self.kv.commit(seq, "main", seq.main_cached)
            return None
        pending = slot.pending
        sources = tuple(pending.sources[:slot.verify])
        rows = scored_rows(seq, pending.tokens[:slot.verify], logits)
        result = accept(seq, pending, slot.verify, rows)
        seq.stats.record(result.drafted, result.accepted, pending.confidence, pending.entropy)
        record = None
        if seq.request.speculative:
            seq.stats.record_method(slot.source)
            record = RoundRecord(seq.tenant, len(pending), result.drafted, result.accepted,
                                 sources, slot.source)
        if result.drafted and sources[0] == MODEL_SOURCE:  # VLB caps the model's windows
            self.balancer.observe_round(result.accepted > 0)
        self._commit(seq, slot, result, seconds)
        self.planner.observe(seq)
        grammar = seq.constraint
        before = len(seq.tokens)
        emit(seq, result.tokens, self.eos_ids if grammar is None else self.eos_ids | grammar.eos,
             self.decode, self.scheduler.steps)
        if seq.request.logprobs is not None:  # the emitted tokens' rows, read already
            seq.logprobs += output_logprobs(rows, result.tokens[:len(seq.tokens) - before],
                                            seq.request.logprobs)
        if grammar is not None:
            grammar.commit(result.tokens)
            if not seq.done and grammar.stopped:  # nothing more allowed
                seq.finish_reason = "stop"
        return record

    def _commit(self, seq: Sequence, slot: Slot, result: Acceptance, seconds: float) -> None:
        """Keep in every cache exactly what verification accepted.

        The verify forward appended the sequence's uncached token(s) and `slot.verify`
        drafts to the main cache; the main model keeps the old tokens and the accepted
        drafts (its own next token is fed next round), so it rolls back to that length.
        The drafters' caches cover `tokens + pending`; `settle` says through which
        position that stream is unchanged and each drafter forgets what lies beyond."""
        old = len(seq.tokens)
        seq.main_cached = old + result.accepted
        self.arena.rollback(seq.id, "main", seq.main_cached)
        self.kv.commit(seq, "main", seq.main_cached)
        self.drafting.settle(seq, old, slot.verify, result.accepted, result.tokens[-1],
                             seconds)

    def _release(self, seq: Sequence) -> None:
        if seq.id in self.arena.tables:
            self.kv.release(seq)
            self.planner.forget(seq)
            self.drafting.release(seq)

    # -- requests and operations ------------------------------------------------------
    def _sequence(self, request: GenerationRequest) -> Sequence:
        validate(request, self.limits)
        seq = Sequence(next(self.ids), request)
        if request.grammar is not None:
            if self.grammars is None:
                raise RequestError("structured output needs the bundle's tokenizer (dsc "
                                   "compile --tokenizer)", param="response_format")
            seq.constraint = self.grammars.constraint(request.grammar)
        return seq

    def submit(self, request: GenerationRequest) -> Sequence:
        return self.submit_group([request])[0]

    def submit_group(self, requests: list[GenerationRequest]) -> list[Sequence]:
        """Choices of one prompt (`n`): the first is scheduled now; the others, where the
        prefix cache can share its prompt, once its prefill is done (engine/choices.py)."""
        seqs = [self._sequence(r) for r in requests]
        first = requests[0]
        self.scheduler.submit(seqs[0])
        if len(seqs) > 1 and self.kv.prefix.enabled and first.cache_prompt and not first.echo:
            self.choices.park(seqs[0], seqs[1:])
        else:
            for seq in seqs[1:]:
                self.scheduler.submit(seq)
        return seqs

    def generate(self, requests: list[GenerationRequest]) -> list[Sequence]:
        seqs = [self.submit(r) for r in requests]
        while self.busy:
            self.step()
        return seqs

    @property
    def busy(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.pending or self.choices)

    def cancel(self, seq: Sequence) -> None:
        """Stop a sequence (client gone); its blocks are freed."""
        seq.finish_reason = seq.finish_reason or "cancelled"
        if not self.choices.cancel(seq):
            self.scheduler.cancel(seq)
            self._release(seq)

    def resize(self, max_seq_len: int) -> ArenaLayout:
        """New max sequence length (RequestError past the positions a model was compiled
        for: its rotary tables and its proven attention spans)."""
        for role, spec in self.bundle.models.items():
            if spec.max_positions is not None and max_seq_len > spec.max_positions:
                raise RequestError(
                    f"max_length {max_seq_len} is past the {spec.max_positions} positions the "
                    f"{role} model was compiled for (its rotary tables and attention spans; "
                    "dsc compile --max-seq-len)", param="max_length", code="max_length_exceeded")
        return self.scheduler.resize(max_seq_len)

    def warmup(self, main_sizes=MAIN_SIZES, draft_sizes=DRAFT_SIZES,
               cached: bool = False) -> dict:
        """Profile every model, or read this machine's table back (engine/warmup.py)."""
        return warm_up(self, main_sizes, draft_sizes, cached)


def _rows(slot: Slot) -> int:
    """Logits rows a slot's forward returns: its verify window's (drafts and the main's
    token) where its chunk ends its prompt; while an echo request is prefilling, every
    position it feeds (they score the prompt's tokens)."""
    if slot.seq.request.echo and slot.seq.prefilling:
        return slot.chunk + (slot.verify if slot.finishes_prompt else 0)
    return slot.verify + 1 if slot.finishes_prompt else 0

