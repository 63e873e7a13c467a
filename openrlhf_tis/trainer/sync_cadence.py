"""A staleness dose set by a flag: the engines receive the trainer's weights after every K-th step only.

Async training gives samples a lag that depends on timing. For a study the lag must be known and fixed: with
`--vllm.sync_every K` the weights go to the engines after steps K, 2K, ..., so the engines that roll out step s+1
hold version K⌊s/K⌋ and every sample of that step is s mod K versions behind π_old (lags 0, 1, ..., K−1 in turn,
mean (K−1)/2; K = 1 is upstream's sync after every step). Each sample is stamped with the version it was generated
by as always (trainer/staleness.py), so `staleness/*` and `mismatch_by_lag/*` (trainer/mismatch_by_lag.py) report
what the cadence did. A sync at a run's start (a resume's, before its first step) always happens: the engines must
hold the checkpoint's weights, the only ones at hand, so the first steps after a resume carry less lag than the
uninterrupted run's would. The sync check counts the syncs that happen.
"""

from __future__ import annotations

from openrlhf_tis.flags import plan_flags
from openrlhf_tis.run_spec import SyncPlan
from openrlhf_tis.trainer.step_part import StepPart

SYNC_EVERY_FLAG = plan_flags(SyncPlan)["every"].name


class SyncCadencePart(StepPart):
    """Whether the weight sync after the current step is due (read by the controller's broadcast_to_vllm)."""

    def __init__(self, every: int):
        if every < 1:
            raise ValueError(f"{SYNC_EVERY_FLAG} must be >= 1, got {every}")
        self.every = every
        self.due = True

    def on_start(self, step: int) -> None:
        self.due = True  # the start's sync (a resume's): the engines must hold the checkpoint's weights

    def after_fit(self, step: int) -> None:
        self.due = step % self.every == 0


def lag_of_step(step: int, every: int) -> int:
    """The lag of every sample of metrics step `step` (1-based) in a fresh run under a sync every `every` steps:
    π_old is version step − 1, the engines hold the last multiple of `every` at or below it."""
    return (step - 1) % every
