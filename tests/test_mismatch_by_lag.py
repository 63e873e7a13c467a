"""The mismatch split by lag (trainer/mismatch_by_lag.py) against a hand computation in float64."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from openrlhf_tis.metric_names import mismatch_lag_key
from openrlhf_tis.trainer.mismatch_by_lag import mismatch_by_lag
from openrlhf_tis.trainer.staleness import LAG


def _experience(old, roll, mask, lags):
    return SimpleNamespace(action_log_probs=torch.tensor(old, dtype=torch.float64),
                           rollout_log_probs=torch.tensor(roll, dtype=torch.float64),
                           action_mask=torch.tensor(mask), info={LAG: torch.tensor(lags, dtype=torch.float32)})


def _k3(old: float, roll: float) -> float:
    r = math.exp(old - roll)
    return r - 1 - math.log(r)


def test_each_lag_gets_the_statistics_of_its_own_tokens():
    # sample 0 (lag 0): tokens (-1.0 vs -1.1), (-0.5 vs -0.5); sample 1 (lag 2): (-2.0 vs -1.0), padding
    exp = _experience([[-1.0, -0.5], [-2.0, -9.0]], [[-1.1, -0.5], [-1.0, -3.0]], [[1, 1], [1, 0]], [0.0, 2.0])
    got = mismatch_by_lag([exp])
    lag0_k3 = (_k3(-1.0, -1.1) + _k3(-0.5, -0.5)) / 2
    lag0_dp = (abs(math.exp(-1.0) - math.exp(-1.1)) + 0.0) / 2
    assert got[mismatch_lag_key("k3", 0)] == pytest.approx(lag0_k3, rel=1e-6)
    assert got[mismatch_lag_key("abs_dp_mean", 0)] == pytest.approx(lag0_dp, rel=1e-6)
    assert got[mismatch_lag_key("k3", 2)] == pytest.approx(_k3(-2.0, -1.0), rel=1e-6)
    assert got[mismatch_lag_key("tokens", 2)] == 1 and got[mismatch_lag_key("tokens", 0)] == 2
    assert got[mismatch_lag_key("k3", "stale")] == got[mismatch_lag_key("k3", 2)]
    assert mismatch_lag_key("k3", 1) not in got  # no sample at lag 1


def test_a_synchronous_step_has_lag_0_only_and_bypass_has_nothing():
    exp = _experience([[-1.0]], [[-1.2]], [[1]], [0.0])
    assert set(mismatch_by_lag([exp])) == {mismatch_lag_key(s, 0) for s in ("k3", "abs_dp_mean", "tokens")}
    exp.action_log_probs = None  # a bypass loss computes no π_old
    assert mismatch_by_lag([exp]) == {}


def test_non_finite_log_probs_are_left_out_as_the_correction_does():
    exp = _experience([[-1.0, float("-inf")]], [[-1.5, -1.0]], [[1, 1]], [1.0])
    got = mismatch_by_lag([exp])
    assert got[mismatch_lag_key("tokens", 1)] == 1
    assert got[mismatch_lag_key("k3", 1)] == pytest.approx(_k3(-1.0, -1.5), rel=1e-6)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.floats(-8, 0), st.floats(-8, 0), st.integers(0, 3)), min_size=1, max_size=12))
def test_the_token_weighted_mean_over_lags_is_the_whole_steps_k3(tokens):
    """For any tokens: the lags' k3, weighted by their token counts, average to the k3 of all tokens."""
    exps = [_experience([[o]], [[r]], [[1]], [float(lag)]) for o, r, lag in tokens]
    got = mismatch_by_lag(exps)
    lags = {lag for _, _, lag in tokens}
    total = sum(got[mismatch_lag_key("k3", lag)] * got[mismatch_lag_key("tokens", lag)] for lag in lags)
    assert total / len(tokens) == pytest.approx(sum(_k3(o, r) for o, r, _ in tokens) / len(tokens), rel=1e-9,
                                               abs=1e-12)
    assert min(got[mismatch_lag_key("k3", lag)] for lag in lags) >= 0  # k3 is never negative
