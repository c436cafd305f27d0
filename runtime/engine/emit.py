"""Appending a round's tokens to a sequence, and when it stops."""

from __future__ import annotations

import time
from collections.abc import Callable

from dspark.runtime.sequence.request import Sequence


def emit(seq: Sequence, tokens: list[int], eos_ids: frozenset[int],
         decode: Callable[[list[int]], str] | None, step: int) -> None:
    """Append tokens until EOS (not appended; finish "stop"), max_tokens ("length") or a
    stop string in the decoded text ("stop", the text cut before it)."""
    req = seq.request
    for token in tokens:
        if token in eos_ids:
            seq.finish_reason = "stop"
            return
        seq.tokens.append(token)
        if seq.processors is not None:
            seq.processors.emit([token])
        if seq.first_token_at is None:
            seq.first_token_at = time.perf_counter()
            seq.first_token_step = step
        if len(seq.generated) >= req.max_tokens:
            seq.finish_reason = "length"
        if req.stop and decode is not None:
            text = decode(seq.generated)
            hits = [i for i in (text.find(s) for s in req.stop) if i >= 0]
            if hits:
                seq.finish_reason, seq.text_end = "stop", min(hits)
        if seq.finish_reason:
            return
