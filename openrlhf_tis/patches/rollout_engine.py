"""Start the rollout engines from the fork's rollout model directory (INT8 checkpoint, fp32/fp8, fp32 head).

OpenRLHF 0.11.2's `create_vllm_engines` (openrlhf/trainer/ray/vllm_engine.py) hard-codes the engine
kwargs (dtype bf16, no quantization) and is handed `--actor.model_name_or_path`. vLLM, however, reads
`quantization_config` and `head_dtype` from the model's config.json, so pointing the engines (only
them: the trainer keeps the original model) at the directory written by
openrlhf_tis.rollout.checkpoint.write_rollout_model is enough. `train()` imports the function by name
from `openrlhf.trainer.ray` when it runs, so the package attribute is replaced (driver only).
"""

from __future__ import annotations

import ray

from openrlhf_tis.upstream_guards import replace, require_version

NAME = "rollout_engine"


def use_fork_engine_actor(*, routed_experts: bool = False) -> None:
    """Build every engine from the fork's actor class (precision from the plan, bucketed CPU sync); with
    `routed_experts` (routing replay), the one that starts a CUDA engine returning its routed experts.

    create_vllm_engines builds its actors from this module global; with a plain model directory
    (no plan) the fork's actor starts the engine exactly as upstream's does. Its concurrency is raised from Ray's
    1,000 for async actors: the batch gate holds a dispatch's calls until the last arrives (rollout/batch_gate.py).
    """
    import openrlhf.trainer.ray.vllm_engine as upstream_engine

    from openrlhf_tis.rollout.batch_gate import CALLS_AT_ONCE
    from openrlhf_tis.rollout.engine_actor import PrecisionRolloutRayActor, RoutedExpertsRolloutRayActor

    actor = RoutedExpertsRolloutRayActor if routed_experts else PrecisionRolloutRayActor
    replace(upstream_engine, "RolloutRayActor", ray.remote(max_concurrency=CALLS_AT_ONCE)(actor), patch=NAME)


def apply(rollout_model_dir: str, *, routed_experts: bool = False) -> bool:
    """Make every engine `train()` creates load `rollout_model_dir` instead of the actor's model."""
    require_version("openrlhf", "==0.11.2", patch=NAME)
    import openrlhf.trainer.ray as upstream_ray

    original = upstream_ray.create_vllm_engines

    def create_vllm_engines(num_engines, tensor_parallel_size, pretrain, *args, **kwargs):
        print(f"[openrlhf_tis] vLLM engines start from {rollout_model_dir} (rollout variant of {pretrain})")
        return original(num_engines, tensor_parallel_size, rollout_model_dir, *args, **kwargs)

    replace(upstream_ray, "create_vllm_engines", create_vllm_engines, patch=NAME)
    use_fork_engine_actor(routed_experts=routed_experts)
    return True
