"""Token ids -> text deltas for streaming: decode the whole completion each time and send
what is new, holding back an unfinished UTF-8 character and any tail that could still turn
out to be the start of a stop string (which must never reach the client)."""

from __future__ import annotations

from collections.abc import Callable


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], stops: tuple[str, ...]):
        self.decode = decode
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.sent = 0

    def delta(self, tokens: list[int], final: bool, text_end: int | None = None) -> str:
        text = self.decode(tokens)
        if text_end is not None:
            text = text[:text_end]
        if not final:
            text = text.rstrip("\ufffd")
            text = text[: max(self.sent, len(text) - self.hold)]
        out, self.sent = text[self.sent:], max(self.sent, len(text))
        return out
