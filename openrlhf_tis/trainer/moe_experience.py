"""Controller side of routing replay (`--vllm.routing_replay r3`): the π_old forward on the actor group receives
each micro-batch's routed experts, which it replays (trainer/moe_replay.py, trainer/ppo_actor.py `forward`).

`install_routing_experience_maker` (called at the end of the controller's `__init__`, trainer/ppo_trainer.py, unless a
bypass loss skips the π_old forward) re-classes upstream's experience maker, which passes its forward kwargs to every
model group alike and has no per-group seam.
"""

from __future__ import annotations

from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

from openrlhf_tis.moe.routing_batch import ROUTED_EXPERTS
from openrlhf_tis.trainer.actor_forward import ActorForwardSeam
from openrlhf_tis.upstream_guards import reclass


class RoutingExperienceMaker(ActorForwardSeam, RemoteExperienceMaker):
    """Upstream's experience maker whose π_old forward on the actor group receives each micro-batch's routings
    (`routed_experts`, one list of per-sample tensors per micro-batch, sliced with the other arguments)."""

    def _actor_forward(self, samples, sync_condition, **kwargs):
        missing = sum(ROUTED_EXPERTS not in s.info for s in samples)
        if missing:
            raise RuntimeError(f"--vllm.routing_replay r3: {missing} of {len(samples)} micro-batches came "
                               "without the engines' routed experts")
        return super()._actor_forward(samples, sync_condition, routed_experts=[s.info[ROUTED_EXPERTS] for s in samples],
                                      **kwargs)


def install_routing_experience_maker(controller) -> None:
    """Switch the controller's experience maker to `RoutingExperienceMaker`."""
    reclass(controller.experience_maker, RoutingExperienceMaker, supported="==0.11.2",
            patch="openrlhf_tis/trainer/moe_experience.py", overrides=("make_experience", "_dispatch_forward"))
