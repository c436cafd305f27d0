"""samples/policy_units.py's pricing: a round costs its forward's size on the verify curve,
and a run's own curve comes from its medians, the sizes seldom seen filled in between."""

from __future__ import annotations

import pytest

units = pytest.importorskip("policy_units")


def test_a_forward_costs_its_size_on_the_curve_and_past_it_the_last_step():
    curve = [1.0, 1.4, 1.6, 2.0]
    assert units.price(curve, 1) == 1.0 and units.price(curve, 3) == 1.6
    assert units.price(curve, 6) == pytest.approx(2.0 + 2 * 0.4)


def test_the_runs_own_curve_interpolates_the_sizes_seen_seldom():
    forwards = {1: [5.0] * 9 + [50.0],  # a median, not a mean: one outlier changes nothing
                2: [7.0, 7.0, 7.5],
                3: [20.0],  # seen once: filled in between its neighbours
                4: [10.0, 10.0, 10.0],
                6: [15.0]}  # past the last well-seen size: its step extended
    curve = units.own_curve(forwards)
    assert curve[:2] == [1.0, pytest.approx(1.4)]
    assert curve[2] == pytest.approx((1.4 + 2.0) / 2)
    assert curve[3] == pytest.approx(2.0)
    assert curve[4] == pytest.approx(2.3) and curve[5] == pytest.approx(2.6)


def test_with_no_verify_size_seen_often_every_size_counts_as_measured():
    curve = units.own_curve({1: [4.0] * 5, 2: [6.0], 3: [8.0]})
    assert curve == [1.0, pytest.approx(1.5), pytest.approx(2.0)]
