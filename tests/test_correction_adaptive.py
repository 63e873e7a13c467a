"""The adaptive truncation bound (correction/adaptive.py) against a float64 reference, its limits, and its inputs.

The reference reads the rule's definition directly: ESS(C) of min(r, C) over the valid ratios, and the largest C in
[C_min, C_max] with ESS(C) ≥ ρ found by a bracketing root finder (scipy's brentq), never by the closed form the
core solves.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from scipy.optimize import brentq

from openrlhf_tis.correction import CorrectionConfig, compute_correction, preset
from openrlhf_tis.correction.adaptive import adaptive_bound

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ADAPTIVE_KEYS = ("correction/adaptive_bound", "correction/adaptive_ess", "correction/adaptive_at_max_frac",
                 "correction/adaptive_at_min_frac")


def ess_reference(r: np.ndarray, cap: float) -> float:
    """(Σ w)² / (n Σ w²) of w = min(r, cap), float64; 1 with no weight above 0 (all equal)."""
    w = np.minimum(np.asarray(r, dtype=np.float64), cap)
    squares = float((w * w).sum())
    return 1.0 if squares == 0 else float(w.sum()) ** 2 / (len(w) * squares)


def bound_reference(r: np.ndarray, rho: float, c_min: float, c_max: float) -> float:
    """The rule as defined: C_max if ESS(C_max) ≥ ρ, C_min if ESS(C_min) < ρ, else the root of ESS(C) = ρ."""
    if ess_reference(r, c_max) >= rho:
        return c_max
    if ess_reference(r, c_min) < rho:
        return c_min
    return brentq(lambda c: ess_reference(r, c) - rho, c_min, c_max, xtol=1e-14, rtol=1e-13)


ratios = st.floats(0.0, 1e6, allow_nan=False) | st.sampled_from([0.0, math.inf, 1.0, 1e-30, 1e30])
params = st.tuples(st.floats(0.01, 1.0), st.floats(1.0, 3.0), st.floats(0.0, 20.0)).map(
    lambda p: (p[0], p[1], p[1] + p[2]))  # ρ, C_min, C_max ≥ C_min


@SETTINGS
@given(st.lists(st.tuples(ratios, st.booleans()), max_size=40), params)
@example([(1.0, True), (1.0, True), (1.0, True), (4.0, True)], (0.9, 1.0, 5.0))
@example([(0.0, True), (math.inf, True)], (0.9, 1.0, 5.0))
@example([], (0.5, 1.0, 5.0))
def test_the_bound_is_the_rule_in_float64(tokens, param):
    rho, c_min, c_max = param
    r = torch.tensor([x for x, _ in tokens], dtype=torch.float64)
    valid = torch.tensor([float(v) for _, v in tokens], dtype=torch.float64)
    got = adaptive_bound(r.view(1, -1), valid.view(1, -1), rho, c_min, c_max)
    on = np.array([x for x, v in tokens if v], dtype=np.float64)
    want = bound_reference(on, rho, c_min, c_max)
    bound = got.bound.item()
    assert c_min <= bound <= c_max
    assert math.isclose(bound, want, rel_tol=1e-9, abs_tol=1e-12), (bound, want)
    assert math.isclose(got.ess.item(), ess_reference(on, bound), rel_tol=1e-9)
    assert got.at_max.item() == (ess_reference(on, c_max) >= rho)
    assert got.at_min.item() == (not got.at_max.item() and ess_reference(on, c_min) < rho)
    if not (got.at_max.item() or got.at_min.item()):
        assert math.isclose(got.ess.item(), rho, rel_tol=1e-9)  # the target binds: exactly met


def test_hand_computed_case():
    # r = 1, 1, 1, 4; ρ = 0.9: (3 + C)² = 3.6 (3 + C²)  ⇔  2.6 C² − 6 C + 1.8 = 0, larger root (6 + √17.28) / 5.2
    out = adaptive_bound(torch.tensor([[1.0, 1.0, 1.0, 4.0]]), torch.ones(1, 4), 0.9, 1.0, 5.0)
    assert math.isclose(out.bound.item(), (6 + math.sqrt(17.28)) / 5.2, rel_tol=1e-6)
    assert math.isclose(out.ess.item(), 0.9, rel_tol=1e-6) and out.at_max.item() == out.at_min.item() == 0
    # ESS(5) = (3 + 4)² / (4 · 19) = 0.645 ≥ ρ = 0.6: no cut; ESS(1) = 1: the floor is never the answer here
    assert adaptive_bound(torch.tensor([[1.0, 1.0, 1.0, 4.0]]), torch.ones(1, 4), 0.6, 1.0, 5.0).bound.item() == 5.0
    # Ratios below 1 spread the weights and no cap ≥ 1 can help: the floor, with the ESS it reaches
    low = adaptive_bound(torch.tensor([[0.01, 1.0]]), torch.ones(1, 2), 0.9, 1.0, 5.0)
    assert (low.bound.item(), low.at_min.item()) == (1.0, 1.0)
    assert math.isclose(low.ess.item(), 1.01 ** 2 / (2 * 1.0001), rel_tol=1e-6)


# ── through compute_correction: float32 log-probs as the trainer hands them ───────────────────────────────────────

def _batch(draw_rows, scale):
    old = torch.tensor(draw_rows, dtype=torch.float32) * -1.0
    gen = torch.Generator().manual_seed(len(draw_rows))
    roll = old + scale * torch.randn(old.shape, generator=gen)
    return old, roll


log_probs = st.lists(st.lists(st.floats(0.0, 20.0), min_size=6, max_size=6), min_size=1, max_size=5)
masks = st.lists(st.lists(st.integers(0, 1), min_size=6, max_size=6), min_size=5, max_size=5)
configs = st.tuples(st.floats(0.05, 1.0), st.floats(1.0, 2.0), st.floats(0.0, 8.0)).map(
    lambda p: preset("adaptive", adaptive_ess_target=p[0], adaptive_min_bound=p[1], adaptive_max_bound=p[1] + p[2]))


@SETTINGS
@given(log_probs, masks, configs, st.sampled_from([0.0, 0.1, 1.0, 5.0, 100.0]))
# found by hypothesis in a full run: one valid token and ρ = 1, where float32 sums put ESS a ulp off 1
@example([[0.0] * 6], [[0, 0, 0, 0, 0, 1]] + [[0] * 6] * 4,
         preset("adaptive", adaptive_ess_target=1.0, adaptive_min_bound=1.0, adaptive_max_bound=3.0), 5.0)
@example([[0.0] * 6] * 2, [[0, 0, 0, 0, 0, 1], [0, 0, 1, 1, 0, 0]] + [[0] * 6] * 3,
         preset("adaptive", adaptive_ess_target=1.0, adaptive_min_bound=1.0, adaptive_max_bound=4.5), 5.0)
def test_weights_are_finite_and_within_the_chosen_bound(rows, mask_rows, cfg, scale):
    old, roll = _batch(rows, scale)  # scale 100: ratios of 0 and inf in float32
    am = torch.tensor(mask_rows[:len(rows)])
    out = compute_correction(old, roll, am, cfg)
    bound = out.metrics["correction/adaptive_bound"]  # the cap as applied: in the weights' dtype
    assert np.float32(cfg.adaptive_min_bound) <= bound <= np.float32(cfg.adaptive_max_bound)
    assert torch.isfinite(out.weights).all() and (out.weights >= 0).all()
    assert (out.weights <= np.float32(bound)).all()
    assert (out.weights[am == 0] == 0).all()
    on = am > 0  # on action tokens the weight is plain TIS at the logged cap: min(π_old/μ, C_t)
    assert torch.equal(out.weights[on], torch.exp(old - roll).clamp(max=float(np.float32(bound)))[on])
    assert all(math.isfinite(out.metrics[key]) for key in ADAPTIVE_KEYS)
    assert 0 < out.metrics["correction/adaptive_ess"] <= 1 + 1e-12


@SETTINGS
@given(log_probs, masks, configs, st.integers(1, 3), st.floats(-1e4, 1e4) | st.sampled_from([math.nan, math.inf]))
def test_masked_tokens_never_move_the_bound(rows, mask_rows, cfg, extra, junk):
    old, roll = (x.double() for x in _batch(rows, 1.0))
    am = torch.tensor(mask_rows[:len(rows)])
    base = compute_correction(old, roll, am, cfg)
    # junk under action_mask = 0: the same shape, so the very same sums
    junked = compute_correction(torch.where(am > 0, old, junk), torch.where(am > 0, roll, -junk), am, cfg)
    assert torch.equal(junked.weights, base.weights)
    assert all(junked.metrics[key] == base.metrics[key] for key in ADAPTIVE_KEYS)
    # extra padding columns of NaN/inf: longer sums, equal up to their rounding
    old2 = torch.cat([old, torch.full((len(rows), extra), math.nan, dtype=old.dtype)], dim=1)
    roll2 = torch.cat([roll, torch.full((len(rows), extra), math.inf, dtype=roll.dtype)], dim=1)
    am2 = torch.cat([am, torch.zeros(len(rows), extra, dtype=am.dtype)], dim=1)
    out = compute_correction(old2, roll2, am2, cfg)
    T = am.shape[1]
    assert torch.allclose(out.weights[:, :T], base.weights, rtol=1e-12, atol=0) and (out.weights[:, T:] == 0).all()
    for key in ADAPTIVE_KEYS:
        assert math.isclose(out.metrics[key], base.metrics[key], rel_tol=1e-12), key


@SETTINGS
@given(log_probs, masks, st.floats(1.0, 6.0), st.sampled_from([0.1, 1.0, 5.0]))
def test_a_forced_cap_is_plain_tis(rows, mask_rows, cap, scale):
    old, roll = _batch(rows, scale)
    am = torch.tensor(mask_rows[:len(rows)])
    tis = compute_correction(old, roll, am, CorrectionConfig(mode="truncate", upper=cap))
    for cfg in (preset("adaptive", adaptive_min_bound=cap, adaptive_max_bound=cap),  # C_min = C_max = C
                preset("adaptive", adaptive_ess_target=1e-9, adaptive_max_bound=cap)):  # ρ ≤ 1/n: C_max always
        out = compute_correction(old, roll, am, cfg)
        assert torch.equal(out.weights, tis.weights) and torch.equal(out.mask, tis.mask)
        assert out.metrics["correction/adaptive_bound"] == np.float32(cap)
        shared = set(tis.metrics) & set(out.metrics)
        assert {k: out.metrics[k] for k in shared} == {k: tis.metrics[k] for k in shared}


@SETTINGS
@given(log_probs, masks, configs)
def test_no_mismatch_is_no_correction(rows, mask_rows, cfg):
    old = -torch.tensor(rows, dtype=torch.float32)
    am = torch.tensor(mask_rows[:len(rows)])
    out = compute_correction(old, old.clone(), am, cfg)
    assert torch.equal(out.weights, am.to(out.weights.dtype))  # weight exactly 1 on every action token
    assert out.metrics["correction/adaptive_bound"] == np.float32(cfg.adaptive_max_bound)
    assert out.metrics["correction/adaptive_ess"] == 1.0 and out.metrics["correction/adaptive_at_max_frac"] == 1.0
    assert out.metrics["correction/truncated_frac"] == 0.0


def test_the_cap_tightens_as_the_mismatch_grows():
    gen = torch.Generator().manual_seed(0)
    old = -3 * torch.rand(8, 256, generator=gen)
    noise = torch.randn(8, 256, generator=gen)
    caps = [compute_correction(old, old + s * noise, torch.ones(8, 256), preset("adaptive"))
            .metrics["correction/adaptive_bound"] for s in (0.01, 0.3, 0.4, 0.6, 0.8, 2.0)]
    # log r ~ N(0, s²): raw ESS = exp(−s²), so the ceiling holds while s ≤ √(−ln 0.9) ≈ 0.32; the floor at most
    assert caps[:2] == [5.0, 5.0] and caps[-1] == 1.0
    assert caps == sorted(caps, reverse=True) and len(set(caps)) == 5


def test_an_empty_micro_batch():
    # no token at all (the metrics pass needs one, whatever the correction), then no action token: the ceiling
    empty = compute_correction(torch.zeros(0, 4), torch.zeros(0, 4), torch.zeros(0, 4), preset("adaptive"),
                               with_metrics=False)
    assert empty.weights.shape == (0, 4)
    assert adaptive_bound(torch.zeros(0, 4), torch.zeros(0, 4), 0.9, 1.0, 5.0).bound.item() == 5.0
    out = compute_correction(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), preset("adaptive"))
    assert (out.weights == 0).all() and out.metrics["correction/adaptive_bound"] == 5.0
    assert out.metrics["correction/adaptive_ess"] == 1.0 and out.metrics["correction/adaptive_at_max_frac"] == 1.0


def test_compiled_matches_eager():
    pytest.importorskip("torch._inductor")  # one compile (about a minute on 2 cores): sort and searchsorted fuse
    gen = torch.Generator().manual_seed(1)
    old = -3 * torch.rand(3, 7, generator=gen)
    roll = old + torch.randn(3, 7, generator=gen)
    am = torch.ones(3, 7)
    am[0, 4:] = 0
    cfg = preset("adaptive")
    eager = compute_correction(old, roll, am, cfg)
    compiled = compute_correction(old, roll, am, cfg.replace(compile=True))
    assert torch.allclose(compiled.weights, eager.weights, rtol=1e-6)
    for key in ADAPTIVE_KEYS:
        assert math.isclose(compiled.metrics[key], eager.metrics[key], rel_tol=1e-6), key


def test_float32_sums_keep_the_cap_of_a_large_micro_batch():
    """Training hands float32 ratios, summed in float32 over every token of the micro-batch: the cap stays within
    1e-5 of the float64 one (the docstring's figure) on 2^16 log-normal ratios with a heavy tail."""
    gen = torch.Generator().manual_seed(0)
    for sigma in (0.35, 0.45, 0.6):
        lr = torch.randn(1 << 16, generator=gen, dtype=torch.float64) * sigma
        lr[torch.randint(0, 1 << 16, (20,), generator=gen)] += 3  # a few tokens far above
        valid = (torch.rand(1 << 16, generator=gen) > 0.3).double()
        exact = adaptive_bound(lr.exp(), valid, 0.9, 1.0, 5.0)
        single = adaptive_bound(lr.exp().float(), valid.float(), 0.9, 1.0, 5.0)
        assert exact.at_max.item() == exact.at_min.item() == 0  # the target binds: the hard case
        assert math.isclose(single.bound.item(), exact.bound.item(), rel_tol=1e-5)
