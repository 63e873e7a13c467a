"""OpenRLHF 0.11.2's PPO `PolicyLoss`, stated by this project from its formula: upstream's side of
benchmarks/gpu_check.py on a machine where `openrlhf.models` does not import (no OpenRLHF, or none of its
DeepSpeed / flash-attn imports), so the check still compares the fork against upstream's numbers.

Written here from the mathematics, not copied; tests/test_upstream_formula.py holds it equal to upstream's own
class on random inputs (float64, every scheme below, both aggregations, global counts, dual clip). Per token t of
sequence s, with ρ = exp(clamp(log π_θ − log π_old, ±20)), advantage A and action mask m:

    ℓ = −min(ρA, clip(ρ, 1 − ε_lo, 1 + ε_hi)A)              PPO; for A < 0 with dual clip c: −max(min(…), cA)

The rollout correction (`is_correction_level` token or seq, ratio gate), with r = π_old/μ = exp(λ), λ = sg(log π_old
− log μ), and band [lo, hi], multiplies ℓ by a coefficient:

    statistic   token: r_t                            seq: exp(Σ_t m λ / Σ_t m), one per sequence
    clip        clamp(statistic, lo, hi)              (token level only)
    mask        r_t where lo ≤ statistic ≤ hi, else 0 (ICEPOP at token level, seq-mask-tis per sequence)

and reports the filtered share (out-of-band tokens among action tokens, or out-of-band sequences among all) and
k1 = Σ m (log μ − log π_old) / Σ m. The scalar loss: Σ m ℓ / N · dp_size with N the global action-token count
(Σ m ℓ / Σ m without it), or per sequence Σ_s [Σ_t m ℓ / (Σ_t m + 1e-8)] / S · dp_size over sequences with an
action token (their mean without the global count S). Then clip_ratio = Σ m [clip(ρ)A < ρA] / Σ m and
ppo_kl = Σ m (log π_old − log π_θ) / Σ m, the latter unclamped.

It does the same tensor passes as upstream, one per term, so it also stands in as the baseline of gpu_check's
cost and step rows: without a correction (the baseline every cost goal is a ratio to) its kernels and peak memory
on the CPU are held to upstream's by the same test. It states the ratio gate only: the binary-KL and TV gates and
GSPO's sequence ratio are outside what gpu_check compares.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

LOG_RATIO_BOUND = 20.0  # upstream clamps log(π_θ/π_old) to ±20 before exp
SEQ_COUNT_EPS = 1e-8  # upstream's per-sequence mean divides by (token count + 1e-8)

Losses = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Σ x·m / Σ m over `dim` (everything when None), with no guard: an empty mask gives NaN, as upstream's does."""
    if dim is None:
        return (x * mask).sum() / mask.sum()
    return (x * mask).sum(dim) / mask.sum(dim)


@dataclass
class StatedPolicyLoss:
    """Upstream's PPO `PolicyLoss` with the same constructor keywords and call, so that gpu_check and
    bench_correction take it where they would take `openrlhf.models.PolicyLoss`."""

    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    dual_clip: float | None = None
    token_level_loss: bool = True
    is_correction_level: str = "off"
    is_correction_mode: str = "mask"
    is_correction_gating: str = "ratio"
    is_correction_threshold: Sequence[float] = (0.5, 5.0)

    def __post_init__(self) -> None:
        """Refuse what upstream refuses, and what this statement does not cover, rather than compute it wrong."""
        if self.dual_clip is not None and not self.dual_clip > 1.0:
            raise ValueError(f"dual_clip must be > 1.0, got {self.dual_clip}")
        if self.is_correction_level not in ("off", "token", "seq"):
            raise ValueError(f"is_correction_level must be off/token/seq, got {self.is_correction_level!r}")
        if self.is_correction_mode not in ("mask", "clip"):
            raise ValueError(f"is_correction_mode must be mask/clip, got {self.is_correction_mode!r}")
        if self.is_correction_gating != "ratio":
            raise ValueError(f"only the ratio gate is stated here, not {self.is_correction_gating!r}")
        if self.is_correction_mode == "clip" and self.is_correction_level == "seq":
            raise ValueError("is_correction_mode clip is a per-token clamp: it needs is_correction_level token")
        low, high = self.is_correction_threshold
        self.is_correction_threshold = (float(low), float(high))

    def __call__(self, log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                 action_mask: torch.Tensor, rollout_log_probs: torch.Tensor | None = None, dp_size: int = 1,
                 batch_num_tokens: float | torch.Tensor | None = None,
                 global_batch_size: float | torch.Tensor | None = None) -> Losses:
        """(loss, clip_ratio, ppo_kl, k1 or None, filtered share or None), upstream's five outputs in its order."""
        log_ratio = log_probs - old_log_probs
        ratio = log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()
        unclipped = ratio * advantages
        clipped = ratio.clamp(1 - self.clip_eps_low, 1 + self.clip_eps_high) * advantages
        token_loss = self._ppo_loss(unclipped, clipped, advantages)
        k1 = filtered_share = None
        if self.is_correction_level != "off":
            coefficient, filtered = self._correction(old_log_probs, rollout_log_probs, action_mask)
            token_loss = coefficient * token_loss
            filtered = filtered.float()
            seq_level = self.is_correction_level == "seq"
            filtered_share = filtered.mean() if seq_level else masked_mean(filtered, action_mask)
            k1 = masked_mean(rollout_log_probs - old_log_probs, action_mask)
        loss = self._aggregate(token_loss, action_mask, dp_size, batch_num_tokens, global_batch_size)
        clip_ratio = masked_mean((clipped < unclipped).float(), action_mask)
        ppo_kl = masked_mean(-log_ratio.detach(), action_mask)
        return loss, clip_ratio, ppo_kl, k1, filtered_share

    def _ppo_loss(self, unclipped: torch.Tensor, clipped: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
        """−min(ρA, clip(ρ)A), dual-clipped for A < 0; its own function so that the surrogate is freed on return,
        as upstream frees it, which keeps the baseline's peak memory equal to upstream's."""
        surrogate = torch.min(unclipped, clipped)
        if self.dual_clip is not None:
            surrogate = torch.where(advantages < 0, torch.max(surrogate, self.dual_clip * advantages), surrogate)
        return -surrogate

    def _correction(self, old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                    action_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(coefficient on each token's loss, out-of-band units): the gate reads the statistic, survivors of a
        mask keep their own token ratio r_t, a clip replaces it by the clamped statistic."""
        low, high = self.is_correction_threshold
        log_is = (old_log_probs - rollout_log_probs).detach()
        token_is = log_is.exp()
        if self.is_correction_level == "seq":
            statistic = masked_mean(log_is, action_mask, dim=-1).unsqueeze(-1).exp()
        else:
            statistic = token_is
        if self.is_correction_mode == "clip":
            return statistic.clamp(low, high), (statistic < low) | (statistic > high)
        inside = (statistic >= low) & (statistic <= high)
        return torch.where(inside, token_is, 0.0), ~inside

    def _aggregate(self, token_loss: torch.Tensor, action_mask: torch.Tensor, dp_size: int,
                   batch_num_tokens: float | torch.Tensor | None,
                   global_batch_size: float | torch.Tensor | None) -> torch.Tensor:
        """The scalar loss: a token mean, or a mean of per-sequence token means; global counts (times dp_size,
        which undoes the data-parallel gradient averaging) where given, local ones otherwise."""
        masked = token_loss * action_mask
        if self.token_level_loss:
            if batch_num_tokens is None:
                return masked.sum() / action_mask.sum()
            return masked.sum() / batch_num_tokens * dp_size
        counts = action_mask.sum(-1)
        per_sequence = masked.sum(-1) / (counts + SEQ_COUNT_EPS)
        has_tokens = (counts > 0).float()
        if global_batch_size is None:
            return masked_mean(per_sequence, has_tokens)
        return (per_sequence * has_tokens).sum() / global_batch_size * dp_size
