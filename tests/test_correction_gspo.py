"""GSPO's loss (`--actor.policy_loss_type gspo`) with the rollout correction, against a float64 reference.

GSPO's ratio is one per sequence: s = exp(mean over the sequence's action tokens of log(π_θ/π_old)), inside
PPO's clip, aggregated per sequence. The correction there weighs and masks whole sequences; the reference
below computes it sequence by sequence in float64, from the formulas in docs/correction.md §9, and upstream's
own GSPO loss is the reference where the correction is off or comes from upstream's flags.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from openrlhf_tis import patches
from openrlhf_tis.correction import (
    PRESETS,
    CorrectionConfig,
    CorrectionConfigError,
    RejectionCriterion,
    from_upstream,
    policy_loss,
    preset,
)
from openrlhf_tis.correction.config import sequence_ratio_presets

patches.apply_platform_patches("cpu")  # openrlhf.models imports flash_attn at module level
from openrlhf.models import PolicyLoss  # noqa: E402

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SEQUENCE_CRITERIA = [RejectionCriterion("ratio", "mean", 0.7, 1.4), RejectionCriterion("k3", "mean", None, 0.1),
                     RejectionCriterion("k3", "max", None, 0.25), RejectionCriterion("ratio", "sum", 0.1, 10.0)]


# ── the reference ────────────────────────────────────────────────────────────────────────────────────

def _statistic(crit: RejectionCriterion, lr: list[float]) -> float:
    if crit.statistic == "ratio":
        return math.exp(sum(lr) / len(lr) if crit.agg == "mean" else sum(lr))
    k3 = [math.exp(x) - 1 - x for x in lr]
    return sum(k3) / len(k3) if crit.agg == "mean" else max(k3)


def _inside(x: float, lo: float | None, hi: float | None) -> bool:
    return (lo is None or x >= lo) and (hi is None or x <= hi)


def _sequence_weight(lr: list[float], cfg: CorrectionConfig) -> tuple[float, bool]:
    """(bounded weight, kept) of one sequence from its token log-ratios log(base/μ)."""
    log_w = sum(lr) if cfg.level == "sequence" else sum(lr) / len(lr)
    r = math.exp(log_w)
    upper, lower = cfg.upper, (1 / cfg.upper if cfg.lower is None else cfg.lower)
    kept = True
    if cfg.mode == "truncate":
        w = min(r, upper)
    elif cfg.mode == "clip":
        w = min(max(r, lower), upper)
    elif cfg.mode == "mask":
        w, kept = r, lower <= r <= upper
    elif cfg.mode == "raw":
        w = math.exp(max(-cfg.log_ratio_clamp, min(cfg.log_ratio_clamp, log_w)))
    else:
        w = 1.0
    kept = kept and all(_inside(_statistic(c, lr), c.lower, c.upper) for c in cfg.rejection)
    if cfg.veto_threshold is not None:
        v = cfg.veto_threshold
        kept = kept and not any(math.exp(x) < v or (cfg.veto_sides == "both" and math.exp(x) > 1 / v) for x in lr)
    return w, kept


def reference_gspo(lp, old, roll, adv, am, cfg, eps=(0.2, 0.2), dual_clip=None) -> torch.Tensor:
    """GSPO's corrected loss, one sequence at a time in float64; differentiable in lp."""
    bypass = cfg.loss == "bypass_ppo"
    rows = []  # (sequence loss, weight, kept) of every sequence with an action token
    for i in range(len(am)):
        tokens = [t for t, a in enumerate(am[i]) if a]
        if not tokens:
            continue
        ref = roll if bypass else old
        log_s = sum(lp[i, t] - ref[i][t] for t in tokens) / len(tokens)
        s = torch.exp(log_s.clamp(-20.0, 20.0))
        terms = []
        for t in tokens:
            a = adv[i][t]
            term = torch.min(s * a, s.clamp(1 - eps[0], 1 + eps[1]) * a)
            if dual_clip is not None and a < 0:
                term = torch.max(term, torch.tensor(dual_clip * a, dtype=torch.float64))
            terms.append(-term)
        base = [lp[i, t].item() for t in tokens] if bypass else [old[i][t] for t in tokens]
        w, kept = _sequence_weight([b - roll[i][t] for b, t in zip(base, tokens, strict=True)], cfg)
        rows.append((sum(terms) / len(tokens), 1.0 if bypass else w, kept))
    if not rows:
        return lp.sum() * 0.0
    if not cfg.enabled:
        return sum(loss for loss, _, _ in rows) / len(rows)
    if cfg.batch_normalize and not bypass:
        kept_w = [w for _, w, k in rows if k]
        if kept_w and sum(kept_w) > 0:
            rows = [(loss, w / (sum(kept_w) / len(kept_w)), k) for loss, w, k in rows]
    total = sum(loss * w for loss, w, k in rows if k) + lp.sum() * 0.0
    count = sum(k for _, _, k in rows) if cfg.denominator == "kept" else len(rows)
    return total / max(count, 1)


# ── strategies ───────────────────────────────────────────────────────────────────────────────────────

@st.composite
def batches(draw, max_b=5, max_t=8):
    B, T = draw(st.integers(1, max_b)), draw(st.integers(1, max_t))
    logp = st.floats(-6.0, -0.01, allow_nan=False)
    old = [[draw(logp) for _ in range(T)] for _ in range(B)]
    roll = [[min(o + draw(st.floats(-1.0, 1.0)), -1e-3) for o in row] for row in old]
    lp = [[min(o + draw(st.floats(-0.5, 0.5)), -1e-3) for o in row] for row in old]
    adv = [[draw(st.floats(-2.0, 2.0)) for _ in range(T)] for _ in range(B)]
    am = [[draw(st.integers(0, 1)) for _ in range(T)] for _ in range(B)]
    return lp, old, roll, adv, am


@st.composite
def sequence_configs(draw):
    upper = draw(st.sampled_from([1.0, 1.3, 2.0, 5.0]))
    lower = draw(st.sampled_from([None, 0.0, 0.5, 0.9]))
    return CorrectionConfig(
        level=draw(st.sampled_from(["sequence", "geometric"])),
        mode=draw(st.sampled_from(["truncate", "clip", "mask", "raw", "none"])), lower=lower, upper=upper,
        rejection=tuple(draw(st.lists(st.sampled_from(SEQUENCE_CRITERIA), max_size=2, unique=True))),
        veto_threshold=draw(st.sampled_from([None, 0.3])), veto_sides=draw(st.sampled_from(["both", "low"])),
        batch_normalize=draw(st.booleans()), denominator=draw(st.sampled_from(["all", "kept"])),
        loss=draw(st.sampled_from(["decoupled", "bypass_ppo"])))


# ── against the reference ────────────────────────────────────────────────────────────────────────────

@SETTINGS
@given(batches(), sequence_configs(), st.sampled_from([None, 3.0]), st.sampled_from([(0.2, 0.2), (0.1, 0.28)]))
def test_gspo_loss_and_gradient_match_the_float64_reference(batch, cfg, dual_clip, eps):
    lp, old, roll, adv, am = batch
    as_t = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    lp_ours = as_t(lp).requires_grad_(True)
    out = policy_loss(lp_ours, as_t(old), as_t(adv), torch.tensor(am), as_t(roll), cfg, clip_eps_low=eps[0],
                      clip_eps_high=eps[1], dual_clip=dual_clip, token_level_loss=False, sequence_ratio=True)
    lp_ref = as_t(lp).requires_grad_(True)
    want = reference_gspo(lp_ref, old, roll, adv, am, cfg, eps, dual_clip)
    assert out.loss.item() == pytest.approx(want.item(), rel=1e-9, abs=1e-12)
    (grad,) = torch.autograd.grad(out.loss, lp_ours)
    (grad_want,) = torch.autograd.grad(want, lp_ref)
    torch.testing.assert_close(grad, grad_want, rtol=1e-9, atol=1e-12)


def test_the_reference_by_hand():
    """One sequence of two tokens, geometric TIS: every number below is written out, not computed alike."""
    lp, old, roll, adv, am = [[-1.0, -2.0]], [[-1.1, -2.3]], [[-1.5, -2.5]], [[1.0, 1.0]], [[1, 1]]
    cfg = CorrectionConfig(level="geometric", mode="truncate", upper=1.2)
    # s = exp(((-1+1.1) + (-2+2.3)) / 2) = exp(0.2), clipped to 1.2 for A > 0: term = -min(e^0.2, 1.2) = -1.2;
    # w = min(exp(((-1.1+1.5) + (-2.3+2.5)) / 2), 1.2) = min(e^0.3, 1.2) = 1.2; loss = -1.2 * 1.2.
    want = -1.44
    lp_t = torch.tensor(lp, dtype=torch.float64, requires_grad=True)
    assert reference_gspo(lp_t, old, roll, adv, am, cfg).item() == pytest.approx(want, rel=1e-12)
    f64 = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    out = policy_loss(lp_t, f64(old), f64(adv), torch.tensor(am), f64(roll), cfg, token_level_loss=False,
                      sequence_ratio=True)
    assert out.loss.item() == pytest.approx(want, rel=1e-12)


# ── against upstream's GSPO ──────────────────────────────────────────────────────────────────────────

def _batch(seed, B=5, T=7):
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(B, T, generator=g) * 0.5 - 1.5
    roll = old + torch.randn(B, T, generator=g) * 0.25
    lp = old + torch.randn(B, T, generator=g) * 0.8  # wide enough that GSPO's clip binds on some sequences
    adv = torch.randn(B, T, generator=g)
    am = torch.ones(B, T)
    am[1, 5:] = 0
    am[3, 2:] = 0
    return lp, old, roll, adv, am


@pytest.mark.parametrize("counts", [{}, {"batch_num_tokens": 23.0, "global_batch_size": 9.0, "dp_size": 2}])
@pytest.mark.parametrize(("dual_clip", "eps"), [(None, (0.2, 0.2)), (3.0, (0.1, 0.28))])
@pytest.mark.parametrize("upstream_flags", [False, True])
def test_matches_upstreams_gspo(counts, dual_clip, eps, upstream_flags):
    """Off: upstream's GSPO exactly. Upstream's is_correction flags under GSPO: μ in π_old's place (bypass)."""
    lp, old, roll, adv, am = _batch(0)
    level = "token" if upstream_flags else "off"
    up = PolicyLoss(clip_eps_low=eps[0], clip_eps_high=eps[1], dual_clip=dual_clip, policy_loss_type="gspo",
                    is_correction_level=level, is_correction_mode="clip")
    lp_up = lp.clone().requires_grad_(True)
    loss_up, clip_up, kl_up, _, _ = up(lp_up, old, adv, action_mask=am, rollout_log_probs=roll, **counts)
    cfg = from_upstream(level, "clip", policy_loss_type="gspo")
    assert cfg == (CorrectionConfig(mode="none", loss="bypass_ppo") if upstream_flags else preset("off"))
    lp_ours = lp.clone().requires_grad_(True)
    ours = policy_loss(lp_ours, old, adv, am, roll, cfg, clip_eps_low=eps[0], clip_eps_high=eps[1],
                       dual_clip=dual_clip, token_level_loss=False, sequence_ratio=True, **counts)
    torch.testing.assert_close(ours.loss, loss_up, rtol=1e-6, atol=1e-7)
    (g_ours,), (g_up,) = torch.autograd.grad(ours.loss, lp_ours), torch.autograd.grad(loss_up, lp_up)
    torch.testing.assert_close(g_ours, g_up, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(ours.clip_ratio, clip_up)
    if not upstream_flags:  # bypass reads log(π_θ/μ) for ppo_kl, upstream log(π_θ/π_old)
        torch.testing.assert_close(ours.ppo_kl, kl_up, rtol=1e-6, atol=1e-7)
    assert clip_up.item() > 0  # the clip binds somewhere: the comparison covers both branches


# ── what GSPO refuses, and why ───────────────────────────────────────────────────────────────────────

def test_sequence_level_presets_are_the_ones_gspo_takes():
    # Written out: the presets that weigh, mask or veto whole sequences only (or nothing at all).
    assert set(sequence_ratio_presets()) == {"off", "ppo_is", "bypass_ppo", "seq_tis", "seq_mis", "geo_rs", "k3_rs",
                                             "opsm"}
    lp, old, roll, adv, am = _batch(1)
    for name in set(PRESETS) - set(sequence_ratio_presets()):
        with pytest.raises(CorrectionConfigError, match="GSPO") as err:
            policy_loss(lp, old, adv, am, roll, preset(name), token_level_loss=False, sequence_ratio=True)
        assert err.value.flag in ("--algo.correction.level", "--algo.correction.loss",
                                  "--algo.correction.adaptive_ess_target"), name


@pytest.mark.parametrize(("changes", "flag"), [
    ({"level": "token", "mode": "truncate"}, "--algo.correction.level"),
    ({"level": "geometric", "mode": "none", "rejection": ("k3:token:0.1",)}, "--algo.correction.rejection"),
    ({"level": "sequence", "mode": "truncate", "nonfinite": "token"}, "--algo.correction.nonfinite"),
    ({"level": "sequence", "mode": "truncate", "loss": "bypass_reinforce"}, "--algo.correction.loss"),
    ({"adaptive_ess_target": 0.9}, "--algo.correction.adaptive_ess_target"),
])
def test_per_token_choices_are_refused_naming_their_flag(changes, flag):
    with pytest.raises(CorrectionConfigError) as err:
        CorrectionConfig(**changes).validate_for_sequence_ratio()
    assert err.value.flag == flag
    # ... but only where they change the loss: a token level with no weight is no per-token correction.
    CorrectionConfig(level="token", mode="none", nonfinite="token").validate_for_sequence_ratio()


def test_a_nonfinite_rollout_log_prob_drops_its_whole_sequence():
    lp, old, roll, adv, am = _batch(2)
    roll[0, 1] = math.nan
    cfg = preset("seq_tis")
    out = policy_loss(lp, old, adv, am, roll, cfg, token_level_loss=False, sequence_ratio=True)
    assert not out.correction.mask[0].any() and out.correction.mask[1:].bool().eq(am[1:].bool()).all()
    assert torch.isfinite(out.loss)
    clean = policy_loss(lp[1:], old[1:], adv[1:], am[1:], roll[1:], cfg, token_level_loss=False,
                        sequence_ratio=True)
    torch.testing.assert_close(out.loss * 5, clean.loss * 4)  # same terms; the dropped sequence still counts
