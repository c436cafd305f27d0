"""One KV group's blocks: free, held, or cached.

    free     nobody's; handed out lowest id first (runs of consecutive blocks)
    held     in one or more sequences' block tables (a reference count); a block held by
             two or more is shared and never written (kv_arena.py copies it first)
    cached   held by nobody, but its positions are a registered prefix (prefix_cache.py):
             kept until a block is needed and none is free, then evicted least recently
             released first
A registered block is immutable for as long as its key maps to it: the positions it holds
are final in every layer of the group. It is also listed under its parent's key with the
tokens it holds (`children`), so a prompt that follows the parent can take the block's
first tokens even where the rest differs (prefix_cache.py: a partial match, copied before
it is written).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

from dspark.runtime.errors import DSparkError


class ArenaFullError(DSparkError):
    """No free block: the caller admitted more than the arena holds."""


class BlockPool:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free: list[int] = list(range(num_blocks))  # a heap
        self.refs = [0] * num_blocks
        self.lru: OrderedDict[int, None] = OrderedDict()  # cached, least recent first
        self.key_of: dict[int, bytes] = {}
        self.block_of: dict[bytes, int] = {}
        self.parent_of: dict[int, bytes] = {}  # registered block -> its parent's key
        self.children: dict[bytes, dict[int, tuple[int, ...]]] = {}  # parent -> block: tokens
        self.evictions = 0

    @property
    def available(self) -> int:
        """Blocks a sequence can take: free ones and cached ones nobody holds."""
        return len(self.free) + len(self.lru)

    @property
    def held(self) -> int:
        return self.num_blocks - self.available

    @property
    def cached(self) -> int:
        """Registered blocks, held or not."""
        return len(self.block_of)

    def take(self) -> int:
        """A block for one holder: a free one, else the least recently released cached one
        (its prefix forgotten)."""
        if self.free:
            block = heapq.heappop(self.free)
        elif self.lru:
            block, _ = self.lru.popitem(last=False)
            self._unregister(block)
            self.evictions += 1
        else:
            raise ArenaFullError("KV arena full: no free block (raise --kv-cache-memory)")
        self.refs[block] = 1
        return block

    def hold(self, block: int) -> None:
        if self.refs[block] == 0:
            del self.lru[block]
        self.refs[block] += 1

    def drop(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if block in self.key_of:
                self.lru[block] = None
            else:
                heapq.heappush(self.free, block)

    def shared(self, block: int) -> bool:
        return self.refs[block] > 1

    def register(self, block: int, key: bytes, parent: bytes, tokens: tuple[int, ...]) -> bool:
        """Map `key` to `block`, which holds the positions of `tokens` after the prefix
        `parent` names, final; False where another block holds that prefix already or this
        one is registered under another key."""
        if key in self.block_of or block in self.key_of:
            return False
        self.block_of[key] = block
        self.key_of[block] = key
        self.parent_of[block] = parent
        self.children.setdefault(parent, {})[block] = tokens
        return True

    def _unregister(self, block: int) -> None:
        del self.block_of[self.key_of.pop(block)]
        parent = self.parent_of.pop(block)
        siblings = self.children[parent]
        del siblings[block]
        if not siblings:
            del self.children[parent]

    def forget(self, block: int) -> None:
        """Unregister `block` (its content is about to change)."""
        if block in self.key_of:
            self._unregister(block)
            if self.refs[block] == 0:
                del self.lru[block]
                heapq.heappush(self.free, block)

    def find(self, key: bytes) -> int | None:
        return self.block_of.get(key)

    def occupied(self) -> list[int]:
        """Blocks that are not free (held or cached), in id order."""
        free = set(self.free)
        return [b for b in range(self.num_blocks) if b not in free]

    def move(self, src: int, dst: int) -> None:
        """Account `src`'s state to the free block `dst` (the caller copies the data and
        retargets the tables); `src` becomes free."""
        self.free.remove(dst)
        self.refs[dst], self.refs[src] = self.refs[src], 0
        key = self.key_of.pop(src, None)
        if key is not None:
            self.key_of[dst] = key
            self.block_of[key] = dst
            parent = self.parent_of[dst] = self.parent_of.pop(src)
            siblings = self.children[parent]
            siblings[dst] = siblings.pop(src)
            if src in self.lru:
                del self.lru[src]
                self.lru[dst] = None
        self.free.append(src)
        heapq.heapify(self.free)
