"""The draft phase: every speculative sequence drafts up to its window, all in one forward
per position.

A sequence's draft input is what the draft model has not seen of `tokens + drafts` (its
catch-up: the prompt, the last round's accepted tokens, held drafts), then each new draft.
Long catch-ups are fed in chunks with no draft that round, like prompts are to the main.
Per drafted position the draft's confidence is recorded: its top-1 probability and the
entropy of its renormalised top-3, for the window policies.
"""

from __future__ import annotations

import numpy as np

from dspark.runtime.model_runner import ModelRunner
from dspark.runtime.request import Sequence
from dspark.runtime.sampling import SamplingParams, probabilities, sample
from dspark.runtime.token_map import TokenMap


def confidence(p: np.ndarray) -> tuple[float, float]:
    """(top-1 probability, entropy in nats of the renormalised top-3) of a distribution."""
    top3 = np.partition(p, -3)[-3:]
    top3 = top3 / top3.sum()
    top3 = top3[top3 > 0]
    return float(p.max()), float(-(top3 * np.log(top3)).sum())


def draw(seq: Sequence, logits: np.ndarray, record: bool, tmap: TokenMap | None) -> bool:
    """Append one draft token (greedy, or sampled from the processed q) to `seq.drafts`, as
    a main id; False when the draft's token has no main equivalent (the window ends)."""
    params: SamplingParams = seq.request.sampling
    if params.greedy:
        token = int(logits.argmax())
        q = probabilities(logits, SamplingParams(temperature=1.0)) if record else None
    else:
        q = probabilities(logits, params)
        if tmap is not None:  # propose only mapped tokens: sample from q restricted to them
            mapped = np.where(tmap.draft_to_main >= 0, q, 0.0)
            if mapped.sum() <= 0:
                return False
            token = sample(mapped / mapped.sum(), seq.rng)
        else:
            token = sample(q, seq.rng)
    if tmap is not None:
        token = int(tmap.draft_to_main[token])
        if token < 0:
            return False
    seq.drafts.append(token)
    if not params.greedy:
        seq.draft_probs.append(tmap.main_probabilities(q)[0] if tmap is not None else q)
    if record:
        seq.draft_conf.append(confidence(q))
    return True


def run_drafts(runner: ModelRunner, batch: list[Sequence], keep_drafting, catch_up: int,
               record: bool, tmap: TokenMap | None = None, room=None) -> None:
    """Draft for every sequence with seq.window > len(seq.drafts), batched per position.
    With a token map the draft reads main tokens translated to its ids; `room(seq)` is the
    draft positions a sequence may use (expansions can run ahead of the main's)."""
    active = [s for s in batch if s.window > len(s.drafts)]
    while active:
        chunks, rows, fed, stalled = [], [], [], []
        for s in active:
            behind = s.tokens + s.drafts
            feed = behind[s.draft_cached:s.draft_cached + catch_up]
            pieces = [tmap.pieces(t) for t in feed] if tmap else [[t] for t in feed]
            width = sum(len(p) for p in pieces)
            if room is not None and s.draft_offsets[-1] + width > room(s):
                s.window = len(s.drafts)  # no room left for the draft: plain rounds
                stalled.append(s)
                continue
            chunks.append((s.id, s.draft_offsets[-1], [d for p in pieces for d in p]))
            rows.append(1 if s.draft_cached + len(feed) == len(behind) else 0)
            fed.append(pieces)
        active = [s for s in active if s not in stalled]
        if not active:
            return
        logits = runner.forward(chunks, rows)
        for s, pieces, out, row in zip(active, fed, logits, rows):
            for p in pieces:
                s.draft_offsets.append(s.draft_offsets[-1] + len(p))
            s.draft_cached += len(pieces)
            if not row or not draw(s, out[-1], record, tmap):
                s.window = len(s.drafts)  # catching up, or an unmapped token: window ends
        active = [s for s in active if s.window > len(s.drafts) and keep_drafting(s)]
