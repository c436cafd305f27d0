"""Automatic prefix caching: the KV of a prompt's cached prefix is not computed again.

Every full block of a sequence's tokens has a key: the SHA-256 of its parent's key and
its own token ids, so a key names the whole prefix up to the block's end, and the block's
positions with it (vLLM's scheme; docs/runtime.md says why not a radix tree). When a
model's positions below `final` are final (after each verify), its full blocks below it
are registered in each of the model's groups under their keys (`commit`); when a sequence
ends, its last, partly filled block too (`release`), under a key of its own. Each
registered block is also listed under its parent with the tokens it holds.

A new sequence looks its prompt's keys up (`find`): the longest run of blocks every group
of the main model has, where a window group needs only the blocks its window reads at the
run's end (a block that has left a window is not needed, one it still reads must be
there). Then, among the blocks registered under the run's last key, the one that shares
the most tokens with what follows in the prompt: its first tokens are taken too (a
conversation's last turn, a shared system prompt's last block), and the block is copied
before the sequence writes into it. At least one prompt token is always left to compute:
its logits start the output. A draft model with its own cache finds its own run, no
longer than the main's, and catches up on the rest. A model whose positions are not the
main's tokens (a draft with a token map) is not cached.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field

from dspark.runtime.cache.kv_arena import NO_BLOCK, KVArena

ROOT = b"dspark prefix 1"


def extend_keys(keys: list[bytes], tokens: list[int], blocks: int, block_size: int) -> None:
    """Make `keys` the keys of the first `blocks` full blocks of `tokens`."""
    while len(keys) < blocks:
        i = len(keys)
        chunk = array("q", tokens[i * block_size:(i + 1) * block_size]).tobytes()
        keys.append(hashlib.sha256((keys[-1] if keys else ROOT) + chunk).digest())


def partial_key(parent: bytes, tokens: tuple[int, ...]) -> bytes:
    """The key of a partly filled last block: its parent and its tokens, marked apart from
    any full block's."""
    return hashlib.sha256(parent + array("q", tokens).tobytes() + b"partial").digest()


def _shared(a: tuple[int, ...], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass(frozen=True)
class Found:
    """A prompt's cached prefix: positions found per model, and each group's blocks."""

    positions: dict[str, int] = field(default_factory=dict)
    blocks: dict[str, list[int]] = field(default_factory=dict)

    def held(self, arena: KVArena, group: str) -> int:
        """Of the blocks found in `group`, how many some sequence holds already."""
        pool = arena.groups[group].blocks
        return sum(1 for b in self.blocks.get(group, ()) if b != NO_BLOCK and pool.refs[b])


class PrefixCache:
    def __init__(self, arena: KVArena, roles: tuple[str, ...], enabled: bool = True):
        """`roles`: the models whose cache is keyed by the main's tokens (main first)."""
        self.arena = arena
        self.roles = tuple(r for r in roles if r in arena.pools)
        self.enabled = enabled
        self.private: set[int] = set()  # sequences that opted out
        self.queried = 0  # prompt tokens looked up
        self.hit = 0  # of them, found cached

    def find(self, tokens: list[int], keys: list[bytes]) -> Found:
        """The cached prefix of a prompt (nothing is held yet); fills `keys`."""
        if not self.enabled:
            return Found()
        bs = self.arena.block_size
        extend_keys(keys, tokens, (len(tokens) - 1) // bs, bs)
        positions, blocks = {}, {}
        limit = len(tokens) - 1  # positions a model may find: the main's, for a draft
        for role in self.roles:
            count = self._run(role, keys[:limit // bs])
            for name in self.arena.role_groups(role):
                blocks[name] = self._blocks(name, keys[:count])
            parent = keys[count - 1] if count else ROOT
            taken, partial = self._partial(role, parent, tokens[count * bs:limit])
            for name, block in partial.items():
                blocks[name].append(block)
            positions[role] = count * bs + taken
            limit = min(limit, positions[role])
        return Found(positions, blocks)

    def _run(self, role: str, keys: list[bytes]) -> int:
        """The most leading blocks every group of `role` can serve."""
        groups = [self.arena.groups[n] for n in self.arena.role_groups(role)]
        count = len(keys)
        for g in groups:
            if not g.layout.window:
                n = 0
                while n < count and keys[n] in g.blocks.block_of:
                    n += 1
                count = n
        while count and not all(self._window_holds(g, keys, count) for g in groups
                                if g.layout.window):
            count -= 1
        return count

    def _partial(self, role: str, parent: bytes, following: list[int]
                 ) -> tuple[int, dict[str, int]]:
        """After the block run ending at `parent`: how many of the `following` tokens a
        registered child block of every group of `role` holds, and those blocks."""
        taken, chosen = len(following), {}
        for name in self.arena.role_groups(role):
            children = self.arena.groups[name].blocks.children.get(parent, {})
            best, block = 0, NO_BLOCK
            for child, held in children.items():
                n = _shared(held, following)
                if n > best:
                    best, block = n, child
            taken = min(taken, best)
            chosen[name] = block
        return (taken, chosen) if taken else (0, {})

    def _window_holds(self, group, keys: list[bytes], count: int) -> bool:
        return all(keys[i] in group.blocks.block_of
                   for i in range(self._first(group.layout.window, count), count))

    def _first(self, window: int, count: int) -> int:
        """The first block a window group still reads when `count` blocks are cached."""
        return max(0, count * self.arena.block_size - window - 1) // self.arena.block_size

    def _blocks(self, name: str, keys: list[bytes]) -> list[int]:
        group = self.arena.groups[name]
        first = self._first(group.layout.window, len(keys)) if group.layout.window else 0
        return [NO_BLOCK] * first + [group.blocks.block_of[k] for k in keys[first:]]

    def attach(self, seq_id: int, found: Found, prompt_len: int, use: bool = True) -> None:
        """Hold the blocks found for a sequence the arena has just added."""
        self.queried += prompt_len
        if not use:
            self.private.add(seq_id)
            return
        for name, blocks in found.blocks.items():
            if blocks:
                self.arena.attach(seq_id, name, blocks)
        table = self.arena.tables[seq_id]
        for role, positions in found.positions.items():
            table.lengths[role] = positions
        self.hit += found.positions.get(self.roles[0], 0) if self.roles else 0

    def _caches(self, seq_id: int, role: str) -> bool:
        return self.enabled and role in self.roles and seq_id not in self.private

    def commit(self, seq_id: int, role: str, tokens: list[int], final: int) -> None:
        """Positions below `final` of `role` are final: register its full blocks there,
        then let its window groups drop what they no longer reach."""
        table = self.arena.tables.get(seq_id)
        if table is None:
            return
        if self._caches(seq_id, role):
            bs = self.arena.block_size
            full = min(final, len(tokens)) // bs
            extend_keys(table.keys, tokens, full, bs)
            for name in self.arena.role_groups(role):
                pool, blocks = self.arena.groups[name].blocks, table.blocks[name]
                for i in range(table.sealed.get(name, 0), min(full, len(blocks))):
                    if blocks[i] != NO_BLOCK:
                        pool.register(blocks[i], table.keys[i],
                                      table.keys[i - 1] if i else ROOT,
                                      tuple(tokens[i * bs:(i + 1) * bs]))
                table.sealed[name] = max(table.sealed.get(name, 0), full)
        self.arena.trim(seq_id, role, final)

    def release(self, seq_id: int, tokens: list[int], final: int | None) -> None:
        """The sequence ends: its blocks go back to the arena, its partly filled last ones
        registered first (no model's positions past `final`, the main's final length;
        None: nothing is registered, a sequence that failed)."""
        table = self.arena.tables.get(seq_id)
        if table is None:
            return
        bs = self.arena.block_size
        for role in self.roles if final is not None else ():
            if not self._caches(seq_id, role):
                continue
            final = min(table.length(role), final, len(tokens) - 1)
            full = final // bs
            extend_keys(table.keys, tokens, full, bs)
            if final % bs == 0 or len(table.keys) < full:
                continue
            parent = table.keys[full - 1] if full else ROOT
            held = tuple(tokens[full * bs:final])
            for name in self.arena.role_groups(role):
                blocks = table.blocks[name]
                if full < len(blocks) and blocks[full] != NO_BLOCK:
                    self.arena.groups[name].blocks.register(
                        blocks[full], partial_key(parent, held), parent, held)
        self.private.discard(seq_id)
        self.arena.release(seq_id)

    @property
    def hit_rate(self) -> float:
        return self.hit / self.queried if self.queried else 0.0

    def cached_blocks(self) -> int:
        """Registered blocks of the main model's groups, held or not."""
        if not self.roles:
            return 0
        return sum(self.arena.groups[n].blocks.cached for n in self.arena.role_groups(
            self.roles[0]))
