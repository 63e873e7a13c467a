"""The fall warning: the one rule the early-warning study found to hold up on runs it was not tuned on.

A run is warned from the first step whose sequence-level ESS of the rollout–training ratios (`mismatch/ess_seq`,
(Σ ρ)² / (S Σ ρ²), measured before any correction) falls below FALL_WARNING_ESS. Over the studies' runs
(study/early_warning.py; docs/study.md "Early warning"), runs warned this way fell (kept-policy gain < 0.1) far more
often than runs that were not, with steps to spare; within one setting (same flags, other seeds) the rule adds
little that those runs could measure, so read it as "this run is in the regime where runs fall", not as a
forecast for this seed.

Written by the trainer on every metrics line (`health/*`), shown on the console line and the dashboard; computed
the same way from any run's metrics.jsonl, so runs logged before the rule existed are judged alike.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from openrlhf_tis.metric_names import ESS_SEQ, HEALTH_ESS_WORST, HEALTH_FALL_WARNING

FALL_WARNING_ESS = 0.13  # the held runs' 10% quantile of their lowest ESS over all studies (early_warning.md)


@dataclass
class FallWatch:
    """The running lowest sequence ESS and the step it first fell below FALL_WARNING_ESS."""

    worst: float = math.nan
    warned_at: int | None = None

    def update(self, step: int, record: dict[str, Any]) -> dict[str, float]:
        """Take a step's metrics; returns its `health/*` metrics (none until the run has logged an ESS)."""
        ess = record.get(ESS_SEQ)
        if isinstance(ess, (int, float)) and math.isfinite(ess):
            self.worst = ess if math.isnan(self.worst) else min(self.worst, ess)
            if self.warned_at is None and self.worst < FALL_WARNING_ESS:
                self.warned_at = step
        if math.isnan(self.worst):
            return {}
        return {HEALTH_ESS_WORST: self.worst, HEALTH_FALL_WARNING: float(self.warned_at is not None)}


def watch_records(records: Iterable[dict[str, Any]]) -> FallWatch:
    """The watch after `records` (metrics lines in step order), e.g. a resumed run's kept lines."""
    watch = FallWatch()
    for record in records:
        watch.update(int(record.get("step", 0)), record)
    return watch


def health_label(records: Iterable[dict[str, Any]]) -> str | None:
    """The dashboard's word on a run: 'fall risk since step N (ESS x)', 'ok', or None before any ESS."""
    watch = watch_records(records)
    if math.isnan(watch.worst):
        return None
    if watch.warned_at is None:
        return "ok"
    return f"fall risk since step {watch.warned_at} (ESS {watch.worst:.2f})"
