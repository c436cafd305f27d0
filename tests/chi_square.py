"""The chi-square p-value the sampling tests share."""

from __future__ import annotations

import numpy as np
from scipy.stats import chisquare


def chi_square(tokens: np.ndarray, p: np.ndarray) -> float:
    """p-value of sampled `tokens` against distribution p, pooling tokens expected fewer
    than 5 times into one bin."""
    expected = p * len(tokens)
    counts = np.bincount(tokens, minlength=len(p)).astype(float)
    big = expected >= 5
    f_obs = np.append(counts[big], counts[~big].sum())
    f_exp = np.append(expected[big], expected[~big].sum())
    keep = f_exp > 0
    return float(chisquare(f_obs[keep], f_exp[keep] * f_obs[keep].sum()
                           / f_exp[keep].sum()).pvalue)
