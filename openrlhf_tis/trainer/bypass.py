"""Controller side of bypass mode: π_old := μ, so the π_old forward is never dispatched.

`install_bypass_experience_maker` (called at the end of the controller's `__init__`, trainer/ppo_trainer.py)
re-classes upstream's experience maker to `RolloutAsOldExperienceMaker`, which hands μ over as π_old;
it also serves the reward's KL penalty. The actor side uses the same `rollout_as_old` on each training
step (trainer/ppo_actor.py), and its own `forward` stays exact: the weight-sync check scores with it.
"""

from __future__ import annotations

import ray
import torch
from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

from openrlhf_tis.run_spec import run_spec
from openrlhf_tis.trainer.actor_forward import ActorForwardSeam
from openrlhf_tis.upstream_guards import reclass


class RolloutAsOldExperienceMaker(ActorForwardSeam, RemoteExperienceMaker):
    """Bypass mode: π_old := μ, so the actor-group forward that computes π_old is never dispatched.

    `make_experience` dispatches one `forward` per model group; the actor group's answer is replaced
    by a ready object holding the rollout log-probs, in the layout upstream's own placeholder for
    absent models (`dummy_ref`) uses. Non-finite rollout log-probs become 0 here (they feed the reward's
    KL term); the correction masks those tokens from the loss anyway.
    """

    def _actor_forward(self, samples, sync_condition, **kwargs):
        if any(s.rollout_log_probs is None for s in samples):
            raise RuntimeError("--algo.correction.loss bypass_*: rollout log-probs are missing, cannot skip π_old")
        duplicate = self.args.ds.ring_attn_size * self.args.ds.tensor_parallel_size
        old = [rollout_as_old(s.rollout_log_probs, s.action_mask) for s in samples]
        return ray.put([[lp] for lp in old for _ in range(duplicate)])


def rollout_as_old(rollout_log_probs: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """μ in the place of π_old: finite (NaN/inf -> 0) and zero off the action tokens, like the actor's output."""
    finite = torch.nan_to_num(rollout_log_probs.float(), nan=0.0, posinf=0.0, neginf=0.0)
    return finite * action_mask.to(finite.dtype)


def install_bypass_experience_maker(controller) -> bool:
    """In bypass mode, switch the controller's experience maker to `RolloutAsOldExperienceMaker`.

    Call at the end of the PPO controller's __init__ (it owns `experience_maker` and `args`); returns
    whether it switched. Re-classing keeps every attribute upstream's constructor set.
    """
    if not run_spec(controller.args).correction.bypass:
        return False
    reclass(controller.experience_maker, RolloutAsOldExperienceMaker, supported="==0.11.2",
            patch="openrlhf_tis/trainer/bypass.py", overrides=("make_experience", "_dispatch_forward"))
    return True
