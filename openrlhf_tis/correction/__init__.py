"""The rollout-correction core: pure torch, importing nothing from openrlhf or vllm.

    from openrlhf_tis.correction import CorrectionConfig, compute_correction
    out = compute_correction(old_log_probs, rollout_log_probs, action_mask, CorrectionConfig(mode="mask"))
    out.weights, out.mask, out.metrics

docs/correction.md has the formulas, the sources and the bias/variance trade-offs of each option.
"""

from .config import (
    PRESETS,
    CorrectionConfig,
    CorrectionConfigError,
    RejectionCriterion,
    from_upstream,
    preset,
)
from .losses import PolicyLossOutput, aggregate_loss, policy_loss
from .weights import CorrectionOutput, compute_correction, kept_weight_totals, metric_names

__all__ = [
    "PRESETS",
    "CorrectionConfig",
    "CorrectionConfigError",
    "CorrectionOutput",
    "PolicyLossOutput",
    "RejectionCriterion",
    "aggregate_loss",
    "compute_correction",
    "from_upstream",
    "kept_weight_totals",
    "metric_names",
    "policy_loss",
    "preset",
]
