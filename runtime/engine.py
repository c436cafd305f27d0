"""The engine: continuous batching with speculative decoding, one batch per step.

    step: admit -> plan (prompt chunks) -> draft (window policy) -> balance (which drafts
          are verified) -> verify w+1 in one main forward -> accept (pure function)
          -> roll back the caches -> emit -> maintain (cache health, resources)
Prefill is not a separate phase: prompt chunks ride in the verify forward with everyone's
drafts; the draft model catches up in its first forward of a later round.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import numpy as np

from dspark.runtime.acceptance import Acceptance, accept_greedy, accept_sampled
from dspark.runtime.bundle import Bundle
from dspark.runtime.config import DFlashConfig
from dspark.runtime.device import resolve_device
from dspark.runtime.dflash.che import CacheHealth
from dspark.runtime.dflash.costs import CostModel
from dspark.runtime.dflash.goodput import select_slots
from dspark.runtime.dflash.policy import RoundView, WindowPolicy, make_policy
from dspark.runtime.dflash.ras import ResourceManager, probe_device
from dspark.runtime.dflash.reload import ConfigWatcher
from dspark.runtime.dflash.vlb import VerifyBalancer
from dspark.runtime.drafting import run_drafts
from dspark.runtime.errors import ConflictError, DSparkError
from dspark.runtime.kv_arena import KVArena
from dspark.runtime.memory_plan import MemoryPlan, resized
from dspark.runtime.model_runner import ModelRunner
from dspark.runtime.request import GenerationRequest, Sequence
from dspark.runtime.sampling import probabilities
from dspark.runtime.scheduler import Scheduler


class Engine:
    def __init__(self, bundle: Bundle, policy: str | None = None, window: int | None = None,
                 max_batch: int = 16, eos_ids: tuple[int, ...] = (),
                 decode: Callable[[list[int]], str] | None = None,
                 prefill_tokens: int | None = None,
                 config: DFlashConfig | None = None, device: str = "auto",
                 kernels: bool = False):
        """device: auto, cpu or cuda (runtime/device.py). kernels: on the CPU, run the DSpark
        Triton kernels under Triton's interpreter instead of the numpy attention (tests)."""
        self.bundle = bundle
        self.plan = bundle.plan
        self.config: DFlashConfig = config or bundle.config
        self.costs = CostModel()
        self.device = resolve_device(device)
        self.arena = KVArena(self.plan, device=self.device)
        self.arena.zero_rejected = self.config.cache_health.zero_rejected_slots
        self.main = ModelRunner(bundle, "main", self.arena, self.costs, kernels=kernels)
        self.drafts = {r: ModelRunner(bundle, r, self.arena, self.costs, kernels=kernels)
                       for r in bundle.drafts}
        self.resources = ResourceManager(self.config.resources, probe_device(self.device),
                                         bundle.drafts)
        self.draft = self.drafts[self.resources.draft]
        self.vocab_size = bundle.model("main").vocab_size
        self.token_map = bundle.token_map  # the default draft's ids -> main ids, if they differ
        self.policy_name = policy or self.config.window.policy
        self.fixed_window = window or self.config.window.initial
        self.device_cap = True  # RAS's window cap (set_policy may lift it for a benchmark)
        make_policy(self.policy_name, window=self.fixed_window)  # unknown names fail now
        self.policies: dict[str, WindowPolicy] = {}
        self.balancer = VerifyBalancer(self.config.verify_balance, self.costs)
        self.scheduler = Scheduler(self.plan, self.config, max_batch, prefill_tokens)
        self.eos_ids = frozenset(eos_ids)
        self.decode = decode
        self.ids = itertools.count()
        self.health = CacheHealth(self.arena, self.config.cache_health)
        self.watcher: ConfigWatcher | None = None
        self.suspended_rounds = 0
        self.round_log: list[tuple[str, int, int, int]] = []  # this step's verify rounds
        self.last_verify_ms: float | None = None

    def watch_config(self, path) -> None:
        """Hot-reload `path` (the bundle's dflash_config.json or --config) between steps."""
        self.watcher = ConfigWatcher(path, self.config)

    def apply_config(self, config: DFlashConfig) -> None:
        """Swap in a validated config; called between steps only."""
        self.config = config
        self.scheduler.config = config
        self.balancer.config = config.verify_balance
        self.health.config = config.cache_health
        self.arena.zero_rejected = config.cache_health.zero_rejected_slots
        self.resources.config = config.resources
        for policy in self.policies.values():
            if hasattr(policy, "config"):
                policy.config = config.window

    # -- the loop ---------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """One engine step; returns the sequences it advanced (finished ones included)."""
        self.maintain()
        self.round_log, self.last_verify_ms = [], None
        for seq in self.scheduler.admit():
            self.arena.add_sequence(seq.id)
        batch = self.scheduler.plan_step()
        if batch:
            self.propose(batch)
            self.balance(batch)
            for seq, rows in zip(batch, self.verify(batch)):
                self.advance(seq, rows)
            self.retire(batch)
        return batch

    def maintain(self) -> None:
        """Between steps: config reload, cache health, resources (nothing reads the arena)."""
        if self.watcher is not None and (config := self.watcher.poll()) is not None:
            self.apply_config(config)
        self.health.maybe_run()
        usage = self.arena.used_blocks / self.plan.num_blocks
        if self.resources.tick(time.perf_counter(), usage):
            self.arena.delta_log = not self.resources.degraded
            self.switch_draft(self.resources.draft)

    def switch_draft(self, role: str) -> None:
        """Sequences that follow the default draft use `role` from their next round on."""
        self.draft = self.drafts[role]

    def _bind_draft(self, seq: Sequence) -> ModelRunner:
        """The draft this sequence uses this round. On a change its cache starts empty (it
        catches up in chunks) and held drafts are dropped; output is unaffected."""
        runner = self.drafts[seq.request.draft] if seq.request.draft else self.draft
        if seq.draft_role != runner.role:
            if seq.draft_role is not None:
                self.arena.rollback(seq.id, self.drafts[seq.draft_role].pool, 0)
            seq.draft_role, seq.draft_cached, seq.draft_offsets = runner.role, 0, [0]
            seq.drafts, seq.draft_probs, seq.draft_conf = [], [], []
        return runner

    def submit(self, request: GenerationRequest) -> Sequence:
        self.check(request)
        seq = Sequence(next(self.ids), request)
        self.scheduler.submit(seq)
        return seq

    def generate(self, requests: list[GenerationRequest]) -> list[Sequence]:
        seqs = [self.submit(r) for r in requests]
        while self.busy:
            self.step()
        return seqs

    @property
    def busy(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.pending)

    def check(self, request: GenerationRequest) -> None:
        limit = self.plan.max_seq_len
        bad = [t for t in request.prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise DSparkError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if len(request.prompt_ids) >= limit:
            raise DSparkError(f"prompt has {len(request.prompt_ids)} tokens; the bundle's max "
                              f"sequence length is {limit}")
        if request.draft is not None and request.draft not in self.drafts:
            raise DSparkError(f"draft model {request.draft!r} is not in the bundle (drafts: "
                              f"{', '.join(sorted(self.drafts))})")
        if len(request.prompt_ids) + request.max_tokens > limit:
            raise DSparkError(f"prompt ({len(request.prompt_ids)} tokens) + max_tokens "
                              f"({request.max_tokens}) exceeds the max sequence length {limit}")

    def conflicts(self, max_seq_len: int) -> list[Sequence]:
        """Running or waiting sequences that a shorter max sequence length would cut."""
        seqs = self.scheduler.running + [s for q in self.scheduler.waiting.values() for s in q]
        return [s for s in seqs if s.prompt_len + s.request.max_tokens > max_seq_len]

    def resize(self, max_seq_len: int) -> MemoryPlan:
        """Change the max sequence length between steps; the arena grows if one sequence of
        that length would not fit. Refused (ConflictError) below a running sequence."""
        if self.conflicts(max_seq_len):
            raise ConflictError(f"max_length {max_seq_len} is below a running sequence "
                                f"(prompt + max_tokens up to {self.longest()})")
        plan = resized(self.plan, max_seq_len)
        if plan.num_blocks > self.plan.num_blocks:
            self.arena.grow(plan)
        self.plan = self.scheduler.plan = self.arena.plan = plan
        return plan

    def longest(self) -> int:
        seqs = self.scheduler.running + [s for q in self.scheduler.waiting.values() for s in q]
        return max((s.prompt_len + s.request.max_tokens for s in seqs), default=0)

    def warmup(self, main_sizes=(1, 2, 4, 8, 16, 32, 64), draft_sizes=(1, 2, 4, 8, 16)
               ) -> dict[str, float]:
        """Run every model at a few batch sizes: first runs pay onnxruntime's allocations,
        second runs fill the cost table (steps/s per size) that goodput and VLB read."""
        sizes = {"main": [t for t in main_sizes if t < self.plan.max_seq_len],
                 "draft": [t for t in draft_sizes if t < self.plan.max_seq_len]}
        runners = {"main": [self.main], "draft": list(self.drafts.values())}
        probe, probes = -1, list(range(-9, -1))
        for seq_id in (probe, *probes):
            self.arena.add_sequence(seq_id)
        t0 = time.perf_counter()
        try:
            for measure in (False, True):
                if measure:
                    self.costs.table = {"main": {}, "draft": {}}
                for role, runner_list in runners.items():
                    for runner in runner_list:
                        for n in sizes[role]:
                            runner.forward([(probe, 0, [1] * n)], [1])
                            self.arena.rollback(probe, runner.pool, 0)
                        self._profile_sequences(runner, probes)
        finally:
            for seq_id in (probe, *probes):
                self.arena.release(seq_id)
        return {"seconds": time.perf_counter() - t0,
                "main_ms": {n: round(1000 * self.costs.seconds("main", n), 2)
                            for n in sizes["main"]}}

    def _profile_sequences(self, runner: ModelRunner, probes: list[int]) -> None:
        """One forward of 8 one-token sequences: the per-sequence overhead."""
        runner.forward([(p, 0, [1]) for p in probes], [1] * len(probes))
        for p in probes:
            self.arena.rollback(p, runner.pool, 0)

    # -- window policies --------------------------------------------------------------
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

    def cap(self, seq: Sequence) -> int:
        tenant = next((t.max_window for t in self.config.tenants if t.name == seq.tenant),
                      self.config.window.max_window)
        req = seq.request
        device = self.resources.window_cap if self.device_cap else 64
        return max(0, min(self.config.window.max_window, tenant, req.max_window or 64,
                          device, req.max_tokens - len(seq.generated) - 1))

    def view(self, seq: Sequence) -> RoundView:
        return RoundView(seq.id, seq.tenant, seq.prompt_len, len(seq.generated), seq.stats,
                         self.cap(seq))

    # -- one round --------------------------------------------------------------------
    def propose(self, batch: list[Sequence]) -> None:
        """Choose each sequence's window, then draft for all of them together."""
        drafting = [s for s in batch if not s.prefilling and s.request.speculative]
        for seq in batch:
            seq.window = 0
        for policy in self.policies.values():
            if hasattr(policy, "batch"):
                policy.batch = max(1, len(drafting))
        for seq in drafting:
            seq.window = min(self.cap(seq), self.policy(seq.tenant).window(self.view(seq)))
        cap = self.balancer.batch_cap(len(drafting), max((s.window for s in drafting), default=0))
        self.suspended_rounds += bool(drafting) and cap == 0
        for seq in drafting:
            seq.window = min(seq.window, cap)
        record = self.policy_name != "fixed"

        def keep(seq: Sequence) -> bool:
            seq.stats.draft_top1 = [c for c, _ in seq.draft_conf]
            return self.policy(seq.tenant).keep_drafting(self.view(seq), len(seq.drafts))

        groups: dict[str, list[Sequence]] = {}
        for seq in drafting:
            groups.setdefault(self._bind_draft(seq).role, []).append(seq)
        for role, group in groups.items():
            tmap = self.token_map if role == "draft" else None
            run_drafts(self.drafts[role], group, keep, self.scheduler.prefill_tokens, record,
                       tmap, self._room)

    def _room(self, seq: Sequence) -> int:
        """Positions a sequence may fill in any pool: its reservation, the max length."""
        reserved = self.scheduler.reserved.get(seq.id, 0) * self.plan.block_size
        return min(reserved, self.plan.max_seq_len)

    def balance(self, batch: list[Sequence]) -> None:
        """How many drafts each sequence verifies now (VLB; goodput's slot selection)."""
        for seq in batch:
            seq.verify = self.balancer.admit(min(len(seq.drafts), seq.window))
        if self.policy_name == "goodput":
            with_drafts = [s for s in batch if s.verify]
            survival = [self._survival(s) for s in with_drafts]
            base = sum(s.chunk for s in batch)
            for seq, keep in zip(with_drafts, select_slots(survival, base, self.costs)):
                seq.verify = keep

    def _survival(self, seq: Sequence) -> list[float]:
        policy, view = self.policy(seq.tenant), self.view(seq)
        return [policy._survival(view, j) for j in range(1, seq.verify + 1)]

    def verify(self, batch: list[Sequence]) -> list[np.ndarray]:
        """One main forward: prompt chunks, uncached tokens and the verified drafts."""
        chunks, rows = [], []
        for s in batch:
            feed = s.tokens[s.main_cached:s.main_cached + s.chunk]
            done = s.main_cached + len(feed) == len(s.tokens)
            chunks.append((s.id, s.main_cached, feed + (s.drafts[:s.verify] if done else [])))
            rows.append(s.verify + 1 if done else 0)
        self.health.observe_batch([s.id for s in batch])
        t0 = time.perf_counter()
        logits = self.main.forward(chunks, rows)
        elapsed = time.perf_counter() - t0
        self.balancer.observe(sum(len(c[2]) for c in chunks), elapsed)
        self.last_verify_ms = 1000 * elapsed
        return logits

    def advance(self, seq: Sequence, logits: np.ndarray) -> None:
        self.scheduler.account(seq, seq.chunk + seq.verify)
        if not len(logits):  # a prompt chunk: the cache grew, nothing to emit yet
            seq.main_cached += seq.chunk
            return
        result = self.accept(seq, logits)
        if result.drafted:
            self.balancer.observe_round(result.accepted > 0)
        if seq.request.speculative:
            self.round_log.append((seq.tenant, seq.window, result.drafted, result.accepted))
        self.policy(seq.tenant).observe(self.view(seq))
        self.emit(seq, result)

    def accept(self, seq: Sequence, logits: np.ndarray) -> Acceptance:
        k, drafts = seq.verify, seq.drafts
        params = seq.request.sampling
        if params.greedy:
            result = accept_greedy(drafts[:k], logits)
        else:
            q = np.array(seq.draft_probs[:k]) if k else np.zeros((0, logits.shape[-1]))
            result = accept_sampled(drafts[:k], q, probabilities(logits, params), seq.rng)
        seq.stats.draft_top1 = [c for c, _ in seq.draft_conf]
        seq.stats.draft_entropy = [e for _, e in seq.draft_conf]
        seq.stats.record(result.drafted, result.accepted)
        old = len(seq.tokens)
        # held drafts survive only if every verified draft was accepted and the main
        # model's own next token is the first held one
        keep_held = result.accepted == k and k < len(drafts) and drafts[k] == result.tokens[-1]
        same = old + (len(drafts) if keep_held else result.accepted)
        seq.main_cached = old + result.accepted
        self.arena.rollback(seq.id, "main", seq.main_cached)
        if seq.draft_cached > same:
            seq.draft_cached = same
            del seq.draft_offsets[same + 1:]
            self.arena.rollback(seq.id, self.drafts[seq.draft_role].pool, seq.draft_offsets[-1])
        held = k + 1 if keep_held else len(drafts)
        seq.drafts, seq.draft_probs = drafts[held:], seq.draft_probs[held:]
        seq.draft_conf = seq.draft_conf[held:]
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
                seq.first_token_step = self.scheduler.steps
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
        seq.finish_reason = seq.finish_reason or "cancelled"
        self.scheduler.cancel(seq)
        self._release(seq)

    def retire(self, batch: list[Sequence]) -> None:
        for seq in batch:
            if seq.done:
                self.scheduler.finish(seq)
                self._release(seq)

    def _release(self, seq: Sequence) -> None:
        if seq.id in self.arena.tables:
            seq.finished_at = time.perf_counter()
            self.arena.release(seq.id)
            self.policy(seq.tenant).forget(seq.id)
