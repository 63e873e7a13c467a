"""The per-sample policy-version stamps the engine actor adds to every rollout (read by trainer/staleness.py).

A policy version counts the optimizer steps in the weights an engine holds: 0 for the base model, s after
the sync of step s. Kept here, below the trainer, because the engine writes them and the controller reads them.
"""

VERSION_FIRST = "policy_version_first"  # the engine's version when the sample's generation started
VERSION_LAST = "policy_version_last"  # ... and when it ended (differs only if a sync landed mid-sample)
