"""Which sequences run this step, and how much prompt each may feed (TAS, admission).

    admit:  tenants take turns by virtual time (tokens served / weight), FIFO within a
            tenant; a sequence is admitted only if its worst-case KV blocks fit, its
            cached prefix found and held (cache/manager.py), so its prompt is fed from
            the first position not cached
    plan:   every decoding sequence runs; prompts are fed in chunks, shortest remaining
            first (aged, so long prompts are not starved), at most `prefill_tokens` per step
A long prompt is cut into chunks so a short request arriving behind it waits for one chunk,
not for the whole prompt. While several tenants are active the chunks are small
(scheduling.shared_prefill_chunk_tokens) and a prompt that fits whole in a step does not
share it with another prompt's chunk: a short request pays for its own prefill only.
"""

from __future__ import annotations

from collections import deque

from dspark.runtime.bundle.config import DFlashConfig
from dspark.runtime.cache.layout import ArenaLayout
from dspark.runtime.cache.manager import KVCache
from dspark.runtime.engine.round_plan import RoundPlan, Slot
from dspark.runtime.errors import ConflictError
from dspark.runtime.sequence.request import Sequence


def in_flight(prefill_tokens: int) -> int:
    """The most positions a sequence writes in one step: a prompt chunk, or a verify window
    (64 drafts at most) with the draft's own writes past it."""
    return max(prefill_tokens, 64) + 2


class Scheduler:
    def __init__(self, kv: KVCache, config: DFlashConfig, max_batch: int,
                 prefill_tokens: int | None = None):
        self.kv = kv
        self.config = config
        self.max_batch = max_batch
        self.fixed_chunk = prefill_tokens  # tests pin it; otherwise the config decides
        self.waiting: dict[str, deque[Sequence]] = {}
        self.running: list[Sequence] = []
        self.served: dict[str, float] = {}  # tokens served per tenant, over its weight
        self.steps = 0

    def weight(self, tenant: str) -> float:
        return next((t.weight for t in self.config.tenants if t.name == tenant), 1.0)

    def submit(self, seq: Sequence) -> None:
        seq.waited_from = self.steps
        if seq.tenant not in self.served:  # a newcomer starts level with the others
            self.served[seq.tenant] = min(self.served.values(), default=0.0)
        self.waiting.setdefault(seq.tenant, deque()).append(seq)

    @property
    def pending(self) -> int:
        return sum(len(q) for q in self.waiting.values())

    @property
    def plan(self) -> ArenaLayout:
        return self.kv.arena.layout

    def admit(self) -> list[Sequence]:
        admitted = []
        while len(self.running) < self.max_batch:
            tenants = [t for t, q in self.waiting.items() if q]
            if not tenants:
                break
            tenant = min(tenants, key=lambda t: (self.served.get(t, 0.0), t))
            seq = self.waiting[tenant][0]
            if not self.kv.admit(seq):
                break
            self.waiting[tenant].popleft()
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def plan_step(self) -> RoundPlan:
        """The running sequences that advance this step, with their prompt chunks and the
        room each one's reservation gives."""
        self.steps += 1
        prefilling = sorted((s for s in self.running if s.prefilling), key=self._urgency)
        catch_up = budget = self.prefill_tokens
        slots = [self._slot(s, s.uncached, catch_up) for s in self.running if not s.prefilling]
        shared = self.shared
        for seq in prefilling:
            chunk = min(seq.uncached, budget)
            if shared and slots and chunk < seq.uncached and any(
                    s.seq.prefilling for s in slots):
                chunk = 0  # a short prompt runs this step alone with the decoders
            budget -= chunk
            if chunk:
                slots.append(self._slot(seq, chunk, catch_up))
        return RoundPlan(tuple(slots))

    def _slot(self, seq: Sequence, chunk: int, catch_up: int) -> Slot:
        return Slot(seq, chunk, self.kv.room(seq), catch_up)

    @property
    def shared(self) -> bool:
        """More than one tenant has running or waiting requests."""
        active = {s.tenant for s in self.running} | {t for t, q in self.waiting.items() if q}
        return len(active) > 1

    @property
    def prefill_tokens(self) -> int:
        if self.fixed_chunk is not None:
            return self.fixed_chunk
        cfg = self.config.scheduling
        return cfg.shared_prefill_chunk_tokens if self.shared else cfg.prefill_chunk_tokens

    def _urgency(self, seq: Sequence) -> tuple[float, float]:
        """Shortest remaining prompt first; each step waited takes 8 tokens off (aging)."""
        aged = seq.uncached - 8 * (self.steps - seq.waited_from)
        return (aged / self.weight(seq.tenant), seq.id)

    def account(self, seq: Sequence, tokens: int) -> None:
        self.served[seq.tenant] = self.served.get(seq.tenant, 0.0) + tokens / self.weight(
            seq.tenant)

    @property
    def in_flight(self) -> int:
        return in_flight(self.prefill_tokens)

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)

    def cancel(self, seq: Sequence) -> None:
        queue = self.waiting.get(seq.tenant)
        if queue and seq in queue:
            queue.remove(seq)
        self.finish(seq)

    def configure(self, config: DFlashConfig) -> None:
        self.config = config

    def sequences(self) -> list[Sequence]:
        """Running and waiting sequences."""
        return self.running + [s for q in self.waiting.values() for s in q]

    def resize(self, max_seq_len: int) -> ArenaLayout:
        """Change the max sequence length between steps, within the positions the bundle was
        compiled for (the arena holds one sequence of that length). Refused (ConflictError)
        below a running sequence."""
        longest = max((s.prompt_len + s.request.max_tokens for s in self.sequences()), default=0)
        if longest > max_seq_len:
            raise ConflictError(f"max_length {max_seq_len} is below a running sequence "
                                f"(prompt + max_tokens up to {longest})")
        arena = self.kv.arena
        arena.layout = arena.layout.resized(max_seq_len)
        return arena.layout
