"""compute_correction against the float64 reference, hand-computed cases and hypothesis properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_correction_reference import reference, reference_metrics, reference_weight_metrics

from openrlhf_tis.correction import (
    PRESETS,
    CorrectionConfig,
    RejectionCriterion,
    compute_correction,
    kept_weight_totals,
    metric_names,
    preset,
)

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _tensor(rows, dtype=torch.float64):
    return torch.tensor(rows, dtype=dtype)


def _close(a, b, tol=1e-9):
    return all(abs(x - y) <= tol * max(1.0, abs(y)) for x, y in zip(a, b, strict=True))


# ── strategies ──

@st.composite
def batches(draw, max_b=5, max_t=8):
    B = draw(st.integers(1, max_b))
    T = draw(st.integers(1, max_t))
    flt = st.floats(-6.0, -0.01, allow_nan=False)
    old = [[draw(flt) for _ in range(T)] for _ in range(B)]
    delta = st.floats(-1.5, 1.5, allow_nan=False)
    roll = [[min(o + draw(delta), -1e-3) for o in row] for row in old]
    am = [[draw(st.integers(0, 1)) for _ in range(T)] for _ in range(B)]
    return old, roll, am


CRITERIA = [
    RejectionCriterion("ratio", "token", 0.4, 2.5), RejectionCriterion("ratio", "mean", 0.7, 1.4),
    RejectionCriterion("ratio", "sum", 0.1, 10.0), RejectionCriterion("k1", "token", -0.6, 0.9),
    RejectionCriterion("k1", "mean", -0.3, 0.2), RejectionCriterion("k1", "sum", None, 1.0),
    RejectionCriterion("k2", "max", None, 0.3), RejectionCriterion("k2", "mean", None, 0.1),
    RejectionCriterion("k3", "token", None, 0.2), RejectionCriterion("k3", "sum", None, 0.8),
    RejectionCriterion("k3", "max", None, 0.25), RejectionCriterion("binary_kl", "token", None, 0.05),
    RejectionCriterion("binary_kl_sym", "mean", None, 0.02), RejectionCriterion("tv", "max", None, 0.2),
]


@st.composite
def configs(draw):
    mode = draw(st.sampled_from(["truncate", "clip", "mask", "raw", "none"]))
    # Bounds below 1 or above it alike: the bare core computes any defined configuration.
    upper = draw(st.sampled_from([0.7, 1.0, 1.3, 2.0, 5.0]))
    lower = draw(st.sampled_from([None, 0.0, 0.5, 0.9, 1.1]))
    if (1.0 / upper if lower is None else lower) > upper:
        lower = 0.0
    return CorrectionConfig(
        level=draw(st.sampled_from(["token", "sequence", "geometric"])), mode=mode, lower=lower, upper=upper,
        rejection=tuple(draw(st.lists(st.sampled_from(CRITERIA), max_size=2, unique=True))),
        veto_threshold=draw(st.sampled_from([None, 0.3, 0.6, 1.2])), veto_sides=draw(st.sampled_from(["both", "low"])),
        veto_min_prob=draw(st.sampled_from([None, 0.01])), batch_normalize=draw(st.booleans()),
        nonfinite=draw(st.sampled_from(["sequence", "token"])),
    )


# ── against the reference ──

def assert_matches_reference(old, roll, am, cfg) -> None:
    out = compute_correction(_tensor(old), _tensor(roll), torch.tensor(am), cfg)
    W, M = reference(old, roll, am, cfg)
    assert out.mask.tolist() == M
    for got, want in zip(out.weights.tolist(), W, strict=True):
        assert _close(got, want, 1e-9), (got, want)


@SETTINGS
@given(batches(), configs())
def test_matches_float64_reference(batch, cfg):
    old, roll, am = batch
    assert_matches_reference(old, roll, am, cfg)


@SETTINGS
@given(batches(), st.lists(st.sampled_from(CRITERIA), min_size=1, max_size=3, unique=True),
       st.sampled_from(["token", "sequence", "geometric"]))
def test_rejection_matches_reference(batch, criteria, level):
    old, roll, am = batch
    cfg = CorrectionConfig(level=level, mode="raw", rejection=tuple(criteria))
    assert_matches_reference(old, roll, am, cfg)


@SETTINGS
@given(batches(), st.floats(0.0, 0.5))
def test_opsm_matches_reference(batch, delta):
    old, roll, am = batch
    cfg = CorrectionConfig(mode="none", opsm_delta=delta)
    lp = [[o - 0.3 * ((i + j) % 3) for j, o in enumerate(row)] for i, row in enumerate(old)]
    adv = [[(-1.0) ** (i + j) for j in range(len(row))] for i, row in enumerate(old)]
    out = compute_correction(_tensor(old), _tensor(roll), torch.tensor(am), cfg, log_probs=_tensor(lp),
                             advantages=_tensor(adv))
    assert out.mask.tolist() == reference(old, roll, am, cfg, lp, adv)[1]


@SETTINGS
@given(batches())
# Probabilities that barely vary (CI found it): a one-pass E[x²] − E[x]² cancelled to a correlation of 1 + 2e-6.
@example(([[-1.0, -1.0, -1.0, -1.0, -1.0, -0.99999]], [[-1.0, -1.0, -1.0, -1.0, -1.0, -0.001]], [[0, 0, 0, 0, 1, 1]]))
def test_metrics_match_reference(batch):
    old, roll, am = batch
    if not any(any(r) for r in am):
        return
    out = compute_correction(_tensor(old), _tensor(roll), torch.tensor(am), CorrectionConfig())
    for key, want in reference_metrics(old, roll, am).items():
        assert math.isclose(out.metrics[key], want, rel_tol=1e-7, abs_tol=1e-9), key


@SETTINGS
@given(batches(), configs())
def test_weight_metrics_match_reference(batch, cfg):
    old, roll, am = batch
    lp = [[o - 0.1 * (j % 3) for j, o in enumerate(row)] for row in old]
    entropy = [[0.5 + 0.1 * j for j in range(len(row))] for row in old]
    out = compute_correction(_tensor(old), _tensor(roll), torch.tensor(am), cfg, log_probs=_tensor(lp),
                             entropy=_tensor(entropy))
    want = reference_weight_metrics(old, roll, am, cfg)
    valid = [(b, t) for b, row in enumerate(am) for t, a in enumerate(row) if a]
    if valid:
        want["mismatch/entropy"] = sum(entropy[b][t] for b, t in valid) / len(valid)
        want["mismatch/entropy_sampled"] = -sum(lp[b][t] for b, t in valid) / len(valid)
    for key, value in want.items():
        # a one-pass variance is exact to ~1e-16·E[(x − c)²], so a std to ~1e-8 of the largest weight
        scale = max(1.0, want[key.replace("_std", "_max")]) if key.endswith("_std") else 0.0
        assert math.isclose(out.metrics[key], value, rel_tol=1e-9, abs_tol=1e-12 + 1e-7 * scale), key


# ── hypothesis properties ──

@SETTINGS
@given(batches(), configs())
def test_weights_within_bounds_and_mask_consistent(batch, cfg):
    old, roll, am = batch
    cfg = cfg.replace(batch_normalize=False)
    out = compute_correction(_tensor(old), _tensor(roll), torch.tensor(am), cfg)
    w, m, a = out.weights, out.mask.bool(), torch.tensor(am).bool()
    assert not (m & ~a).any(), "mask is 0 wherever action_mask is 0"
    assert (w[~m] == 0).all(), "weights are 0 wherever mask is 0"
    assert torch.isfinite(w).all()
    kept = w[m]
    if cfg.mode == "truncate":
        assert (kept <= cfg.upper).all() and (kept >= 0).all()
    elif cfg.mode in ("clip", "mask"):
        assert (kept <= cfg.upper + 1e-12).all() and (kept >= cfg.lower_bound - 1e-12).all()
    elif cfg.mode == "none":
        assert (kept == 1).all()


@SETTINGS
@given(batches(), configs(), st.integers(1, 4), st.floats(-50, 50))
def test_padding_and_masked_positions_are_inert(batch, cfg, extra, junk):
    old, roll, am = batch
    base = compute_correction(_tensor(old), _tensor(roll), torch.tensor(am), cfg)
    # Garbage (including NaN/inf) under action_mask = 0, plus extra padding columns.
    old2 = [[o if a else junk for o, a in zip(r, ar, strict=True)] + [math.nan] * extra
            for r, ar in zip(old, am, strict=True)]
    roll2 = [[o if a else -junk for o, a in zip(r, ar, strict=True)] + [math.inf] * extra
             for r, ar in zip(roll, am, strict=True)]
    am2 = [row + [0] * extra for row in am]
    out = compute_correction(_tensor(old2), _tensor(roll2), torch.tensor(am2), cfg)
    T = len(am[0])
    assert out.mask[:, :T].tolist() == base.mask.tolist()
    assert (out.mask[:, T:] == 0).all() and (out.weights[:, T:] == 0).all()
    assert torch.allclose(out.weights[:, :T], base.weights, rtol=1e-12, atol=0)
    for key, value in base.metrics.items():
        if key != "correction/nonfinite_count":
            assert math.isclose(out.metrics[key], value, rel_tol=1e-9, abs_tol=1e-12), key


@SETTINGS
@given(batches(), configs())
def test_sequence_level_weight_constant_along_sequence(batch, cfg):
    old, roll, am = batch
    cfg = cfg.replace(level=("sequence" if cfg.level == "token" else cfg.level))
    out = compute_correction(_tensor(old), _tensor(roll), torch.tensor(am), cfg)
    for w_row, m_row in zip(out.weights, out.mask.bool(), strict=True):
        kept = w_row[m_row]
        if kept.numel():
            assert torch.allclose(kept, kept[0].expand_as(kept), rtol=1e-12, atol=0)


@SETTINGS
@given(batches(), configs())
def test_batch_normalized_mean_is_one(batch, cfg):
    old, roll, am = batch
    cfg = cfg.replace(batch_normalize=True)
    out = compute_correction(_tensor(old), _tensor(roll), torch.tensor(am), cfg)
    m = out.mask.bool()
    if not m.any() or out.weights.sum() == 0:
        return
    if cfg.level == "token":
        mean = out.weights[m].mean()
    else:
        seqs = m.any(-1)
        mean = torch.where(m, out.weights, 0).amax(-1)[seqs].mean()
    assert math.isclose(mean.item(), 1.0, rel_tol=1e-9)


# ── hand-computed cases ──

def test_hand_computed_token_modes():
    ln = math.log
    old = _tensor([[0.0, 0.0, 0.0, 0.0]])
    roll = _tensor([[0.0, -ln(3.0), ln(4.0), -ln(1.5)]])  # r = 1, 3, 1/4, 1.5
    am = torch.ones(1, 4, dtype=torch.long)
    w = lambda **kw: compute_correction(old, roll, am, CorrectionConfig(**kw))  # noqa: E731
    assert torch.allclose(w(mode="truncate", upper=2).weights, _tensor([[1, 2, 0.25, 1.5]]))
    assert torch.allclose(w(mode="clip", lower=0.5, upper=2).weights, _tensor([[1, 2, 0.5, 1.5]]))
    out = w(mode="mask", lower=0.5, upper=2)
    assert out.mask.tolist() == [[1, 0, 0, 1]]
    assert torch.allclose(out.weights, _tensor([[1, 0, 0, 1.5]]))
    assert torch.allclose(w(mode="none").weights, torch.ones(1, 4, dtype=torch.float64))
    # Self-normalized truncate: kept weights 1, 2, 0.25, 1.5 have mean 1.1875.
    assert torch.allclose(w(mode="truncate", upper=2, batch_normalize=True).weights,
                          _tensor([[1, 2, 0.25, 1.5]]) / 1.1875)
    # Veto at 0.3 drops the whole sequence (r = 1/4 < 0.3).
    assert w(mode="truncate", veto_threshold=0.3).mask.sum() == 0
    # Low-side-only veto at 0.4 drops it too; a both-sided veto at 0.2 would need r > 5 or r < 0.2.
    assert w(mode="truncate", veto_threshold=0.4, veto_sides="low").mask.sum() == 0
    assert w(mode="truncate", veto_threshold=0.2).mask.sum() == 4


def test_hand_computed_sequence_and_geometric():
    ln2 = math.log(2.0)
    old = _tensor([[ln2, ln2, 0.0], [0.0, 0.0, 0.0]])
    roll = _tensor([[0.0, 0.0, 0.0], [ln2, 0.0, 0.0]])
    am = torch.tensor([[1, 1, 0], [1, 1, 1]])
    seq = compute_correction(old, roll, am, CorrectionConfig(level="sequence", mode="raw"))
    assert torch.allclose(seq.weights, _tensor([[4, 4, 0], [0.5, 0.5, 0.5]]))
    geo = compute_correction(old, roll, am, CorrectionConfig(level="geometric", mode="raw"))
    assert torch.allclose(geo.weights, _tensor([[2, 2, 0], [2 ** (-1 / 3)] * 3]))
    # Sequence-level self-normalization averages per kept sequence: (4 + 0.5)/2 = 2.25.
    norm = compute_correction(old, roll, am, CorrectionConfig(level="sequence", mode="raw", batch_normalize=True))
    assert torch.allclose(norm.weights, _tensor([[4, 4, 0], [0.5, 0.5, 0.5]]) / 2.25)
    assert norm.metrics["correction/norm_factor"] == pytest.approx(2.25)


def test_rejection_k1_bounds_are_on_k1_itself():
    # k1 = log μ − log π_old = −log r. r = 2 gives k1 = −0.693: rejected by k1 >= −0.5, kept by k1 <= 0.5.
    old, roll = _tensor([[math.log(0.5)]]), _tensor([[math.log(0.25)]])
    am = torch.ones(1, 1, dtype=torch.long)
    keep = lambda spec: compute_correction(old, roll, am, CorrectionConfig(mode="none", rejection=(spec,))).mask  # noqa: E731
    assert keep("k1:token:-0.5:0.5").sum() == 0
    assert keep("k1:token:-0.7:0.5").sum() == 1
    assert keep("k1:token::0.5").sum() == 1  # only an upper bound: r = 2 has k1 < 0
    assert keep("ratio:token:0.5:2.0").sum() == 1 and keep("ratio:token:0.5:1.9").sum() == 0


def test_rejection_criteria_chain_with_and():
    torch.manual_seed(0)
    old = torch.randn(6, 9, dtype=torch.float64) * 0.5 - 1.5
    roll = old + torch.randn(6, 9, dtype=torch.float64) * 0.4
    am = torch.ones(6, 9, dtype=torch.long)
    a, b = "k3:mean:0.05", "ratio:token:0.6:1.6"
    m = lambda *c: compute_correction(old, roll, am, CorrectionConfig(mode="none", rejection=c)).mask  # noqa: E731
    assert torch.equal(m(a, b), m(a) * m(b))
    assert 0 < m(a, b).sum() < m(a).sum()


def test_nonfinite_rollout_is_masked_and_counted():
    old = torch.full((3, 4), -1.0)
    roll = torch.full((3, 4), -1.2)
    roll[0, 1] = math.nan
    roll[1, 2] = -math.inf
    am = torch.ones(3, 4, dtype=torch.long)
    for mode in ("sequence", "token"):
        out = compute_correction(old, roll, am, CorrectionConfig(mode="truncate", nonfinite=mode, level="sequence"),
                                 details=True)
        assert torch.isfinite(out.weights).all()
        assert all(math.isfinite(v) for v in out.metrics.values())
        assert out.metrics["correction/nonfinite_count"] == 2
        assert out.mask[0, 1] == 0 and out.mask[1, 2] == 0 and out.mask[2].all()
        if mode == "sequence":
            assert out.mask[:2].sum() == 0 and out.metrics["correction/nonfinite_frac"] == pytest.approx(8 / 12)
            assert out.reasons["nan"][:2].all()
        else:
            assert out.mask[:2].sum() == 6
    # A token vLLM found impossible (μ = 0) under token TIS: dropped, never an inf weight.
    out = compute_correction(old, roll, am, CorrectionConfig())
    assert torch.isfinite(out.weights).all()


def test_all_masked_batch_gives_zero_weights_and_finite_metrics():
    old = torch.randn(2, 5)
    out = compute_correction(old, old, torch.zeros(2, 5, dtype=torch.long), preset("mis_full"))
    assert out.mask.sum() == 0 and (out.weights == 0).all()
    assert all(math.isfinite(v) for v in out.metrics.values())
    assert all(v == 0 for k, v in out.metrics.items() if "frac" in k), "no token, no share of tokens"
    rejected = compute_correction(old, old + 3.0, torch.ones(2, 5, dtype=torch.long),
                                  CorrectionConfig(mode="mask", upper=2.0, batch_normalize=True))
    assert rejected.mask.sum() == 0 and (rejected.weights == 0).all()


# The logged metric keys, written out by hand: dashboards, notebooks and older runs' metrics.jsonl depend on
# them, so a renamed, dropped or reordered key must fail here (docs/correction.md documents them).
MISMATCH_KEYS = [
    "mismatch/k1_kl", "mismatch/k2_kl", "mismatch/k3_kl", "mismatch/chi2_token", "mismatch/chi2_seq",
    "mismatch/rollout_ppl", "mismatch/training_ppl", "mismatch/ppl_ratio", "mismatch/log_ppl_diff",
    "mismatch/ess_token", "mismatch/ess_seq", "mismatch/abs_dp_max", "mismatch/abs_dp_mean",
    "mismatch/abs_dlogp_mean", "mismatch/abs_dlogp_max", "mismatch/pearson_p",
    "mismatch/abs_dlogp_p0-0.001", "mismatch/frac_p0-0.001", "mismatch/abs_dlogp_p0.001-0.01",
    "mismatch/frac_p0.001-0.01", "mismatch/abs_dlogp_p0.01-0.1", "mismatch/frac_p0.01-0.1",
    "mismatch/abs_dlogp_p0.1-0.5", "mismatch/frac_p0.1-0.5", "mismatch/abs_dlogp_p0.5-0.9", "mismatch/frac_p0.5-0.9",
    "mismatch/abs_dlogp_p0.9-1", "mismatch/frac_p0.9-1",
]
WEIGHT_KEYS = [
    "correction/weight_raw_mean", "correction/weight_raw_std", "correction/weight_raw_min", "correction/weight_raw_max",
    "correction/weight_mean", "correction/weight_std", "correction/weight_min", "correction/weight_max",
    "correction/ess", "correction/truncated_frac", "correction/clipped_low_frac", "correction/clipped_high_frac",
    "correction/bounds_masked_frac", "correction/rejected_frac",
]
FILTER_KEYS = [
    "correction/vetoed_frac", "correction/vetoed_seq_frac", "correction/opsm_frac", "correction/nonfinite_frac",
    "correction/nonfinite_count", "correction/masked_frac", "correction/kept_frac", "correction/norm_factor",
]


def test_metric_keys_are_stable_and_prefixed():
    cfg = preset("mis_full")  # rejection ratio:mean:0.99:1.01 and k3:max::1.0
    out = compute_correction(torch.randn(3, 4), torch.randn(3, 4), torch.ones(3, 4), cfg)
    assert list(out.metrics) == [*MISMATCH_KEYS, *WEIGHT_KEYS, "correction/rs_ratio_mean_frac",
                                 "correction/rs_k3_max_frac", *FILTER_KEYS]
    plain = compute_correction(torch.randn(3, 4), torch.randn(3, 4), torch.ones(3, 4), preset("tis"))
    assert list(plain.metrics) == [*MISMATCH_KEYS, *WEIGHT_KEYS, *FILTER_KEYS]  # no rejection criterion


def test_metric_names_add_the_entropy_keys_after_the_buckets():
    assert metric_names(preset("tis"), has_entropy=True, has_log_probs=True) == [
        *MISMATCH_KEYS, "mismatch/entropy", "mismatch/entropy_sampled", *WEIGHT_KEYS, *FILTER_KEYS]
    assert metric_names(preset("tis"), has_log_probs=True) == [
        *MISMATCH_KEYS, "mismatch/entropy_sampled", *WEIGHT_KEYS, *FILTER_KEYS]


def test_metrics_on_hand_computed_case():
    ln2 = math.log(2.0)
    old = _tensor([[ln2 - 2.0, -2.0]])  # r = 2, 1 (μ = e^-2 on both tokens)
    roll = _tensor([[-2.0, -2.0]])
    am = torch.ones(1, 2, dtype=torch.long)
    out = compute_correction(old, roll, am, CorrectionConfig(mode="truncate", upper=1.5))
    m = out.metrics
    assert m["mismatch/k1_kl"] == pytest.approx(-ln2 / 2)
    assert m["mismatch/k3_kl"] == pytest.approx((2 - 1 - ln2) / 2)
    assert m["mismatch/chi2_token"] == pytest.approx((4 + 1) / 2 - 1)
    assert m["mismatch/chi2_seq"] == pytest.approx(4 - 1)
    assert m["mismatch/ess_token"] == pytest.approx(9 / (2 * 5))
    assert m["correction/truncated_frac"] == pytest.approx(0.5)
    assert m["correction/weight_raw_max"] == pytest.approx(2.0) and m["correction/weight_max"] == pytest.approx(1.5)
    assert m["mismatch/abs_dp_max"] == pytest.approx(math.exp(-2))
    assert m["mismatch/frac_p0.1-0.5"] == pytest.approx(1.0)  # μ = e^-2 ≈ 0.135
    assert m["mismatch/abs_dlogp_p0.1-0.5"] == pytest.approx(ln2 / 2)


def test_probability_buckets_include_their_lower_edge():
    # μ = 0.5 and 0.9 survive log and exp exactly: each belongs to the bucket above its edge, as in the explorer.
    roll = _tensor([[math.log(0.5), math.log(0.9), math.log(0.7)]])
    out = compute_correction(roll + _tensor([[0.1, 0.2, 0.4]]), roll, torch.ones(1, 3), CorrectionConfig())
    m = out.metrics
    assert m["mismatch/frac_p0.5-0.9"] == pytest.approx(2 / 3) and m["mismatch/frac_p0.9-1"] == pytest.approx(1 / 3)
    assert m["mismatch/abs_dlogp_p0.5-0.9"] == pytest.approx(0.25)  # (0.1 + 0.4) / 2
    assert m["mismatch/abs_dlogp_p0.9-1"] == pytest.approx(0.2)


def test_global_self_normalization_through_allreduce_hook():
    """Two 'ranks' normalized through the hook equal one rank holding the whole batch."""
    torch.manual_seed(1)
    old = torch.randn(8, 6, dtype=torch.float64) * 0.3 - 1
    roll = old + torch.randn(8, 6, dtype=torch.float64) * 0.3
    am = (torch.rand(8, 6) > 0.2).long()
    for level in ("token", "sequence"):
        cfg = CorrectionConfig(level=level, mode="truncate", upper=2.0, batch_normalize=True)
        whole = compute_correction(old, roll, am, cfg)
        halves = [slice(0, 3), slice(3, 8)]
        totals = [compute_correction(old[s], roll[s], am[s], cfg.replace(batch_normalize=False)) for s in halves]
        summed = sum(kept_weight_totals(t.weights, t.mask, level) for t in totals)
        for s in halves:
            part = compute_correction(old[s], roll[s], am[s], cfg, allreduce=lambda _t, v=summed: v.clone())
            assert torch.allclose(part.weights, whole.weights[s])
        local = compute_correction(old[:3], roll[:3], am[:3], cfg.replace(normalize_scope="local"),
                                   allreduce=lambda _t: pytest.fail("local scope must not all-reduce"))
        assert torch.allclose(local.weights, compute_correction(old[:3], roll[:3], am[:3], cfg).weights)


def test_every_preset_runs_and_respects_the_contract():
    torch.manual_seed(2)
    old = torch.randn(4, 10) * 0.2 - 1
    roll = old + torch.randn(4, 10) * 0.05
    am = torch.ones(4, 10, dtype=torch.long)
    am[0, 6:] = 0
    for name in PRESETS:
        out = compute_correction(old, roll, am, preset(name), log_probs=old, advantages=torch.randn(4, 10))
        assert out.weights.shape == (4, 10) and not out.weights.requires_grad
        assert not (out.mask.bool() & ~am.bool()).any() and (out.weights[~out.mask.bool()] == 0).all(), name


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="shapes differ"):
        compute_correction(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match="opsm_delta"):
        compute_correction(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), CorrectionConfig(opsm_delta=0.1))


def test_float32_inputs_and_bool_mask():
    torch.manual_seed(3)
    old = torch.randn(5, 7) * 0.3 - 1
    roll = old + torch.randn(5, 7) * 0.3
    am = torch.rand(5, 7) > 0.3
    out = compute_correction(old, roll, am, CorrectionConfig(mode="mask", lower=0.5, upper=1.5))
    assert out.weights.dtype == torch.float32 and out.mask.dtype == torch.bool
    W, M = reference(old.double().tolist(), roll.double().tolist(), am.long().tolist(),
                     CorrectionConfig(mode="mask", lower=0.5, upper=1.5))
    assert out.mask.long().tolist() == M
    assert torch.allclose(out.weights.double(), _tensor(W), rtol=1e-5)


def test_compiled_core_matches_eager():
    pytest.importorskip("torch._inductor")
    torch.manual_seed(4)
    old = torch.randn(6, 12) * 0.3 - 1
    roll = old + torch.randn(6, 12) * 0.3
    roll[1, 3] = math.nan
    am = (torch.rand(6, 12) > 0.2).long()
    cfg = preset("mis_full")
    eager = compute_correction(old, roll, am, cfg)
    compiled = compute_correction(old, roll, am, cfg.replace(compile=True))
    assert torch.equal(eager.mask, compiled.mask)
    assert torch.allclose(eager.weights, compiled.weights, rtol=1e-5)
    for key, value in eager.metrics.items():
        assert compiled.metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
