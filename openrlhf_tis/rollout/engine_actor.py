"""The fork's rollout engine actor: honours the rollout directory's precision, syncs in buckets.

Upstream's `create_vllm_engines` passes a fixed `dtype="bfloat16"` and no quantization to every
engine. The fork points the engines at `<run_dir>/rollout_model` (patches/rollout_engine.py), whose
plan file names the precision; this subclass of upstream's actor turns that plan into the engine's
dtype / quantization arguments just before the engine is built, in the engine's own process.
It also exposes the CPU weight sync's bucketed receive (patches/cpu_weight_sync.py), which upstream's
actor has no method for, and makes a failing reward fail the rollout (rollout/reward_executor.py).
"""

from __future__ import annotations

import torch
from openrlhf.trainer.ray.vllm_engine import RolloutRayActor as _UpstreamActorClass

from openrlhf_tis.ray_classes import ray_actor_class
from openrlhf_tis.rollout.checkpoint import read_plan
from openrlhf_tis.rollout.precision import engine_kwargs
from openrlhf_tis.rollout.reward_executor import make_rewards_loud

_UpstreamRolloutRayActor = ray_actor_class(_UpstreamActorClass)


def plan_engine_overrides(model_dir: str, cuda: bool) -> dict:
    """dtype / quantization for the engine of a rollout directory; {} for a plain model directory.

    The lm_head dtype is not among them: it travels in the directory's config.json (`head_dtype`).
    """
    plan = read_plan(model_dir)
    if plan is None:
        return {}
    kwargs = engine_kwargs(plan["precision"], model_dir, cuda=cuda)
    kwargs.pop("model")
    return kwargs


class PrecisionRolloutRayActor(_UpstreamRolloutRayActor):
    async def __init__(self, *args, **kwargs):
        overrides = plan_engine_overrides(kwargs["model"], cuda=torch.cuda.is_available())
        if overrides:
            print(f"[openrlhf_tis] rollout engine {kwargs['model']}: {overrides}")
        await super().__init__(*args, **{**kwargs, **overrides})
        make_rewards_loud(self.executor)

    async def update_weights_bucket(self, names_shapes, dtype, last=False):
        """Receive one flat broadcast of several parameters (CPU weight sync); reload after the last."""
        return await self.llm.collective_rpc("update_weights_bucket", args=(names_shapes, dtype, last))
