"""Token sampling: the same truncations shape draft (q) and main (p).

Temperature 0 means greedy. Otherwise logits / temperature, then min-p (tokens below min_p
times the most likely one's probability dropped), then top-k, then top-p (nucleus),
renormalised (vLLM's order). Probabilities are float64 so that p/q ratios in acceptance are
exact enough. The request's logits processors (bias, penalties: processors.py) and a
grammar's mask come before this.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dspark.runtime.errors import DSparkError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    min_p: float = 0.0  # 0: off

    def __post_init__(self) -> None:
        if not 0 <= self.temperature <= 100:
            raise DSparkError(f"temperature must lie in [0, 100], got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise DSparkError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise DSparkError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise DSparkError(f"min_p must lie in [0, 1], got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """[..., vocab] logits -> processed, normalised probabilities (float64).

    In place on one float64 copy (a sampled round computes this for every draft and every
    verified row: a temporary per step cost three times as much)."""
    x = logits.astype(np.float64)
    # shifted first: a tiny temperature then sends the rest to -inf, never inf - inf = nan;
    # the largest entry is then exactly 0 and top-k keeps it, so no second shift is needed
    x -= x.max(axis=-1, keepdims=True)
    x *= 1.0 / params.temperature
    if params.min_p > 0:  # p >= min_p * p_max, in logits: x >= log(min_p) (the max is 0)
        x[x < np.log(params.min_p)] = -np.inf
    if params.top_k and params.top_k < x.shape[-1]:
        kth = np.partition(x, -params.top_k, axis=-1)[..., -params.top_k, None]
        x[x < kth] = -np.inf
    p = np.exp(x, out=x)
    p /= p.sum(axis=-1, keepdims=True)
    if params.top_p < 1:
        order = np.argsort(-p, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(p, order, axis=-1)
        # keep the smallest prefix whose mass reaches top_p (the token crossing it included)
        drop_sorted = np.cumsum(sorted_p, axis=-1) - sorted_p >= params.top_p
        drop = np.zeros_like(drop_sorted)
        np.put_along_axis(drop, order, drop_sorted, axis=-1)
        p = np.where(drop, 0.0, p)
        p /= p.sum(axis=-1, keepdims=True)
    return p


BLOCK = 512  # sample(): entries per block of the two-level inverse CDF


def sample(p: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from a distribution (normalised or not; inverse CDF, one uniform per draw).
    Two levels: the block holding the draw from the blocks' sums, then the entry within it;
    a cumulative sum over the whole vocabulary costs three times as much."""
    n = len(p)
    full = n - n % BLOCK
    sums = p[:full].reshape(-1, BLOCK).sum(axis=1)
    if full < n:
        sums = np.append(sums, p[full:].sum())
    edges = np.cumsum(sums)
    u = rng.random() * edges[-1]
    block = min(int(np.searchsorted(edges, u, side="right")), len(edges) - 1)
    start = block * BLOCK
    inner = np.cumsum(p[start:start + BLOCK])
    inner += edges[block - 1] if block else 0.0
    return min(start + int(np.searchsorted(inner, u, side="right")), n - 1)
