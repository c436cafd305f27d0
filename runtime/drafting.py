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


def confidence(p: np.ndarray) -> tuple[float, float]:
    """(top-1 probability, entropy in nats of the renormalised top-3) of a distribution."""
    top3 = np.partition(p, -3)[-3:]
    top3 = top3 / top3.sum()
    top3 = top3[top3 > 0]
    return float(p.max()), float(-(top3 * np.log(top3)).sum())


def draw(seq: Sequence, logits: np.ndarray, record: bool) -> None:
    """Append one draft token (greedy or sampled from the processed q) to `seq.drafts`."""
    params: SamplingParams = seq.request.sampling
    if params.greedy:
        seq.drafts.append(int(logits.argmax()))
        q = probabilities(logits, SamplingParams(temperature=1.0)) if record else None
    else:
        q = probabilities(logits, params)
        seq.drafts.append(sample(q, seq.rng))
        seq.draft_probs.append(q)
    if record:
        seq.draft_conf.append(confidence(q))


def run_drafts(runner: ModelRunner, batch: list[Sequence], keep_drafting, catch_up: int,
               record: bool) -> None:
    """Draft for every sequence with seq.window > len(seq.drafts), batched per position."""
    active = [s for s in batch if s.window > len(s.drafts)]
    while active:
        chunks, rows = [], []
        for s in active:
            behind = s.tokens + s.drafts
            feed = behind[s.draft_cached:s.draft_cached + catch_up]
            chunks.append((s.id, s.draft_cached, feed))
            rows.append(1 if s.draft_cached + len(feed) == len(behind) else 0)
        logits = runner.forward(chunks, rows)
        for s, (_, start, feed), out, row in zip(active, chunks, logits, rows):
            s.draft_cached = start + len(feed)
            if row:
                draw(s, out[-1], record)
            else:
                s.window = len(s.drafts)  # still catching up: no new draft this round
        active = [s for s in active if s.window > len(s.drafts) and keep_drafting(s)]
