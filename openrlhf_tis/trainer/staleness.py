"""Policy versions of rollout samples, their lag behind the trainer, and the lag bound.

A policy version counts the optimizer steps in a set of weights: the base model is version 0 and the
weights synced after step s are version s. The fork's engine actor stamps each sample with the version
it held when the sample's generation started and when it ended (`rollout/engine_actor.py`; the two
differ only with `--train.partial_rollout_enable`, where a sync may land mid-sample, so they bound the
versions of the sample's segments). The controller trains step s+1 with π_old = version s; a sample's
lag is s minus its *first* version: the age of its oldest token. A synchronous run has lag 0 everywhere.

Lag does not change what the correction computes: μ is always the log-prob the engine sampled with,
whatever its version, and π_old is the trainer's policy at the step (decoupled PPO), so `mismatch/*`
measures precision and staleness together.
"""

from __future__ import annotations

from collections.abc import Sequence

from openrlhf_tis.metric_names import (
    STALENESS_DROPPED,
    STALENESS_MAX,
    STALENESS_MEAN,
    STALENESS_SPANNING_SYNC,
    staleness_lag_key,
)
from openrlhf_tis.rollout.versions import VERSION_FIRST, VERSION_LAST
from openrlhf_tis.trainer.rewards import RewardPolicy, keep_groups

LAG = "staleness_lag"  # per-sample info key the actor carries into the token dumps
MAX_LAG_FLAG = "--train.async_max_lag"


class StalenessError(RuntimeError):
    """A step whose samples are all older than `--train.async_max_lag` allows."""


def _info_int(sample, key: str) -> int | None:
    value = sample.info.get(key) if getattr(sample, "info", None) else None
    if value is None:
        return None
    return int(value.reshape(-1)[0].item()) if hasattr(value, "reshape") else int(value)


def sample_lags(samples: Sequence, trainer_version: int) -> list[int]:
    """Each sample's lag: `trainer_version` minus the version its generation started with (0 when unstamped)."""
    lags = []
    for sample in samples:
        first = _info_int(sample, VERSION_FIRST)
        lags.append(max(trainer_version - first, 0) if first is not None else 0)
    return lags


def staleness_metrics(lags: Sequence[int], partial: Sequence[int] = ()) -> dict[str, float]:
    """`staleness/mean`, `staleness/max` and the share of samples at each lag 0..max (`staleness/lag_<k>`).

    `partial` (same length, optional) marks samples whose generation spanned a weight sync.
    """
    n = max(len(lags), 1)
    top = max(lags, default=0)
    metrics = {STALENESS_MEAN: sum(lags) / n, STALENESS_MAX: float(top)}
    for k in range(top + 1):
        metrics[staleness_lag_key(k)] = sum(1 for lag in lags if lag == k) / n
    if partial:
        metrics[STALENESS_SPANNING_SYNC] = sum(1 for p in partial if p) / n
    return metrics


def spans_sync(samples: Sequence) -> list[bool]:
    """Whether each sample's generation saw a weight sync (its first and last versions differ)."""
    return [(_info_int(s, VERSION_FIRST) or 0) != (_info_int(s, VERSION_LAST) or 0) for s in samples]


def stamp_lags(samples: Sequence, lags: Sequence[int]) -> None:
    """Carry each lag to the actor (token dumps) as a per-sample info tensor; drop the raw versions.

    The versions are popped so the actor does not log them as metrics (it logs every info key).
    """
    import torch

    for sample, lag in zip(samples, lags, strict=True):
        sample.info.pop(VERSION_FIRST, None)
        sample.info.pop(VERSION_LAST, None)
        sample.info[LAG] = torch.tensor([float(lag)])


def drop_stale(samples: list, lags: Sequence[int], max_lag: int | None, rules: RewardPolicy,
               step: int) -> tuple[list, list[int], dict[str, float]]:
    """The samples within `max_lag`, their lags, and `staleness/dropped_samples`.

    A prompt group goes whole when any of its samples is too old (the group baseline needs all of it);
    the kept samples are trimmed as reward screening trims them (trainer/rewards.py `keep_groups`).
    """
    if max_lag is None:
        return samples, list(lags), {}
    stale = [i for i, lag in enumerate(lags) if lag > max_lag]
    if not stale:
        return samples, list(lags), {STALENESS_DROPPED: 0.0}
    kept_positions = keep_groups(len(samples), stale, rules)
    if len(kept_positions) < rules.min_samples():
        raise StalenessError(
            f"step {step}: {len(stale)} of {len(samples)} samples are older than {MAX_LAG_FLAG} {max_lag} "
            f"(lags up to {max(lags)}), and dropping their prompt groups leaves fewer than one train micro batch "
            f"per actor. Raise {MAX_LAG_FLAG} or lower --train.async_queue_size.")
    return ([samples[i] for i in kept_positions], [lags[i] for i in kept_positions],
            {STALENESS_DROPPED: float(len(samples) - len(kept_positions))})
