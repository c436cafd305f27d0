"""Token-for-token comparison against a reference greedy run, forgiving only measured near-ties.

Batched and single-sequence forwards sum in different orders, so a greedy path may fork
where the reference's top-1 and top-2 logits are within ~1e-4 (docs/architecture.md).
Such a fork is reported; any other difference fails.
"""

from __future__ import annotations

import numpy as np

NEAR_TIE = 1e-4


def first_fork(got: list[int], ref: list[int], prompt: list[int], original, eos: set[int],
               finish: str | None, tie: float = NEAR_TIE) -> str | None:
    """None when equal; a description of a forgiven near-tie fork (the token taken within
    `tie` of the reference's top-1 there); AssertionError otherwise."""
    for i, (a, b) in enumerate(zip(got, ref)):
        if a == b:
            continue
        logits, _ = original.forward(prompt + ref[:i], original.empty_past())
        row = logits[-1].astype(np.float64)
        gap = float(row.max() - row[a])
        assert gap <= tie, (f"token {i}: got {a}, reference {b}; its logit is {gap:.3g} below "
                            "the top-1's: no near-tie")
        return f"fork at token {i} (gap to the top-1 {gap:.2e})"
    if finish == "stop" and len(got) < len(ref):
        assert ref[len(got)] in eos, f"stopped at {len(got)} but the reference goes on"
        return None
    assert len(got) == len(ref), (len(got), len(ref))
    return None
