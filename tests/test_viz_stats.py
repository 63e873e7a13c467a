"""Intervals, the "shown" rule, p-values, detectable effects and Holm's adjustment: hand-computed cases (float64
closed forms written here: Student's t with 1 and 2 degrees of freedom has an elementary CDF; the detectable
effect's power recomputed from scipy's noncentral t and, independently of any noncentral t code, by integrating the
normal over the sample spread's chi distribution) and properties."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import integrate
from scipy.stats import nct
from scipy.stats import t as student_t

from openrlhf_tis.viz.stats import (
    Interval,
    bootstrap_interval,
    detectable_effect,
    holm,
    shown,
    t_band,
    t_interval,
    t_test_p,
)

finite = st.floats(-10, 10, allow_nan=False, allow_infinity=False)


def test_t_interval_of_three_seeds_by_hand():
    # mean 0.2, s = sqrt((0.01 + 0.01 + 0) / 2) = 0.1; t(0.975, 2) solves t / sqrt(2 + t²) = 0.95 (the df = 2 CDF)
    t2 = 0.95 * math.sqrt(2.0 / (1.0 - 0.95**2))
    half = t2 * 0.1 / math.sqrt(3.0)
    got = t_interval([0.1, 0.3, 0.2])
    assert (got.estimate, got.n) == (pytest.approx(0.2), 3)
    assert got.low == pytest.approx(0.2 - half, abs=1e-12) and got.high == pytest.approx(0.2 + half, abs=1e-12)
    assert half == pytest.approx(0.24841, abs=1e-5)


def test_t_interval_half_widths_against_the_table():
    # half-width / (s / sqrt(n)) is t(0.975, n − 1): 3.182 (df 3), 2.228 (df 10), 2.042 (df 30)
    for n, table in ((4, 3.182446305284263), (11, 2.228138851986274), (31, 2.042272456301238)):
        values = np.arange(n, dtype=np.float64)
        got = t_interval(values)
        assert (got.high - got.estimate) / (values.std(ddof=1) / math.sqrt(n)) == pytest.approx(table, rel=1e-9)


@given(a=finite, b=finite, c=finite, level=st.floats(0.5, 0.999))
@settings(max_examples=60, deadline=None)
def test_t_intervals_and_p_values_of_two_and_three_values_in_closed_form(a, b, c, level):
    # df = 1 is the Cauchy: F(t) = 1/2 + atan(t) / pi, so t(1/2 + level/2, 1) = tan(pi level / 2);
    # df = 2: F(t) = 1/2 + t / (2 sqrt(2 + t²)), so t(1/2 + level/2, 2) = level sqrt(2 / (1 − level²))
    for values, quantile, tail in (
        ([a, b], math.tan(math.pi * level / 2.0), lambda t: 1.0 - 2.0 * math.atan(t) / math.pi),
        ([a, b, c], level * math.sqrt(2.0 / (1.0 - level**2)), lambda t: 1.0 - t / math.sqrt(2.0 + t * t)),
    ):
        x = np.array(values)
        se = x.std(ddof=1) / math.sqrt(len(x))
        got = t_interval(x, level)
        assert got.high - got.estimate == pytest.approx(quantile * se, rel=1e-9, abs=1e-12)
        if se > 1e-6:
            assert t_test_p(x) == pytest.approx(tail(abs(x.mean()) / se), rel=1e-9, abs=1e-12)


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


def _t2_quantile(p: float) -> float:
    """Student's t quantile with 2 df in closed form: F(t) = 1/2 + t / (2 sqrt(2 + t²))."""
    q = 2.0 * p - 1.0
    return q * math.sqrt(2.0 / (1.0 - q * q))


def _power_from_nct(delta: float, sd: float, n: int) -> float:
    """P(|T| > t(0.975, n − 1)) for T ~ nct(n − 1, delta sqrt(n) / sd), both tails straight from scipy's nct."""
    c, nc = student_t.ppf(0.975, n - 1), delta * math.sqrt(n) / sd
    return float(nct.sf(c, n - 1, nc) + nct.cdf(-c, n - 1, nc))


def _power_by_integration(delta: float, sd: float, n: int) -> float:
    """The same power with no noncentral t code: T = (Z + nc) / (U / sqrt(df)) with Z standard normal and U ~ chi(df)
    independent, so P(|T| > c) = E[Phi(−c U / sqrt(df) − nc) + Phi(nc − c U / sqrt(df))] over U, integrated by
    quadrature from the chi density and the normal CDF written out."""
    df, nc = n - 1, delta * math.sqrt(n) / sd
    c = student_t.ppf(0.975, df)
    log_norm = (df / 2.0 - 1.0) * math.log(2.0) + math.lgamma(df / 2.0)  # chi(df) density: u^(df−1) e^(−u²/2) / this
    phi = lambda x: 0.5 * math.erfc(-x / math.sqrt(2.0))  # noqa: E731

    def rejects(u: float) -> float:
        scaled = c * u / math.sqrt(df)
        density = math.exp((df - 1) * math.log(u) - u * u / 2.0 - log_norm)  # quad never evaluates u = 0
        return density * (phi(-scaled - nc) + phi(nc - scaled))

    return integrate.quad(rejects, 0.0, np.inf, epsabs=1e-12, epsrel=1e-12, limit=200)[0]


def test_paired_p_value_and_detectable_effect_of_three_pairs_by_hand():
    # W5A8 seq_mis minus the reference, per seed, as in the core grid: mean -0.149, s = 0.0503, t = -5.13 on 2 df
    d = np.array([-0.204, -0.106, -0.137])
    mean, s = d.mean(), math.sqrt(((d - d.mean()) ** 2).sum() / 2.0)
    t = mean / (s / math.sqrt(3.0))
    two_sided = 1.0 - abs(t) / math.sqrt(2.0 + t * t)  # 2 (1 - F(|t|)) for df = 2
    assert t_test_p(d) == pytest.approx(two_sided, rel=1e-9) and two_sided == pytest.approx(0.0357, abs=1e-4)
    # the detectable δ has exactly 80% power, and 1% less has less
    mde = detectable_effect(s, 3)
    for power in (_power_from_nct, _power_by_integration):
        assert power(mde, s, 3) == pytest.approx(0.80, abs=1e-6) and power(0.99 * mde, s, 3) < 0.80
    # larger than the shortcut (t(0.975, 2) + t(0.80, 2)) s / sqrt(3) = (4.3027 + 1.0607) s / sqrt(3) = 0.1551, which
    # has only 77% power: the central t shifted by δ sqrt(n) / s is too narrow at 2 df
    shortcut = (_t2_quantile(0.975) + _t2_quantile(0.80)) * s / math.sqrt(3.0)
    assert mde == pytest.approx(0.1635, abs=1e-4) and mde > 1.05 * shortcut
    assert _power_from_nct(shortcut, s, 3) == pytest.approx(0.766, abs=1e-3)
    assert detectable_effect(0.09, 3) == pytest.approx(0.2938, abs=1e-4)  # 0.29 by the shortcut


def test_two_pairs_by_hand_and_too_few_pairs_or_no_spread_give_nan():
    # df = 1 is the Cauchy: F(t) = 1/2 + atan(t) / pi; differences 0.1, 0.3: mean 0.2, s = sqrt(0.02), t = 2
    assert t_test_p([0.1, 0.3]) == pytest.approx(1.0 - 2.0 * math.atan(2.0) / math.pi, rel=1e-9)
    # scipy's nct.cdf is NaN this far out in the lower tail (nc = 16.3), so the power is checked by integration only;
    # the shortcut (tan(0.475 pi) + tan(0.3 pi)) s / sqrt(2) = 1.408 has 73% power, the exact δ is 16% larger
    mde = detectable_effect(math.sqrt(0.02), 2)
    assert _power_by_integration(mde, math.sqrt(0.02), 2) == pytest.approx(0.80, abs=1e-6)
    assert _power_by_integration(0.99 * mde, math.sqrt(0.02), 2) < 0.80
    assert mde == pytest.approx(1.6334, abs=1e-4)
    assert _power_by_integration((math.tan(0.475 * math.pi) + math.tan(0.3 * math.pi)) * 0.1, math.sqrt(0.02),
                                 2) == pytest.approx(0.731, abs=1e-3)
    assert math.isnan(t_test_p([0.4])) and math.isnan(t_test_p([0.4, float("nan")]))
    assert math.isnan(detectable_effect(0.1, 1)) and math.isnan(detectable_effect(float("nan"), 3))
    assert math.isnan(detectable_effect(0.0, 3))  # pairs that do not spread: no estimate of what was detectable
    assert t_test_p([0.0, 0.0, 0.0]) == 1.0 and t_test_p([0.1, 0.1]) == 0.0  # no spread: the degenerate test
    with pytest.raises(ValueError):
        detectable_effect(0.1, 3, power=0.04)  # below α: no δ > 0 has it


def test_holm_by_hand():
    # sorted 0.01, 0.03, 0.04 -> 3 * 0.01, 2 * 0.03, max(0.06, 1 * 0.04): back in the given order
    np.testing.assert_allclose(holm([0.01, 0.04, 0.03]), [0.03, 0.06, 0.06], rtol=1e-12)
    np.testing.assert_allclose(holm([0.5, 0.6]), [1.0, 1.0])  # capped at 1
    got = holm([0.02, float("nan"), 0.04])  # no test: not in the family (m = 2)
    assert math.isnan(got[1]) and got[[0, 2]] == pytest.approx([0.04, 0.04])
    assert holm([]).shape == (0,)


@given(p=st.lists(st.one_of(st.floats(0.0, 1.0), st.just(float("nan"))), min_size=1, max_size=15))
@settings(max_examples=100, deadline=None)
def test_holm_is_at_least_the_raw_p_at_most_1_and_keeps_the_order(p):
    raw = np.array(p)
    adjusted = holm(raw)
    tested = np.isfinite(raw)
    assert (np.isnan(adjusted) == ~tested).all()
    raw, adjusted = raw[tested], adjusted[tested]
    assert (adjusted >= raw - 1e-15).all() and (adjusted <= 1.0).all()
    order = np.argsort(raw, kind="stable")
    assert (np.diff(adjusted[order]) >= 0).all()  # monotone in the order of the raw p-values
    assert (adjusted <= np.minimum(1.0, len(raw) * raw) + 1e-15).all()  # never stricter than Bonferroni


@given(sd=st.floats(1e-3, 10.0), n=st.integers(2, 60))
@settings(max_examples=80, deadline=None)
def test_the_detectable_effect_has_80_percent_power_shrinks_as_pairs_are_added_and_scales_with_the_spread(sd, n):
    mde = detectable_effect(sd, n)
    assert _power_by_integration(mde, sd, n) == pytest.approx(0.80, abs=1e-6)
    assert detectable_effect(sd, n + 1) < mde
    assert detectable_effect(2.0 * sd, n) == pytest.approx(2.0 * mde, rel=1e-9)
    # more than the 95% interval's half-width: the test must clear it, and 80% of the time
    assert mde > student_t.ppf(0.975, n - 1) * sd / math.sqrt(n)


@given(values=st.lists(st.floats(-1, 1), min_size=2, max_size=8).filter(lambda v: np.std(v) > 1e-6))
@settings(max_examples=80, deadline=None)
def test_p_below_005_exactly_when_the_t_interval_excludes_0(values):
    p = t_test_p(values)
    assert 0.0 <= p <= 1.0
    interval = t_interval(values)
    if abs(p - 0.05) > 1e-6:  # away from the boundary, where rounding could split them
        assert (p < 0.05) == interval.excludes(0.0)
