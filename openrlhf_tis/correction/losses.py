"""Policy losses with the rollout correction: decoupled 3-policy PPO, bypass PPO-clip, bypass REINFORCE.

Per token, with ρ_t = π_θ/π_old (clamped in log space to ±20 like OpenRLHF), advantage A_t and the
correction's weight w_t and mask m_t (weights.py):

    decoupled         ℓ_t = −w(π_old/μ)_t · min(ρ_t A_t, clip(ρ_t, 1−ε_lo, 1+ε_hi) A_t)   Hilton et al. 2021; TIS
    bypass_ppo        ℓ_t = −min(ρ̃_t A_t, clip(ρ̃_t, 1−ε_lo, 1+ε_hi) A_t),  ρ̃ = π_θ/μ      verl bypass; TIS "PPO-IS"
    bypass_reinforce  ℓ_t = −sg(w(π_θ/μ)_t) · A_t · log π_θ(a_t)                           verl bypass pg_is
    dual clip (A<0)   ℓ_t = −max(min(…), c·A_t)                                              Ye et al. 2020

The TIS talk's baselines are presets of these (config.py): PPO without correction (`off`), PPO-IS
(`ppo_is` = bypass_ppo), vanilla IS (`vanilla_is`, raw weights) and TIS (`tis`).

GSPO (`sequence_ratio=True`, Zheng et al. 2025, OpenRLHF `--actor.policy_loss_type gspo`) replaces ρ_t by one
ratio per sequence, s = exp((1/|A|) Σ_{t∈A} log(π_θ/π_old)_t) over its action tokens A, inside the same clip;
the correction then weighs and masks whole sequences (`CorrectionConfig.validate_for_sequence_ratio`), and
bypass_ppo puts μ in π_old's place inside s (upstream's GSPO with its is_correction flags).

Aggregation reproduces OpenRLHF 0.11.2's `aggregate_loss` (token-mean over the global token count, or
seq-mean-token-mean over the global sequence count, times dp_size to undo DP gradient averaging);
with `denominator="kept"` only surviving tokens/sequences count. A batch where nothing survives gives
loss 0 and zero gradient, never NaN: every masked term goes through `torch.where`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import CorrectionConfig
from .ops import finite
from .weights import AllReduce, CorrectionOutput, compute_correction

LOG_RATIO_CLAMP = 20.0  # OpenRLHF clamps log(π_θ/π_old) to ±20 before exp


def aggregate_loss(
    loss: torch.Tensor,
    mask: torch.Tensor,
    *,
    token_level: bool = True,
    dp_size: int = 1,
    batch_num_tokens: float | torch.Tensor | None = None,
    global_batch_size: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Scalar loss from a per-token loss, the OpenRLHF 0.11.2 way (NaN-safe where it returns NaN).

    token_level: Σ_t m_t ℓ_t / N · dp_size, N the global action-token count (local mean without N).
    otherwise:   Σ_s (Σ_t m ℓ / Σ_t m) / S · dp_size over sequences with a token, S the global count.
    """
    keep = mask.bool()
    return _aggregate_terms(torch.where(keep, loss, 0.0), keep, token_level=token_level, dp_size=dp_size,
                            batch_num_tokens=batch_num_tokens, global_batch_size=global_batch_size)


def _aggregate_terms(terms: torch.Tensor, mask: torch.Tensor, *, token_level: bool, dp_size: int,
                     batch_num_tokens: float | torch.Tensor | None,
                     global_batch_size: float | torch.Tensor | None) -> torch.Tensor:
    """`aggregate_loss` of terms already 0 off the mask (0/1 of any dtype), which then only counts."""
    if token_level:
        if batch_num_tokens is None:
            return terms.sum() / torch.count_nonzero(mask).clamp(min=1)
        return terms.sum() / batch_num_tokens * dp_size
    counts = torch.count_nonzero(mask, dim=-1)
    seq_loss = terms.sum(-1) / counts.clamp(min=1)
    seq_keep = counts > 0
    seq_terms = torch.where(seq_keep, seq_loss, 0.0)
    if global_batch_size is None:
        return seq_terms.sum() / seq_keep.sum().clamp(min=1)
    return seq_terms.sum() / global_batch_size * dp_size


def ppo_clip_loss(log_ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float,
                  dual_clip: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate −min(ρA, clip(ρ)A) (dual-clipped for A<0) and where clipping bound."""
    ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    surr1 = ratio * advantages
    surr2 = ratio.clamp(1 - eps_low, 1 + eps_high) * advantages
    clipped = torch.min(surr1, surr2)
    if dual_clip is not None:
        clipped = torch.where(advantages < 0, torch.max(clipped, dual_clip * advantages), clipped)
    return -clipped, surr2 < surr1


def sequence_log_ratio(log_ratio: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """GSPO's log s per sequence, (B, 1): the mean of log(π_θ/π_old) over the sequence's action tokens."""
    keep = action_mask.bool()
    return torch.where(keep, log_ratio, 0.0).sum(-1, keepdim=True) / keep.sum(-1, keepdim=True).clamp(min=1)


@dataclass
class PolicyLossOutput:
    loss: torch.Tensor
    """Scalar loss to backpropagate."""
    clip_ratio: torch.Tensor
    """Share of action tokens where the PPO clip binds (upstream `ppo_clip_ratio`)."""
    ppo_kl: torch.Tensor
    """Mean log(π_old/π_θ) over action tokens, π_old := μ in bypass losses (upstream `ppo_kl`)."""
    correction: CorrectionOutput
    """Weights, mask and metrics of the correction."""


def policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor | None,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    rollout_log_probs: torch.Tensor | None,
    config: CorrectionConfig,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    dual_clip: float | None = None,
    token_level_loss: bool = True,
    dp_size: int = 1,
    batch_num_tokens: float | torch.Tensor | None = None,
    global_batch_size: float | torch.Tensor | None = None,
    allreduce: AllReduce | None = None,
    normalizer: float | torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    with_metrics: bool = True,
    sequence_ratio: bool = False,
    details: bool = False,
) -> PolicyLossOutput:
    """The corrected policy loss for one micro-batch (see the module docstring for the formulas).

    `old_log_probs` is ignored by the bypass losses (π_old := μ) and may then be None. Without rollout
    log-probs only an inactive correction (`config.enabled` False) is possible. `sequence_ratio`: GSPO's
    ratio, one per sequence (upstream aggregates GSPO per sequence: pass token_level_loss=False for its loss).
    `details`: the correction also returns its raw weights and why each token was dropped (`CorrectionOutput`), so a
    per-token dump reads what this loss computed rather than a second computation.
    """
    cfg = config.validate()
    if sequence_ratio:
        cfg.validate_for_sequence_ratio()
    am = action_mask
    if rollout_log_probs is None:
        if cfg.enabled:
            raise ValueError("the rollout correction needs rollout log-probs (vLLM logprobs), got None")
        rollout_log_probs = old_log_probs  # metrics then describe a perfect match; nothing is corrected
    lp_detached = log_probs.detach()
    kwargs = dict(log_probs=log_probs, advantages=advantages, entropy=entropy, allreduce=allreduce,
                  normalizer=normalizer, with_metrics=with_metrics, details=details)

    if cfg.loss == "decoupled":
        corr = compute_correction(old_log_probs, rollout_log_probs, am, cfg, **kwargs)
        ref = old_log_probs
    else:
        # π_old := μ. The correction reads π_θ (detached) against μ, as verl's bypass mode does.
        corr = compute_correction(lp_detached, rollout_log_probs, am, cfg, **kwargs)
        ref = torch.where(torch.isfinite(rollout_log_probs), rollout_log_probs, lp_detached)
    log_ratio = log_probs - ref  # log(π_θ/π_old), π_old := μ in the bypass losses; ppo_kl reads it too
    if cfg.loss == "bypass_reinforce":
        token_loss = -advantages * log_probs  # REINFORCE; w = sg(·) multiplies below
        clipped = torch.zeros_like(am, dtype=torch.bool)
    else:
        clip_log_ratio = sequence_log_ratio(log_ratio, am) if sequence_ratio else log_ratio
        token_loss, clipped = ppo_clip_loss(clip_log_ratio, advantages, clip_eps_low, clip_eps_high, dual_clip)

    if cfg.enabled:
        keep = corr.mask.bool()
        token_loss = torch.where(keep, token_loss, 0.0)
        if cfg.loss != "bypass_ppo":  # bypass PPO: the clipped ratio π_θ/μ already is the IS weight
            token_loss = token_loss.mul_(corr.weights.to(token_loss.dtype))  # in place: where's own output
        loss_mask = keep if cfg.denominator == "kept" else am
    else:
        # Correction off: the loss is exactly upstream's; the correction only produced metrics.
        loss_mask = am
        token_loss = torch.where(am.bool(), token_loss, 0.0)

    # token_loss is 0 off loss_mask: the aggregation only counts the mask (aggregate_loss would mask again)
    if cfg.enabled and cfg.denominator == "kept":
        loss = _kept_mean(token_loss, loss_mask, token_level_loss, dp_size, allreduce)
    else:
        loss = _aggregate_terms(token_loss, loss_mask, token_level=token_level_loss, dp_size=dp_size,
                                batch_num_tokens=batch_num_tokens, global_batch_size=global_batch_size)

    n_act = torch.count_nonzero(am).clamp(min=1)
    clip_ratio = torch.count_nonzero(clipped.logical_and_(am)) / n_act
    ppo_kl = -torch.where(finite(ref, torch.bool).logical_and_(am), log_ratio.detach(), 0.0).sum() / n_act
    return PolicyLossOutput(loss=loss, clip_ratio=clip_ratio.detach(), ppo_kl=ppo_kl.detach(), correction=corr)


def _kept_mean(token_loss: torch.Tensor, keep: torch.Tensor, token_level: bool, dp_size: int,
               allreduce: AllReduce | None) -> torch.Tensor:
    """Mean over surviving tokens (or surviving sequences) of this micro-batch across all DP ranks."""
    if token_level:
        total = keep.sum().to(token_loss.dtype).reshape(1)
        if allreduce is not None:
            total = allreduce(total.clone())
        return token_loss.sum() / total.clamp(min=1).squeeze(0) * (dp_size if allreduce is not None else 1)
    counts = keep.sum(-1)
    seq_keep = counts > 0
    seq_loss = torch.where(seq_keep, token_loss.sum(-1) / counts.clamp(min=1), 0.0)
    total = seq_keep.sum().to(token_loss.dtype).reshape(1)
    if allreduce is not None:
        total = allreduce(total.clone())
    return seq_loss.sum() / total.clamp(min=1).squeeze(0) * (dp_size if allreduce is not None else 1)
