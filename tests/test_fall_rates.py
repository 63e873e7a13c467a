"""The binary endpoint's statistics (viz/stats.py): fall rates, Fisher's exact test and its power."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from scipy.stats import binom, fisher_exact

from openrlhf_tis.viz.stats import _fisher_rejects, fisher_p, fisher_power, rate_interval, runs_for_power


def test_rate_interval_is_exact_and_brackets_the_rate():
    r = rate_interval(2, 6)
    assert r.estimate == pytest.approx(1 / 3)
    # Clopper–Pearson by its definition: P(X >= 2 | low) = 0.025 and P(X <= 2 | high) = 0.025
    assert binom.sf(1, 6, r.low) == pytest.approx(0.025, abs=1e-6)
    assert binom.cdf(2, 6, r.high) == pytest.approx(0.025, abs=1e-6)
    assert rate_interval(0, 6).low == 0.0 and rate_interval(6, 6).high == 1.0


@pytest.mark.parametrize("n", [3, 7, 12])
def test_rejection_table_agrees_with_scipy_fisher_exact(n):
    rejects = _fisher_rejects(n, 0.05)
    for a, b in itertools.product(range(n + 1), repeat=2):
        p = fisher_exact([[a, n - a], [b, n - b]]).pvalue
        assert rejects[a, b] == (p <= 0.05), (a, b, p)


def test_power_is_the_sum_over_outcomes_scipy_rejects():
    n, pa, pb = 8, 0.6, 0.1
    brute = sum(binom.pmf(a, n, pa) * binom.pmf(b, n, pb) for a, b in itertools.product(range(n + 1), repeat=2)
                if fisher_exact([[a, n - a], [b, n - b]]).pvalue <= 0.05)
    assert fisher_power(pa, pb, n) == pytest.approx(brute, rel=1e-9)
    assert fisher_power(0.3, 0.3, 20) <= 0.05  # equal rates: the test's size, never above alpha
    assert fisher_p(5, 6, 0, 6) == pytest.approx(fisher_exact([[5, 1], [0, 6]]).pvalue)


def test_runs_for_power_is_the_first_n_that_reaches_it():
    n = runs_for_power(0.5, 0.1)
    assert fisher_power(0.5, 0.1, n) >= 0.8
    assert all(fisher_power(0.5, 0.1, m) < 0.8 for m in range(2, n))
    assert runs_for_power(0.2, 0.2) is None
    assert np.isnan(rate_interval(0, 0).estimate)
