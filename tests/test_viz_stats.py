"""Intervals and the "shown" rule: hand-computed cases (float64 formulas written here) and properties."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from openrlhf_tis.viz.stats import Interval, bootstrap_interval, shown, t_band, t_cdf, t_interval, t_quantile

finite = st.floats(-10, 10, allow_nan=False, allow_infinity=False)


def test_t_interval_of_three_seeds_by_hand():
    # mean 0.2, s = sqrt((0.01 + 0.01 + 0) / 2) = 0.1; t(0.975, 2) solves t / sqrt(2 + t²) = 0.95 (the df = 2 CDF)
    t2 = 0.95 * math.sqrt(2.0 / (1.0 - 0.95**2))
    half = t2 * 0.1 / math.sqrt(3.0)
    got = t_interval([0.1, 0.3, 0.2])
    assert (got.estimate, got.n) == (pytest.approx(0.2), 3)
    assert got.low == pytest.approx(0.2 - half, abs=1e-12) and got.high == pytest.approx(0.2 + half, abs=1e-12)
    assert half == pytest.approx(0.24841, abs=1e-5)


def test_t_quantiles_against_closed_forms_and_the_table():
    assert t_quantile(0.975, 1) == pytest.approx(math.tan(0.475 * math.pi), rel=1e-10)  # Cauchy: 12.706
    for df, table in ((3, 3.182446305284263), (10, 2.228138851986274), (30, 2.042272456301238)):
        assert t_quantile(0.975, df) == pytest.approx(table, rel=1e-9)
    assert t_quantile(0.975, 1e6) == pytest.approx(1.959964, rel=1e-5)  # → the normal quantile
    assert t_quantile(0.025, 4) == pytest.approx(-t_quantile(0.975, 4))
    with pytest.raises(ValueError):
        t_quantile(1.0, 3)


@given(p=st.floats(0.5001, 0.9995), df=st.floats(1.0, 300.0))
@settings(max_examples=60, deadline=None)
def test_t_quantile_inverts_the_cdf_and_shrinks_with_df(p, df):
    t = t_quantile(p, df)
    assert t_cdf(t, df) == pytest.approx(p, abs=1e-9)
    assert t_quantile(p, df + 1.0) <= t + 1e-9
    # df = 2 has a closed form: F(t) = 1/2 + t / (2 sqrt(2 + t²))
    q = 2.0 * p - 1.0
    assert t_quantile(p, 2.0) == pytest.approx(q * math.sqrt(2.0 / (1.0 - q * q)), rel=1e-8)


@given(values=st.lists(finite, min_size=2, max_size=8), shift=finite, scale=st.floats(0.1, 10.0))
@settings(max_examples=80, deadline=None)
def test_t_interval_moves_with_shifts_and_scales_with_the_data(values, shift, scale):
    base = t_interval(values)
    moved = t_interval([scale * v + shift for v in values])
    assert moved.estimate == pytest.approx(scale * base.estimate + shift, abs=1e-9)
    assert moved.high - moved.low == pytest.approx(scale * (base.high - base.low), rel=1e-9, abs=1e-9)
    assert base.low <= base.estimate <= base.high


def test_too_few_seeds_give_no_interval_and_nothing_is_shown():
    one = t_interval([0.4, float("nan")])
    assert one.estimate == 0.4 and not one.defined and not one.excludes(0.0)
    assert not shown(one) and not shown()
    assert shown(Interval(0.3, 0.1, 0.5, 3)) and not shown(Interval(0.3, -0.1, 0.5, 3))
    # every defined interval must exclude the null; an undefined one (no per-question scores) is skipped
    assert not shown(Interval(0.3, 0.1, 0.5, 3), Interval(0.3, -0.2, 0.6, 3))
    assert shown(Interval(0.3, 0.1, 0.5, 3), Interval(0.3, np.nan, np.nan, 3))
    assert shown(Interval(-0.3, -0.5, -0.1, 3)) and shown(Interval(0.3, 0.25, 0.5, 3), null=0.2)


def test_bootstrap_of_two_seeds_and_two_questions_against_its_exact_distribution():
    # Seeds and questions are each drawn with counts (2,0), (1,1), (0,2) with probabilities 1/4, 1/2, 1/4; the
    # smallest replicate (seed 0 twice, question 0 twice) is d[0,0] = 0 with probability 1/16 > 2.5%, the largest
    # d[1,1] = 3 likewise, so the 95% percentile interval is exactly [0, 3].
    d = np.array([[0.0, 1.0], [2.0, 3.0]])
    got = bootstrap_interval(d, reps=20000)
    assert (got.low, got.high, got.estimate) == (0.0, 3.0, 1.5)
    assert not bootstrap_interval(d[:1]).defined  # one seed: no interval over seeds


@given(d=st.lists(st.lists(st.floats(-1, 1), min_size=3, max_size=3), min_size=2, max_size=4), shift=finite)
@settings(max_examples=40, deadline=None)
def test_bootstrap_stays_within_the_data_and_moves_with_it(d, shift):
    d = np.array(d)
    got = bootstrap_interval(d, reps=500)
    assert d.min() - 1e-12 <= got.low <= got.high <= d.max() + 1e-12  # replicates are weighted means of d
    moved = bootstrap_interval(d + shift, reps=500)
    assert moved.low == pytest.approx(got.low + shift, abs=1e-9) and moved.high == pytest.approx(got.high + shift,
                                                                                                  abs=1e-9)
    constant = bootstrap_interval(np.full_like(d, shift), reps=200)
    assert constant.low == pytest.approx(shift) and constant.high == pytest.approx(shift)


@given(rows=st.lists(st.lists(st.one_of(finite, st.just(float("nan"))), min_size=3, max_size=3), min_size=1,
                     max_size=6))
@settings(max_examples=60, deadline=None)
def test_a_curve_band_is_the_t_interval_of_each_step(rows):
    mean, low, high = t_band(np.array(rows))
    for i, row in enumerate(rows):
        expected = t_interval(row)
        for got, want in ((mean[i], expected.estimate), (low[i], expected.low), (high[i], expected.high)):
            assert (math.isnan(got) and math.isnan(want)) or got == pytest.approx(want, abs=1e-9)
