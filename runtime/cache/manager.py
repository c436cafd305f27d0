"""What the engine and the scheduler ask of KV memory: admit a sequence (its cached prefix
found and held) when the arena can hold its worst case, commit what verification kept,
release it.

Admission counts, per group, the blocks held now (a shared block once) plus what every
running sequence may still take to reach its promised length (its prompt and max_tokens;
a window group: a window's worth) plus the newcomer's worst case less the cached blocks it
shares with sequences already running. Cached blocks nobody holds count as free: they are
evicted as needed. So a forward never finds the arena full.
"""

from __future__ import annotations

from collections.abc import Callable

from dspark.runtime.cache.kv_arena import NO_BLOCK, UNBOUNDED, KVArena
from dspark.runtime.cache.prefix_cache import Found, PrefixCache
from dspark.runtime.sequence.request import Sequence


class KVCache:
    def __init__(self, arena: KVArena, prefix: PrefixCache, in_flight: Callable[[], int]):
        """`in_flight`: the most positions a sequence writes in one step (a prefill chunk,
        a verify window), which sizes a window group's share per sequence."""
        self.arena = arena
        self.prefix = prefix
        self.in_flight = in_flight

    def admit(self, seq: Sequence) -> bool:
        """Add `seq` to the arena with its cached prefix held, if its worst case fits."""
        use = seq.request.cache_prompt
        keys: list[bytes] = []
        # an echo request scores every prompt token: its rows are computed, not found
        found = (self.prefix.find(seq.tokens, keys) if use and not seq.request.echo
                 else Found())
        promised = seq.prompt_len + seq.request.max_tokens
        if not self.fits(promised, found):
            return False
        self.arena.add_sequence(seq.id, promised).keys = keys
        self.prefix.attach(seq.id, found, seq.prompt_len, use)
        seq.main_cached = seq.cached_tokens = found.positions.get("main", 0)
        return True

    def fits(self, promised: int, found: Found | None = None) -> bool:
        found = found or Found()
        flight = self.in_flight()
        for name, group in self.arena.groups.items():
            layout = group.layout
            ahead = 0
            for table in self.arena.tables.values():
                if table.promised < UNBOUNDED:
                    blocks = table.blocks[name]
                    live = sum(1 for b in blocks if b != NO_BLOCK)
                    ahead += max(0, layout.seq_blocks(table.promised, flight) - live)
                    ahead += self._copies(name, blocks, table.length(layout.role))
            need = layout.seq_blocks(promised, flight) - found.held(self.arena, name)
            need += self._copies(name, found.blocks.get(name, []),
                                 found.positions.get(layout.role, 0))
            if group.blocks.held + ahead + need > layout.num_blocks:
                return False
        return True

    def _copies(self, name: str, blocks: list[int], length: int) -> int:
        """1 when the next write lands in a block the sequence must copy first (shared or
        registered, partly filled: a fork's, a partial prefix match's), else 0."""
        at = length // self.arena.block_size
        if not length % self.arena.block_size or at >= len(blocks) or blocks[at] == NO_BLOCK:
            return 0
        pool = self.arena.groups[name].blocks
        return int(pool.refs[blocks[at]] > 1 or blocks[at] in pool.key_of)

    def room(self, seq: Sequence) -> int:
        """Positions `seq` may fill in any model's cache (its reservation)."""
        bs = self.arena.block_size
        return min(-(-(seq.prompt_len + seq.request.max_tokens) // bs) * bs,
                   self.arena.layout.max_seq_len)

    def commit(self, seq: Sequence, role: str, final: int) -> None:
        self.prefix.commit(seq.id, role, seq.tokens, final)

    def release(self, seq: Sequence) -> None:
        """`seq` ends: its blocks go back, its partly filled last ones kept in the prefix
        cache (unless it failed)."""
        self.prefix.release(seq.id, seq.tokens, None if seq.error else seq.main_cached)
