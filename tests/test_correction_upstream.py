"""The fork's policy loss against upstream OpenRLHF 0.11.2's `PolicyLoss`, numerically.

With the correction off the fork must reproduce upstream's loss and gradient exactly (both
aggregations, global counts, dual clip); upstream's own `is_correction_*` schemes must map onto the
fork's presets with the same loss, gradient and filtered fraction.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from openrlhf_tis import patches
from openrlhf_tis.correction import from_upstream, policy_loss, preset

patches.apply_platform_patches("cpu")  # openrlhf.models imports flash_attn at module level
from openrlhf.models import PolicyLoss  # noqa: E402


def _batch(seed, B=5, T=7, spread=0.25):
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(B, T, generator=g) * 0.5 - 1.5
    roll = old + torch.randn(B, T, generator=g) * spread
    lp = old + torch.randn(B, T, generator=g) * 0.15
    adv = torch.randn(B, T, generator=g)
    am = torch.ones(B, T)
    am[1, 5:] = 0
    am[3, 2:] = 0
    return lp, old, roll, adv, am


def _grads(loss, lp):
    (g,) = torch.autograd.grad(loss, lp)
    return g


COUNTS = [{}, {"batch_num_tokens": 23.0, "global_batch_size": 9.0, "dp_size": 2}]


@pytest.mark.parametrize(("token_level", "counts", "dual_clip", "eps"),
                         list(itertools.product([True, False], COUNTS, [None, 3.0], [(0.2, 0.2), (0.1, 0.28)])))
def test_correction_off_matches_upstream(token_level, counts, dual_clip, eps):
    lp, old, roll, adv, am = _batch(0)
    up = PolicyLoss(clip_eps_low=eps[0], clip_eps_high=eps[1], dual_clip=dual_clip, token_level_loss=token_level)
    lp_up = lp.clone().requires_grad_(True)
    loss_up, clip_up, kl_up, vllm_kl, filt = up(lp_up, old, adv, action_mask=am, rollout_log_probs=roll, **counts)
    assert vllm_kl is None and filt is None
    lp_ours = lp.clone().requires_grad_(True)
    ours = policy_loss(lp_ours, old, adv, am, roll, preset("off"), clip_eps_low=eps[0], clip_eps_high=eps[1],
                       dual_clip=dual_clip, token_level_loss=token_level, **counts)
    torch.testing.assert_close(ours.loss, loss_up, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(_grads(ours.loss, lp_ours), _grads(loss_up, lp_up), rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(ours.clip_ratio, clip_up)
    torch.testing.assert_close(ours.ppo_kl, kl_up, rtol=1e-6, atol=1e-7)


UPSTREAM_SCHEMES = [
    ("token", "mask", "ratio", [0.5, 5.0]),  # ICEPOP
    ("token", "clip", "ratio", [0.5, 5.0]),  # TIS
    ("seq", "mask", "ratio", [0.5, 5.0]),  # seq-mask-tis
    ("token", "mask", "ratio", [0.8, 1.2]),
    ("token", "clip", "ratio", [0.9, 1.1]),
    ("seq", "mask", "ratio", [0.9, 1.05]),
    ("token", "mask", "binary_kl", [0.0, 0.01]),
    ("seq", "mask", "binary_kl", [0.0, 0.004]),  # FlashREINFORCE trust region
    ("token", "mask", "tv", [0.0, 0.05]),
    ("seq", "mask", "tv", [0.0, 0.03]),
]


@pytest.mark.parametrize("scheme", UPSTREAM_SCHEMES)
@pytest.mark.parametrize("token_level", [True, False])
@pytest.mark.parametrize("seed", [1, 2])
def test_upstream_is_correction_schemes_map_onto_presets(scheme, token_level, seed):
    level, mode, gating, threshold = scheme
    lp, old, roll, adv, am = _batch(seed, spread=0.3)
    counts = {"batch_num_tokens": float(am.sum()), "global_batch_size": 5.0, "dp_size": 1}
    up = PolicyLoss(token_level_loss=token_level, is_correction_level=level, is_correction_mode=mode,
                    is_correction_gating=gating, is_correction_threshold=list(threshold))
    lp_up = lp.clone().requires_grad_(True)
    loss_up, _, _, vllm_kl, filt = up(lp_up, old, adv, action_mask=am, rollout_log_probs=roll, **counts)
    cfg = from_upstream(level, mode, gating, threshold)
    lp_ours = lp.clone().requires_grad_(True)
    ours = policy_loss(lp_ours, old, adv, am, roll, cfg, token_level_loss=token_level, **counts)
    torch.testing.assert_close(ours.loss, loss_up, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(_grads(ours.loss, lp_ours), _grads(loss_up, lp_up), rtol=1e-5, atol=1e-8)
    m = ours.correction.metrics
    assert m["mismatch/k1_kl"] == pytest.approx(vllm_kl.item(), rel=1e-5, abs=1e-7)  # both E_μ[log μ − log π_old]
    if level == "token":
        # Upstream's filter ratio counts units outside the band; for clip those are clamped, not dropped.
        ours_filtered = (m["correction/clipped_low_frac"] + m["correction/clipped_high_frac"]
                         if mode == "clip" else m["correction/masked_frac"])
        assert ours_filtered == pytest.approx(filt.item(), abs=1e-6)
    # Upstream's own schemes are non-trivial on this batch (otherwise the comparison proves little).
    if threshold in ([0.8, 1.2], [0.9, 1.05], [0.9, 1.1]):
        assert filt.item() > 0
