"""An n-gram index over one growing token stream, and the frequency-weighted walk that turns
a match into a proposal.

    index:  for n in [min_n, max_n], n-gram -> the positions right after its recent
            occurrences (at most `max_occurrences` each); extend() adds only the new
            tokens' n-grams: O(max_n) per token, no rescans of the context
    walk:   take the longest n whose last-n-tokens key occurred before; follow all those
            occurrences in step; at each step emit the continuation most of the still
            agreeing occurrences share (ties: the most recent) and keep only those
            occurrences; a step's agreement is that share. Longer keys are tried first, as
            in vLLM's and llama.cpp's n-gram lookup; the vote is SuffixDecoding's
            frequency-weighted tree walk, flattened to its most likely path (verification
            is a single causal window). How far a proposal can be trusted is learned from
            verification, per match length (lookup.py).
"""

from __future__ import annotations

from collections import Counter


class NgramIndex:
    def __init__(self, min_n: int = 1, max_n: int = 4, max_occurrences: int = 16):
        self.min_n, self.max_n, self.max_occurrences = min_n, max_n, max_occurrences
        self.tokens: list[int] = []
        self.table: dict[tuple[int, ...], list[int]] = {}

    def extend(self, tokens: list[int]) -> None:
        """Append tokens to the stream (only the part not yet indexed is read)."""
        for t in tokens:
            self.tokens.append(t)
            end = len(self.tokens)
            for n in range(self.min_n, min(self.max_n, end) + 1):
                ends = self.table.setdefault(tuple(self.tokens[end - n:end]), [])
                ends.append(end)
                if len(ends) > 2 * self.max_occurrences:
                    del ends[:-self.max_occurrences]

    def sync(self, stream: list[int]) -> None:
        """Index whatever `stream` (which only ever grows) holds beyond what is indexed."""
        if len(stream) > len(self.tokens):
            self.extend(stream[len(self.tokens):])

    def match(self, tail: list[int]) -> tuple[int, list[int]]:
        """(n, positions following earlier occurrences of the longest indexed n-token suffix
        of `tail`), most recent last; the stream's own end is excluded (it has no
        continuation yet). (0, []) when nothing matches."""
        limit = len(self.tokens)
        for n in range(min(self.max_n, len(tail)), self.min_n - 1, -1):
            ends = [e for e in self.table.get(tuple(tail[-n:]), ()) if e < limit]
            if ends:
                return n, ends[-self.max_occurrences:]
        return 0, []

    def walk(self, tail: list[int], k: int) -> tuple[int, list[int], list[float]]:
        """(match length n, up to k proposed tokens continuing `tail`, per-step agreement:
        the share of the still-following occurrences that vote for the step's token)."""
        n, live = self.match(tail)
        stream, end = self.tokens, len(self.tokens)
        tokens, agree = [], []
        for step in range(k):
            nxt = [(stream[e + step], e) for e in live if e + step < end]
            if not nxt:
                break
            token = nxt[-1][0]
            if len(nxt) == 1 or all(t == token for t, _ in nxt):  # one continuation: no vote
                tokens.append(token)
                agree.append(1.0)
                live = [e for _, e in nxt]
                continue
            counts = Counter(t for t, _ in nxt)
            best = max(counts.values())
            token = next(t for t, _ in reversed(nxt) if counts[t] == best)  # most recent
            tokens.append(token)
            agree.append(best / len(nxt))
            live = [e for t, e in nxt if t == token]
        return n, tokens, agree
