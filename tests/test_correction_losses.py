"""Policy losses: formulas per token, aggregation, denominators, bypass modes, all-masked and NaN batches."""

from __future__ import annotations

import math

import pytest
import torch

from openrlhf_tis.correction import CorrectionConfig, aggregate_loss, compute_correction, policy_loss, preset


def _batch(seed=0, B=4, T=6, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(B, T, generator=g, dtype=dtype) * 0.3 - 1.0
    roll = old + torch.randn(B, T, generator=g, dtype=dtype) * 0.3
    lp = (old + torch.randn(B, T, generator=g, dtype=dtype) * 0.2).requires_grad_(True)
    adv = torch.randn(B, T, generator=g, dtype=dtype)
    am = torch.ones(B, T, dtype=torch.long)
    am[0, 4:] = 0
    am[2, 1:] = 0
    return lp, old, roll, adv, am


def _ppo_token(lp, old, adv, eps_lo=0.2, eps_hi=0.2):
    ratio = torch.exp(lp - old)
    return -torch.min(ratio * adv, ratio.clamp(1 - eps_lo, 1 + eps_hi) * adv)


def test_decoupled_loss_is_weighted_ppo_token_mean():
    lp, old, roll, adv, am = _batch()
    cfg = CorrectionConfig(mode="truncate", upper=1.2)
    out = policy_loss(lp, old, adv, am, roll, cfg, clip_eps_low=0.1, clip_eps_high=0.3)
    w = torch.exp(old - roll).clamp(max=1.2) * am
    want = (_ppo_token(lp, old, adv, 0.1, 0.3) * w).sum() / am.sum()
    assert torch.allclose(out.loss, want)
    (g,) = torch.autograd.grad(out.loss, lp)
    (g_want,) = torch.autograd.grad(want, lp)
    assert torch.allclose(g, g_want)


def test_seq_mean_token_mean_and_global_counts():
    lp, old, roll, adv, am = _batch(1)
    cfg = CorrectionConfig(mode="clip", lower=0.8, upper=1.25)
    w = torch.exp(old - roll).clamp(0.8, 1.25)
    tok = _ppo_token(lp, old, adv) * w * am
    seq = (tok.sum(-1) / am.sum(-1)).sum()
    out = policy_loss(lp, old, adv, am, roll, cfg, token_level_loss=False, global_batch_size=10.0, dp_size=2)
    assert torch.allclose(out.loss, seq / 10.0 * 2)
    out = policy_loss(lp, old, adv, am, roll, cfg, token_level_loss=True, batch_num_tokens=40.0, dp_size=2)
    assert torch.allclose(out.loss, tok.sum() / 40.0 * 2)


def test_denominator_kept_counts_only_survivors():
    lp, old, roll, adv, am = _batch(2)
    cfg = CorrectionConfig(mode="mask", lower=0.8, upper=1.25)
    corr = compute_correction(old, roll, am, cfg)
    keep = corr.mask.bool()
    assert 0 < keep.sum() < am.sum()
    tok = torch.where(keep, _ppo_token(lp, old, adv) * corr.weights, 0.0)
    all_ = policy_loss(lp, old, adv, am, roll, cfg)
    kept = policy_loss(lp, old, adv, am, roll, cfg.replace(denominator="kept"))
    assert torch.allclose(all_.loss, tok.sum() / am.sum())
    assert torch.allclose(kept.loss, tok.sum() / keep.sum())
    # Across "ranks": the hook returns the global kept count (here: twice the local one, dp_size 2).
    hooked = policy_loss(lp, old, adv, am, roll, cfg.replace(denominator="kept"), dp_size=2,
                         allreduce=lambda t: t * 2)
    assert torch.allclose(hooked.loss, tok.sum() / (2 * keep.sum()) * 2)
    seq = policy_loss(lp, old, adv, am, roll, cfg.replace(denominator="kept"), token_level_loss=False)
    counts = keep.sum(-1)
    per_seq = torch.where(counts > 0, tok.sum(-1) / counts.clamp(min=1), 0.0)
    assert torch.allclose(seq.loss, per_seq.sum() / (counts > 0).sum())


@pytest.mark.parametrize("name", ["tis", "icepop", "seq_mis", "mis_full", "bypass_ppo", "bypass_reinforce", "opsm",
                                  "geo_rs", "vanilla_is"])
@pytest.mark.parametrize("denominator", ["all", "kept"])
@pytest.mark.parametrize("token_level", [True, False])
def test_all_masked_batch_gives_zero_loss_and_zero_grad(name, denominator, token_level):
    lp, old, roll, adv, am = _batch(3)
    cfg = preset(name, denominator=denominator)
    for case in ("no_action_tokens", "all_rejected"):
        if case == "no_action_tokens":
            mask, r = torch.zeros_like(am), roll
        else:
            mask, r = am, torch.full_like(roll, math.nan)  # every rollout log-prob unusable
        out = policy_loss(lp, old, adv, mask, r, cfg, token_level_loss=token_level,
                          batch_num_tokens=float(max(mask.sum(), 1)), global_batch_size=4.0)
        assert out.loss.item() == 0.0 and torch.isfinite(out.loss)
        (g,) = torch.autograd.grad(out.loss, lp)
        assert torch.equal(g, torch.zeros_like(g)), (name, case)
        assert all(math.isfinite(v) for v in out.correction.metrics.values())


def test_nan_and_inf_rollout_log_probs_never_propagate():
    lp, old, roll, adv, am = _batch(4)
    roll = roll.clone()
    roll[1, 2] = math.nan
    roll[3, 0] = math.inf
    roll[3, 5] = -math.inf
    for name in ("tis", "bypass_ppo", "bypass_reinforce", "mis_full"):
        out = policy_loss(lp, old, adv, am, roll, preset(name))
        (g,) = torch.autograd.grad(out.loss, lp)
        assert torch.isfinite(out.loss) and torch.isfinite(g).all(), name
        assert out.correction.metrics["correction/nonfinite_count"] == 3
        assert g[1].abs().sum() == 0 and g[3].abs().sum() == 0  # nonfinite='sequence' drops both sequences


def test_correction_off_is_plain_ppo_even_with_nan_rollouts():
    lp, old, roll, adv, am = _batch(5)
    roll = roll.clone()
    roll[1, 1] = math.nan
    out = policy_loss(lp, old, adv, am, roll, preset("off"))
    want = (_ppo_token(lp, old, adv) * am).sum() / am.sum()
    assert torch.allclose(out.loss, want)
    assert out.correction.metrics["correction/nonfinite_count"] == 1
    no_rollout = policy_loss(lp, old, adv, am, None, preset("off"))
    assert torch.allclose(no_rollout.loss, want)
    with pytest.raises(ValueError, match="rollout log-probs"):
        policy_loss(lp, old, adv, am, None, preset("tis"))


def test_bypass_ppo_uses_rollout_as_old_and_ignores_trainer_old():
    lp, old, roll, adv, am = _batch(6)
    out = policy_loss(lp, None, adv, am, roll, preset("bypass_ppo"))
    want = (_ppo_token(lp, roll, adv) * am).sum() / am.sum()
    assert torch.allclose(out.loss, want)
    assert torch.allclose(out.ppo_kl, ((roll - lp.detach()) * am).sum() / am.sum())
    # Rejection in bypass reads π_θ against μ (verl): a geometric band drops drifting sequences.
    cfg = CorrectionConfig(mode="none", loss="bypass_ppo", rejection=("ratio:mean:0.9:1.1",))
    out = policy_loss(lp, None, adv, am, roll, cfg)
    geo = torch.exp(((lp.detach() - roll) * am).sum(-1) / am.sum(-1))
    keep = ((geo >= 0.9) & (geo <= 1.1)).unsqueeze(-1) & am.bool()
    assert torch.equal(out.correction.mask.bool(), keep)
    assert torch.allclose(out.loss, (_ppo_token(lp, roll, adv) * keep).sum() / am.sum())


def test_bypass_reinforce_gradient_is_weighted_score_function():
    lp, old, roll, adv, am = _batch(7)
    out = policy_loss(lp, None, adv, am, roll, preset("bypass_reinforce"))
    w = torch.exp(lp.detach() - roll).clamp(max=2.0) * am  # sg(min(π_θ/μ, 2))
    (g,) = torch.autograd.grad(out.loss, lp)
    assert torch.allclose(g, -w * adv / am.sum())
    assert out.clip_ratio.item() == 0.0


def test_tis_talk_baselines():
    lp, old, roll, adv, am = _batch(8)
    ppo_is = policy_loss(lp, old, adv, am, roll, preset("ppo_is")).loss
    assert torch.allclose(ppo_is, policy_loss(lp, old, adv, am, roll, preset("bypass_ppo")).loss)
    vanilla = policy_loss(lp, old, adv, am, roll, preset("vanilla_is")).loss
    assert torch.allclose(vanilla, (_ppo_token(lp, old, adv) * torch.exp(old - roll) * am).sum() / am.sum())
    off = policy_loss(lp, old, adv, am, roll, preset("off")).loss
    assert torch.allclose(off, (_ppo_token(lp, old, adv) * am).sum() / am.sum())


def test_dual_clip_matches_formula():
    lp, old, roll, adv, am = _batch(9)
    out = policy_loss(lp, old, adv, am, roll, preset("off"), dual_clip=3.0)
    ratio = torch.exp(lp - old)
    clip1 = torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    tok = -torch.where(adv < 0, torch.max(clip1, 3.0 * adv), clip1)
    assert torch.allclose(out.loss, (tok * am).sum() / am.sum())


def test_opsm_drops_negative_advantage_drifted_sequences():
    lp, old, roll, adv, am = _batch(10)
    lp = lp.detach().clone()
    lp[1] = roll[1] - 1.0  # sequence 1: mean log(μ/π_θ) = 1 > δ
    adv = adv.clone()
    adv[1] = -1.0
    lp.requires_grad_(True)
    out = policy_loss(lp, old, adv, am, roll, CorrectionConfig(mode="none", opsm_delta=0.5))
    assert out.correction.mask[1].sum() == 0 and out.correction.mask[0].sum() == am[0].sum()
    assert out.correction.metrics["correction/opsm_frac"] == pytest.approx(am[1].sum().item() / am.sum().item())


def test_aggregate_loss_without_global_counts():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert aggregate_loss(loss, mask).item() == pytest.approx(7 / 3)
    assert aggregate_loss(loss, mask, token_level=False).item() == pytest.approx((1.5 + 4) / 2)
    assert aggregate_loss(loss, torch.zeros_like(mask)).item() == 0.0


@pytest.mark.parametrize("name", ["tis", "icepop", "mis_full", "bypass_ppo", "bypass_reinforce", "off"])
def test_details_leave_the_loss_unchanged_and_explain_its_mask(name):
    """What a token dump reads is the loss's own computation: with details the loss, gradient, weights and mask are
    bitwise those of the plain call, and every dropped action token has a reason (a kept one has none)."""
    lp, old, roll, adv, am = _batch(7)
    roll = roll.clone()
    roll[1, 2] = math.nan
    cfg = preset(name, batch_normalize=True) if name in ("tis", "icepop") else preset(name)
    plain = policy_loss(lp, old, adv, am, roll, cfg)
    told = policy_loss(lp, old, adv, am, roll, cfg, details=True)
    assert plain.correction.raw_weights is None and not plain.correction.reasons
    assert torch.equal(plain.loss, told.loss)
    assert torch.equal(torch.autograd.grad(plain.loss, lp)[0], torch.autograd.grad(told.loss, lp)[0])
    assert torch.equal(plain.correction.weights, told.correction.weights)
    assert torch.equal(plain.correction.mask, told.correction.mask)
    action = am.bool()
    any_reason = torch.stack([r.bool() for r in told.correction.reasons.values()]).any(0) & action
    if cfg.enabled:
        assert torch.equal(any_reason, action & ~told.correction.mask.bool())
    nan = told.correction.reasons["nan"].bool()
    assert nan[1, 2] and not nan[[0, 2, 3]].any()  # the non-finite token (its sequence too, by `nonfinite`)
