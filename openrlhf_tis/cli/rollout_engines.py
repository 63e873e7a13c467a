"""The driver's half of the rollout precision: write the rollout model and point the engines at it.

Lives in the CLI because it wires a patch (`patches/rollout_engine.py`) into upstream's `train()`;
the rollout layer below only writes the directory (`rollout.checkpoint.write_rollout_model`).
"""

from __future__ import annotations

from openrlhf_tis.cli.cluster_device import DEVICE_DEST
from openrlhf_tis.rollout.precision import (
    ACTIVATIONS_FLAG,
    CALIBRATION_FLAG,
    FP8_CUDA_BLOCK,
    FP32_HEAD_FLAG,
    PRECISION_FLAG,
    SCALES_FLAG,
    WEIGHT_BITS_FLAG,
    rollout_option,
)
from openrlhf_tis.runs.layout import ROLLOUT_MODEL_DIR


def prepare_rollout_engines(args) -> str | None:
    """Write <run_dir>/rollout_model and point the engines at it; None when the defaults need nothing.

    Runs in the driver after the checks and before Ray starts, so any error is one message and no
    engine has started.
    """
    import os

    precision, fp32_head = rollout_option(args, PRECISION_FLAG), rollout_option(args, FP32_HEAD_FLAG)
    if precision == "bf16" and not fp32_head:  # upstream's engines as they are
        return None
    from openrlhf_tis.patches import rollout_engine
    from openrlhf_tis.rollout.checkpoint import write_rollout_model
    from openrlhf_tis.rollout.quantize import int8_weight_bits

    dst = os.path.abspath(os.path.join(getattr(args, "logger.run_dir"), ROLLOUT_MODEL_DIR))
    # the cluster's device, never the driver's
    bits = int8_weight_bits(rollout_option(args, WEIGHT_BITS_FLAG), cuda=getattr(args, DEVICE_DEST) == "cuda")
    activations = rollout_option(args, ACTIVATIONS_FLAG)
    # CUDA FP8 engines load a block-FP8 checkpoint the fork re-quantizes at every sync; CPU ones quantize online
    fp8_block = FP8_CUDA_BLOCK if precision == "fp8" and getattr(args, DEVICE_DEST) == "cuda" else None
    write_rollout_model(getattr(args, "actor.model_name_or_path"), dst, precision=precision,
                        scale_mode=rollout_option(args, SCALES_FLAG),
                        calibration=rollout_option(args, CALIBRATION_FLAG), fp32_head=fp32_head,
                        activations=activations, weight_bits=bits, fp8_block=fp8_block)
    details = [*([f"{bits}-bit weights"] if precision == "int8" else []),
               *([f"{fp8_block[0]}x{fp8_block[1]} blocks"] if fp8_block else []),
               *(["static activation scales"] if activations == "static" else []),
               *(["fp32 head"] if fp32_head else [])]
    print(f"[openrlhf_tis] rollout model ({', '.join([precision, *details])}) written to {dst}")
    rollout_engine.apply(dst)
    return dst
