"""The rollout-correction core: pure torch, importing nothing from openrlhf or vllm.

    from openrlhf_tis.correction import CorrectionConfig, compute_correction
    out = compute_correction(old_log_probs, rollout_log_probs, action_mask, CorrectionConfig(mode="mask"))
    out.weights, out.mask, out.metrics

docs/correction.md has the formulas, the sources and the bias/variance trade-offs of each option.
The torch half (weights, losses) loads on first use, so `correction.config` (and the bottom module
`openrlhf_tis.metric_names`) stay importable without torch (notebook kernels, the CLI's checks before Ray starts).
"""

from typing import Any

from .config import (
    PRESETS,
    CorrectionConfig,
    CorrectionConfigError,
    RejectionCriterion,
    from_upstream,
    preset,
)

_LOSSES = ("PolicyLossOutput", "aggregate_loss", "policy_loss")
_WEIGHTS = ("CorrectionOutput", "compute_correction", "kept_weight_totals", "metric_names")


def __getattr__(name: str) -> Any:
    if name in _LOSSES:
        from . import losses

        return getattr(losses, name)
    if name in _WEIGHTS:
        from . import weights

        return getattr(weights, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
