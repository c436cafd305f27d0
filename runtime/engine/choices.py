"""`n` choices of one prompt: the first computes the prompt, the others wait until its
prefill is done and then find it in the prefix cache, so the prompt's KV is computed once
and shared block by block (each choice with its own seed, drafting and output)."""

from __future__ import annotations

from dspark.runtime.sequence.request import Sequence


class Choices:
    def __init__(self):
        self.parked: dict[int, tuple[Sequence, list[Sequence]]] = {}  # leader id -> waiting

    def __bool__(self) -> bool:
        return bool(self.parked)

    def park(self, leader: Sequence, followers: list[Sequence]) -> None:
        self.parked[leader.id] = (leader, followers)

    def ready(self) -> list[Sequence]:
        """The choices whose leader has computed its prompt (or ended), to submit now."""
        out = []
        for key, (leader, followers) in list(self.parked.items()):
            if leader.done or not leader.prefilling:
                out += [f for f in followers if not f.done]
                del self.parked[key]
        return out

    def cancel(self, seq: Sequence) -> bool:
        """Drop a waiting choice; False when `seq` is not waiting here."""
        for _, followers in self.parked.values():
            if seq in followers:
                followers.remove(seq)
                return True
        return False
