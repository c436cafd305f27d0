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


def mixed_prompts(seed: int = 3) -> list[list[int]]:
    """Random prompts of 1-40 ids, and one that repeats itself (lookup drafts hold there)."""
    rng = np.random.default_rng(seed)
    prompts = [[int(t) for t in rng.integers(0, 300, n)] for n in (1, 5, 13, 40)]
    return prompts + [list(range(7, 27)) * 3]


def three_ways(bundle, prompts: list[list[int]], max_new: int = 30) -> dict[str, list]:
    """Each prompt's greedy tokens, batched: plain, with the bundle's draft model and with
    lookup drafts (windows of 4); the draft model must have been tried (20 accepted)."""
    from dspark.runtime.engine.engine import Engine
    from dspark.runtime.sequence.request import GenerationRequest

    runs = {}
    for method, window in (("plain", 1), ("draft", 4), ("lookup", 4)):
        seqs = Engine(bundle, "fixed", window, max_batch=len(prompts)).generate(
            [GenerationRequest(tuple(p), max_new, speculative=method != "plain",
                               method=None if method == "plain" else method) for p in prompts])
        runs[method] = [s.generated for s in seqs]
        if method == "draft":
            assert sum(s.stats.accepted_tokens for s in seqs) >= 20
    return runs


def check_self_drafted(bundle, path, forgiven: int = 1) -> None:
    """A bundle whose draft is its main (`path`): on mixed_prompts, draft and lookup
    speculation give plain decoding's tokens, and plain decoding gives the original's own
    greedy tokens on all prompts but `forgiven` (a float ulp apart, a rounding model's
    logits move by verify's floor)."""
    from dspark.compiler.reference import OriginalModel

    prompts = mixed_prompts()
    runs = three_ways(bundle, prompts)
    assert runs["draft"] == runs["plain"] and runs["lookup"] == runs["plain"]
    original = OriginalModel(path)
    same = sum(got == original.greedy(p, 30) for p, got in zip(prompts, runs["plain"]))
    assert same >= len(prompts) - forgiven


def assert_greedy_like_original(bundle, original, prompts: list[list[int]], max_new: int = 30,
                                modes=((False, 1), (True, 4)), max_forks: int = 1) -> None:
    """Batched, plain and with lookup drafts at each (speculative, window) of `modes`: the
    same tokens each way, and the original's greedy tokens (at most `max_forks` near-tie
    forks forgiven)."""
    from dspark.runtime.engine.engine import Engine
    from dspark.runtime.sequence.request import GenerationRequest

    refs = [original.greedy(p, max_new) for p in prompts]
    plain = None
    for speculative, window in modes:
        seqs = Engine(bundle, "fixed", window, max_batch=len(prompts)).generate(
            [GenerationRequest(tuple(p), max_new, speculative=speculative, method="lookup")
             for p in prompts])
        plain = plain or [s.generated for s in seqs]
        assert [s.generated for s in seqs] == plain, (speculative, window)
        forks = [f for p, s, r in zip(prompts, seqs, refs)
                 if (f := first_fork(s.generated, r, p, original, set(), s.finish_reason))]
        assert len(forks) <= max_forks, (speculative, window, forks)
