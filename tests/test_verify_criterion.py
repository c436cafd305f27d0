"""dsc verify's pass rule: absolute tolerance plus rtol times the original's logit."""

from __future__ import annotations

from dspark.compiler.verify import NOISE_FACTOR, VerifyReport


def report(max_abs: float, beyond: float, noise: float = 0.0) -> VerifyReport:
    return VerifyReport("main", max_abs, 100, 4, 1.0, noise, 2048, 1e-5, beyond)


def test_a_large_logit_may_differ_by_its_relative_share():
    # Gemma 3: 0.00124 on a logit of 61.6 leaves 0.00062 beyond 1e-5 x |logit|
    assert report(0.00124, 0.00062).ok(1e-3)


def test_what_the_relative_share_leaves_must_stay_within_the_tolerance():
    assert not report(0.0025, 0.0015).ok(1e-3)


def test_the_noise_floor_still_widens_the_limit_for_the_remainder():
    assert report(0.5, 0.3, noise=0.1).ok(1e-3)
    assert not report(0.5, NOISE_FACTOR * 0.1 + 0.01, noise=0.1).ok(1e-3)
