"""Controller side of routing replay (`--vllm.routing_replay`): the π_old forward on the actor group either receives
each micro-batch's routed experts, which it replays (r3: the engines'), or records its own routing and sends it back
with the log-probs (r2), which then rides with the samples to the training steps; trainer/moe_replay.py,
trainer/ppo_actor.py `forward`.

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


class OwnRoutingExperienceMaker(ActorForwardSeam, RemoteExperienceMaker):
    """Upstream's experience maker whose π_old forward on the actor group records its routers' own choice (R2): each
    micro-batch's result comes back as (log-probs, one routing per sample); upstream gets the log-probs, the
    micro-batch's `info` the routings, as an engine's would ride (moe/routing_batch.py)."""

    _recording = None  # the actor group's result refs of the call in flight

    def _actor_forward(self, samples, sync_condition, **kwargs):
        self._recording = super()._actor_forward(samples, sync_condition, record_routing=[True] * len(samples),
                                                 **kwargs)
        return self._recording

    def _flatten_results(self, refs, duplicate_factor):
        results = super()._flatten_results(refs, duplicate_factor)
        if refs is not self._recording:
            return results
        self._recording = None
        samples = self._samples_in_flight
        if len(results) != len(samples):
            raise RuntimeError(f"--vllm.routing_replay r2: {len(results)} π_old results for {len(samples)} "
                               "micro-batches")
        log_probs = []
        for micro_batch, (action_log_probs, routings) in zip(samples, results, strict=True):
            micro_batch.info[ROUTED_EXPERTS] = routings
            log_probs.append(action_log_probs)
        return log_probs


def install_routing_experience_maker(controller, mode: str) -> None:
    """Switch the controller's experience maker to the one `mode` (r3 or r2) needs."""
    if mode == "r3":
        reclass(controller.experience_maker, RoutingExperienceMaker, supported="==0.11.2",
                patch="openrlhf_tis/trainer/moe_experience.py", overrides=("make_experience", "_dispatch_forward"))
    elif mode == "r2":
        reclass(controller.experience_maker, OwnRoutingExperienceMaker, supported="==0.11.2",
                patch="openrlhf_tis/trainer/moe_experience.py",
                overrides=("make_experience", "_dispatch_forward", "_flatten_results"))
    else:
        raise ValueError(f"--vllm.routing_replay: no experience maker for {mode!r}")
