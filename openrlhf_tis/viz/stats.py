"""95% intervals for held-out gains, and the rule that says when a claim is "shown" (pure numpy).

Two intervals, because a gain varies in two ways: between training seeds (what a user re-running the recipe
sees) and between the questions it is scored on (a score over 64 questions is itself a sample):
- `t_interval`: Student t over seeds, the n per-seed gains taken as independent draws. With 2 seeds
  t(0.975, 1) = 12.7, so two seeds can show only a very large effect; that is the honest price of 2 seeds.
- `bootstrap_interval`: a paired two-level bootstrap over seeds × questions, from each run's per-question
  scores: seeds and questions are resampled with replacement, the same questions for "before" and "after"
  (and for both settings of a comparison), so the question-to-question spread that both share cancels.

A claim is `shown` only when every interval that could be computed excludes the null value (0 for a gain;
0 for a difference of gains between a setting and the reference, paired by seed). Scipy is not a
dependency: the t quantile comes from the regularized incomplete beta function below.

What a comparison could have seen, and what survives the number of comparisons made (issue 43):
- `t_test_p`: the two-sided p-value of the paired t-test whose interval `t_interval` draws (p < 0.05 exactly
  when that 95% interval excludes 0).
- `detectable_effect`: the smallest true difference δ the paired t-test finds with 80% power at two-sided
  α = 0.05, from the comparison's own spread s over n pairs: the standard approximation takes the test statistic
  as a central t shifted by δ√n/s, so power = P(T > t(1 − α/2) − δ√n/s) gives
  δ = (t(1 − α/2, n − 1) + t(power, n − 1)) · s / √n (the far tail left out).
- `holm`: Holm's step-down adjustment (Holm 1979, Scand. J. Statist. 6:65–70), which keeps the chance of any
  false "shown" in a family of m comparisons at α without assuming them independent.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np

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


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz), valid for x < (a + 1) / (a + b + 2)."""
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def regularized_beta(a: float, b: float, x: float) -> float:
    """I_x(a, b), the regularized incomplete beta function."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` degrees of freedom."""
    tail = 0.5 * regularized_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The p-quantile of Student's t (bisection on t_cdf to ~1e-12)."""
    if not 0.0 < p < 1.0 or df <= 0:
        raise ValueError(f"need 0 < p < 1 and df > 0, got p={p}, df={df}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    low, high = 0.0, 1.0
    while t_cdf(high, df) < p:
        low, high = high, high * 2.0
    for _ in range(200):
        mid = 0.5 * (low + high)
        low, high = (mid, high) if t_cdf(mid, df) < p else (low, mid)
        if high - low < 1e-12 * max(1.0, high):
            break
    return 0.5 * (low + high)


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
    half = t_quantile(0.5 + level / 2.0, n - 1) * float(x.std(ddof=1)) / math.sqrt(n)
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
    t = abs(mean) / (sd / math.sqrt(len(x)))
    return min(1.0, 2.0 * (1.0 - t_cdf(t, len(x) - 1)))


def detectable_effect(sd: float, n: int, level: float = LEVEL, power: float = POWER) -> float:
    """The minimum detectable effect of a paired t-test over n pairs whose differences spread by `sd`: the true mean
    difference it finds with probability `power` at two-sided 1 − `level`, (t(½ + level/2, n − 1) + t(power, n − 1))
    · sd / √n (the approximation in the module's docstring). NaN with fewer than 2 pairs or no finite spread."""
    if n < 2 or not np.isfinite(sd):
        return float("nan")
    df = n - 1
    return (t_quantile(0.5 + level / 2.0, df) + t_quantile(power, df)) * sd / math.sqrt(n)


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
    quantiles = {k: t_quantile(0.5 + level / 2.0, k - 1) for k in set(n.tolist()) if k >= 2}
    half = np.array([quantiles[k] * s / math.sqrt(k) if k >= 2 else np.nan for k, s in zip(n, sd, strict=True)])
    return mean, mean - half, mean + half
