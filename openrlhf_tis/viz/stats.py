"""95% intervals for held-out gains, and the rule that says when a claim is "shown" (numpy and scipy.stats).

Two intervals, because a gain varies in two ways: between training seeds (what a user re-running the recipe
sees) and between the questions it is scored on (a score over 64 questions is itself a sample):
- `t_interval`: Student t over seeds, the n per-seed gains taken as independent draws. With 2 seeds
  t(0.975, 1) = 12.7, so two seeds can show only a very large effect; that is the honest price of 2 seeds.
- `bootstrap_interval`: a paired two-level bootstrap over seeds × questions, from each run's per-question
  scores: seeds and questions are resampled with replacement, the same questions for "before" and "after"
  (and for both settings of a comparison), so the question-to-question spread that both share cancels.

A claim is `shown` only when every interval that could be computed excludes the null value (0 for a gain;
0 for a difference of gains between a setting and the reference, paired by seed). Student t's quantiles and tails,
central and noncentral, come from scipy.stats rather than code of our own: a well-kept library is checked over far
more of (p, df) than our tests could be.

What a comparison could have seen, and what survives the number of comparisons made (docs/study.md):
- `t_test_p`: the two-sided p-value of the paired t-test whose interval `t_interval` draws (p < 0.05 exactly
  when that 95% interval excludes 0).
- `detectable_effect`: the smallest true difference δ the paired t-test finds with 80% power at two-sided
  α = 0.05, from the comparison's own spread s over n pairs. Exact: with a true difference δ the test statistic is
  noncentral t with n − 1 df and noncentrality δ√n/s, and δ solves P(|T| > t(1 − α/2, n − 1)) = 0.80 (both tails).
  The textbook shortcut (t(1 − α/2, n − 1) + t(power, n − 1)) · s/√n, a central t shifted by δ√n/s, falls short
  where it matters here: at 2 and 3 pairs its δ has 73% and 77% power, and the exact δ is 16% and 5% larger.
- `holm`: Holm's step-down adjustment (Holm 1979, Scand. J. Statist. 6:65–70), which keeps the chance of any
  false "shown" in a family of m comparisons at α without assuming them independent. Scipy has no Holm (only
  statsmodels, which this project does not depend on); the step-down is three numpy lines.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
from scipy.optimize import brentq
from scipy.stats import nct
from scipy.stats import t as student_t

LEVEL = 0.95
POWER = 0.80


@dataclass(frozen=True)
class Interval:
    """A point estimate with its two-sided interval; NaN bounds when there is too little data for one."""

    estimate: float
    low: float
    high: float
    n: int  # seeds behind it

    @property
    def defined(self) -> bool:
        return bool(np.isfinite(self.low) and np.isfinite(self.high))

    def excludes(self, value: float = 0.0) -> bool:
        """True when the interval exists and lies wholly above or below `value`."""
        return self.defined and (self.low > value or self.high < value)


def t_interval(values: np.ndarray | list[float], level: float = LEVEL) -> Interval:
    """Mean of the finite `values` ± t(level, n − 1) · s / √n; NaN bounds with fewer than 2 values."""
    x = np.asarray(values, dtype=np.float64)
    x = x[np.isfinite(x)]
    n = len(x)
    if n == 0:
        return Interval(float("nan"), float("nan"), float("nan"), 0)
    mean = float(x.mean())
    if n < 2:
        return Interval(mean, float("nan"), float("nan"), n)
    half = float(student_t.ppf(0.5 + level / 2.0, n - 1)) * float(x.std(ddof=1)) / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n)


def t_test_p(values: np.ndarray | list[float]) -> float:
    """Two-sided p-value of the one-sample t-test of mean 0 over the finite `values` (paired differences); NaN with
    fewer than 2 values. With no spread the test is degenerate: 0 when the mean is not 0, 1 when every value is 0."""
    x = np.asarray(values, dtype=np.float64)
    x = x[np.isfinite(x)]
    if len(x) < 2:
        return float("nan")
    mean, sd = float(x.mean()), float(x.std(ddof=1))
    if sd == 0.0:
        return 1.0 if mean == 0.0 else 0.0
    return float(2.0 * student_t.sf(abs(mean) / (sd / math.sqrt(len(x))), len(x) - 1))


def detectable_effect(sd: float, n: int, level: float = LEVEL, power: float = POWER) -> float:
    """The minimum detectable effect of a paired t-test over n pairs whose differences spread by `sd`: the smallest
    true mean difference δ it finds with probability `power` at two-sided 1 − `level`, solved exactly from the
    noncentral t (module docstring). NaN with fewer than 2 pairs, or a spread that is not finite and positive: pairs
    that differ by the same amount (s = 0, e.g. gains that land on the same multiple of 1/64) make the test
    degenerate, and δ = 0 would claim any difference detectable from a spread that is only unobserved."""
    if not 1.0 - level < power < 1.0:
        raise ValueError(f"need 1 - level < power < 1, got level={level}, power={power}")
    if n < 2 or not (np.isfinite(sd) and sd > 0.0):
        return float("nan")
    df, critical = n - 1, float(student_t.ppf(0.5 + level / 2.0, n - 1))

    # P(T > c) + P(T < −c) for T ~ nct(df, nc), the lower tail as P(T' > c) for T' ~ nct(df, −nc) by symmetry:
    # scipy's nct.cdf(−c) can return NaN far out in the tail, its sf at −nc does not.
    def shortfall(nc: float) -> float:
        return float(nct.sf(critical, df, nc) + nct.sf(critical, df, -nc)) - power

    high = 1.0  # power rises from 1 − level at nc = 0: double until it reaches `power`, then bisect (Brent)
    while shortfall(high) < 0.0:
        high *= 2.0
    return brentq(shortfall, 0.0, high, xtol=1e-12) * sd / math.sqrt(n)


def pairs_for_power(sd: float, effect: float, most: int = 200, level: float = LEVEL,
                    power: float = POWER) -> int | None:
    """The fewest pairs at which a paired t-test over differences spread by `sd` detects `effect` with `power`
    (`detectable_effect`), or None: not within `most`, or no spread measured."""
    for n in range(2, most + 1):
        detectable = detectable_effect(sd, n, level, power)
        if not np.isfinite(detectable):
            return None
        if detectable <= effect:
            return n
    return None


def holm(p_values: np.ndarray | list[float]) -> np.ndarray:
    """Holm-adjusted p-values of one family (Holm 1979): the i-th smallest of m is max over j <= i of
    min(1, (m − j + 1) · p_(j)); a comparison survives at α when its adjusted p is below α. NaNs (no test) are left
    out of the family and stay NaN."""
    p = np.asarray(p_values, dtype=np.float64)
    adjusted = np.full(p.shape, np.nan)
    tested = np.flatnonzero(np.isfinite(p))
    order = tested[np.argsort(p[tested], kind="stable")]
    m = len(order)
    adjusted[order] = np.minimum(1.0, np.maximum.accumulate((m - np.arange(m)) * p[order]))
    return adjusted


def bootstrap_interval(differences: np.ndarray, level: float = LEVEL, reps: int = 4000, seed: int = 0) -> Interval:
    """Percentile interval of the mean of a seeds × questions matrix of paired differences, resampling seeds and
    questions with replacement (each replicate draws n seeds and q questions; both sides of every difference
    keep the same draw). NaN bounds with fewer than 2 seeds or any non-finite entry."""
    d = np.asarray(differences, dtype=np.float64)
    if d.ndim != 2 or d.size == 0:
        raise ValueError(f"need a seeds × questions matrix, got shape {d.shape}")
    n, q = d.shape
    if n < 2 or not np.isfinite(d).all():
        return Interval(float(d.mean()) if np.isfinite(d).all() else float("nan"), float("nan"), float("nan"), n)
    rng = np.random.default_rng(seed)
    seed_counts = rng.multinomial(n, np.full(n, 1.0 / n), size=reps).astype(np.float64)
    question_counts = rng.multinomial(q, np.full(q, 1.0 / q), size=reps).astype(np.float64)
    replicates = np.einsum("bs,sq,bq->b", seed_counts, d, question_counts) / (n * q)
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(replicates, [tail, 1.0 - tail])
    return Interval(float(d.mean()), float(low), float(high), n)


def shown(*intervals: Interval, null: float = 0.0) -> bool:
    """The study's rule: a claim is shown only when at least one interval exists and every one that exists
    excludes `null`."""
    defined = [i for i in intervals if i.defined]
    return bool(defined) and all(i.excludes(null) for i in defined)


def t_band(columns: np.ndarray, level: float = LEVEL) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Row-wise mean and t-interval of a rows × seeds matrix, NaNs ignored (a curve's band over seeds: each step
    uses the seeds that logged it; NaN bounds where fewer than 2 did)."""
    x = np.asarray(columns, dtype=np.float64)
    n = np.isfinite(x).sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN rows
        mean = np.nanmean(x, axis=1)
        sd = np.nanstd(x, axis=1, ddof=1)
        half = student_t.ppf(0.5 + level / 2.0, n - 1) * sd / np.sqrt(n)  # NaN where n < 2 (df <= 0)
    return mean, mean - half, mean + half


def rate_interval(falls: int, runs: int, level: float = LEVEL) -> Interval:
    """The share of runs that fell, with its exact (Clopper–Pearson) interval from scipy.stats.binomtest."""
    from scipy.stats import binomtest

    if runs == 0:
        return Interval(float("nan"), float("nan"), float("nan"), 0)
    ci = binomtest(falls, runs).proportion_ci(confidence_level=level, method="exact")
    return Interval(falls / runs, float(ci.low), float(ci.high), runs)


def fisher_p(falls_a: int, runs_a: int, falls_b: int, runs_b: int) -> float:
    """Two-sided p of Fisher's exact test that two arms fall equally often (scipy.stats.fisher_exact)."""
    from scipy.stats import fisher_exact

    return float(fisher_exact([[falls_a, runs_a - falls_a], [falls_b, runs_b - falls_b]]).pvalue)


def _fisher_rejects(n: int, alpha: float) -> np.ndarray:
    """rejects[a, b]: Fisher's two-sided test rejects at `alpha` for a falls of n in one arm and b of n in the other.

    Conditional on the a + b = t falls, a is hypergeometric; the two-sided p sums the probabilities of every table
    no more likely than the one seen (scipy's definition, with its relative tolerance 1e-7)."""
    from scipy.stats import hypergeom

    rejects = np.zeros((n + 1, n + 1), dtype=bool)
    for t in range(2 * n + 1):
        a = np.arange(max(0, t - n), min(n, t) + 1)
        pmf = hypergeom.pmf(a, 2 * n, t, n)
        p = (pmf[None, :] <= pmf[:, None] * (1 + 1e-7)).astype(float) @ pmf
        rejects[a, t - a] = p <= alpha
    return rejects


def fisher_power(rate_a: float, rate_b: float, n: int, alpha: float = 1.0 - LEVEL) -> float:
    """The chance that Fisher's exact test at two-sided `alpha` finds two arms of n runs apart when they fall with
    probabilities `rate_a` and `rate_b`: exact, summed over every pair of outcomes (scipy.stats.binom)."""
    from scipy.stats import binom

    k = np.arange(n + 1)
    return float(binom.pmf(k, n, rate_a) @ _fisher_rejects(n, alpha) @ binom.pmf(k, n, rate_b))


def runs_for_power(rate_a: float, rate_b: float, power: float = POWER, alpha: float = 1.0 - LEVEL,
                   most: int = 200) -> int | None:
    """The fewest runs per arm at which `fisher_power` reaches `power` (None: not within `most`, e.g. equal rates).
    Fisher's power is not monotone in n (the test is discrete), so this is the first n that reaches it."""
    if rate_a == rate_b:
        return None
    for n in range(2, most + 1):
        if fisher_power(rate_a, rate_b, n, alpha) >= power:
            return n
    return None
