"""The driver's half of the rollout precision: write the rollout model and point the engines at it.

Lives in the CLI because it wires a patch (`patches/rollout_engine.py`) into upstream's `train()`;
the rollout layer below only writes the directory (`rollout.checkpoint.write_rollout_model`).
"""

from __future__ import annotations

from openrlhf_tis.moe.coverage import ENGINE_ROUTING_MODES
from openrlhf_tis.run_spec import RolloutPlan
from openrlhf_tis.runs.layout import ROLLOUT_MODEL_DIR


def prepare_rollout_engines(args, plan: RolloutPlan) -> str | None:
    """Write <run_dir>/rollout_model as the run spec's rollout `plan` says and point the engines at it; None when
    upstream's engines need nothing (bf16 without the fp32 head). With routing replay the engines are built from the
    actor class that starts a CUDA engine returning its routed experts (rollout/engine_actor.py).

    Runs in the driver after the checks and before Ray starts, so any error is one message and no
    engine has started.
    """
    import os

    from openrlhf_tis.patches import rollout_engine

    routed_experts = plan.routing_replay in ENGINE_ROUTING_MODES
    if not plan.writes_model:  # upstream's engines as they are
        if routed_experts:
            rollout_engine.use_fork_engine_actor(routed_experts=True)
        return None
    from openrlhf_tis.rollout.checkpoint import write_rollout_model

    dst = os.path.abspath(os.path.join(getattr(args, "logger.run_dir"), ROLLOUT_MODEL_DIR))
    precision, bits, fp8_block = plan.precision, plan.weight_bits, plan.fp8_block
    write_rollout_model(getattr(args, "actor.model_name_or_path"), dst, precision=precision, scale_mode=plan.scales,
                        calibration=plan.calibration, fp32_head=plan.fp32_head, activations=plan.activations,
                        weight_bits=bits, fp8_block=fp8_block)
    details = [*([f"{bits}-bit weights"] if precision == "int8" else []),
               *([f"{fp8_block[0]}x{fp8_block[1]} blocks"] if fp8_block else []),
               *(["static activation scales"] if plan.activations == "static" else []),
               *(["fp32 head"] if plan.fp32_head else [])]
    print(f"[openrlhf_tis] rollout model ({', '.join([precision, *details])}) written to {dst}")
    rollout_engine.apply(dst, routed_experts=routed_experts)
    return dst
