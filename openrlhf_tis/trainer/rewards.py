"""Non-finite rewards stop at the controller, before they reach the advantages (`--reward.nonfinite`).

Upstream lets a NaN reward through: it enters the group baseline (every sample of its prompt group gets
a NaN advantage), the loss and gradients turn NaN or zero, and the run still exits 0 with a "final"
model. The PPO controller screens each step's rollout samples here, where the rewards of
`--reward.remote_url` arrive (samples_generator sets `Experience.rewards`, one sample per Experience,
each prompt's samples next to each other), before upstream's experience maker reads them.

`fail` (default) stops the step with the samples and the reward script named. `drop` removes every
prompt group holding a non-finite reward (a group baseline needs the whole group) and, with several
data-parallel actors, trims whole groups until every actor gets the same number of micro batches
(otherwise DeepSpeed's collectives would wait on the ranks with fewer); the step trains on the rest,
as upstream's dynamic filtering does when prompts run out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from openrlhf_tis.metric_names import REWARD_DROPPED, REWARD_NONFINITE
from openrlhf_tis.run_spec import run_spec

DROP_FLAG = "--reward.nonfinite drop"


class NonFiniteRewardError(RuntimeError):
    """A step's rewards hold NaN or inf (policy `fail`), or dropping them leaves nothing to train on."""


@dataclass(frozen=True)
class RewardPolicy:
    policy: str  # "fail" | "drop"
    group_size: int  # --rollout.n_samples_per_prompt
    source: str  # the reward script(s) or server(s), for messages
    data_parallel: int = 1
    rollout_micro_batch: int = 1
    train_micro_batch: int = 1

    @classmethod
    def from_args(cls, args) -> RewardPolicy:
        """From upstream's hierarchical args (the controller's `self.args`): the policy is the run spec's."""
        urls = args.reward.remote_url
        processes = args.actor.num_nodes * args.actor.num_gpus_per_node
        return cls(
            policy=run_spec(args).reward.nonfinite,
            group_size=max(int(args.rollout.n_samples_per_prompt), 1),
            source=", ".join(urls) if isinstance(urls, (list, tuple)) else str(urls),
            data_parallel=max(processes // args.ds.ring_attn_size // args.ds.tensor_parallel_size, 1),
            rollout_micro_batch=int(args.rollout.micro_batch_size),
            train_micro_batch=int(args.train.micro_batch_size),
        )

    def min_samples(self) -> int:
        """The fewest samples a step can train on: one train micro batch per data-parallel actor."""
        return self.train_micro_batch * self.data_parallel

    def keep_unit(self) -> int:
        """Kept samples come in multiples of this: whole groups, and equal rollout micro batches per actor."""
        if self.data_parallel == 1:
            return self.group_size
        return math.lcm(self.group_size, self.rollout_micro_batch * self.data_parallel)


def nonfinite_samples(samples: Sequence) -> list[int]:
    """Positions of the samples whose reward holds NaN or inf (samples without a reward are not judged here)."""
    return [i for i, s in enumerate(samples)
            if s.rewards is not None and not torch.isfinite(torch.as_tensor(s.rewards, dtype=torch.float64)).all()]


def describe_samples(samples: Sequence, positions: Sequence[int], group_size: int, limit: int = 4) -> str:
    """`#5 (prompt group 2) reward nan, label '4', prompt '...'` for the first `limit` positions."""
    parts = []
    for i in positions[:limit]:
        s = samples[i]
        reward = torch.as_tensor(s.rewards, dtype=torch.float64).reshape(-1).tolist()
        label = s.labels[0] if getattr(s, "labels", None) else None
        prompt = str(s.prompts[0])[-80:] if getattr(s, "prompts", None) else "?"
        parts.append(f"#{i} (prompt group {i // group_size}) reward {', '.join(map(str, reward))}, "
                     f"label {label!r}, prompt ...{prompt!r}")
    more = f"; and {len(positions) - limit} more" if len(positions) > limit else ""
    return "; ".join(parts) + more


def screen_rewards(samples: list, rules: RewardPolicy, step: int) -> tuple[list, dict[str, float]]:
    """The samples to train on at `step` and the `reward/*` counts; raises NonFiniteRewardError (see module doc)."""
    bad = nonfinite_samples(samples)
    metrics = {REWARD_NONFINITE: float(len(bad)), REWARD_DROPPED: 0.0}
    if not bad:
        return samples, metrics
    what = (f"step {step}: the reward from {rules.source} is NaN or inf for {len(bad)} of {len(samples)} samples: "
            f"{describe_samples(samples, bad, rules.group_size)}")
    if rules.policy != "drop":
        raise NonFiniteRewardError(f"{what}. Fix the reward, or pass {DROP_FLAG} to drop their prompt groups "
                                   "and go on.")
    kept = keep_groups(len(samples), bad, rules)
    if len(kept) < rules.min_samples():
        raise NonFiniteRewardError(f"{what}. {DROP_FLAG} leaves {len(kept)} samples, fewer than one "
                                   f"--train.micro_batch_size ({rules.train_micro_batch}) for each of "
                                   f"{rules.data_parallel} data-parallel actor(s).")
    metrics[REWARD_DROPPED] = float(len(samples) - len(kept))
    return [samples[i] for i in kept], metrics


def keep_groups(num_samples: int, bad: Sequence[int], rules: RewardPolicy) -> list[int]:
    """Positions left after removing every prompt group holding a `bad` position, trimmed to whole
    `keep_unit`s. Shared by reward screening and the staleness bound (trainer/staleness.py).
    """
    groups = {i // rules.group_size for i in bad}
    kept = [i for i in range(num_samples) if i // rules.group_size not in groups]
    unit = rules.keep_unit()
    return kept[: len(kept) // unit * unit]
