"""The run's CorrectionConfig as the Ray actors read it, on both sides: the actor (its loss) and the
controller (bypass mode's experience maker)."""

from __future__ import annotations

from openrlhf_tis.correction import CorrectionConfig, from_upstream


def correction_config_from_args(args) -> CorrectionConfig:
    """The resolved CorrectionConfig of a run (hierarchized args, as the Ray actors receive them).

    The fork's CLI stores it in `args.algo.correction.resolved`; without it (upstream's own CLI, unit
    tests) upstream's `--algo.advantage.is_correction_*` flags are mapped.
    """
    resolved = getattr(getattr(args.algo, "correction", None), "resolved", None)
    if resolved:
        return CorrectionConfig.from_json(resolved)
    adv = args.algo.advantage
    return from_upstream(adv.is_correction_level, adv.is_correction_mode, adv.is_correction_gating,
                         adv.is_correction_threshold, policy_loss_type=args.actor.policy_loss_type)


