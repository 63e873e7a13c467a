"""Flags the fork adds to upstream's train_ppo_ray, in upstream's dotted style."""

from __future__ import annotations

import argparse


def add_fork_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--vllm.sync_check_steps",
        type=int,
        default=1,
        help="Verify every Nth DeepSpeed->vLLM weight sync by scoring a probe text on both sides "
        "(openrlhf_tis.trainer.sync_check); 0 disables. Costs one short prefill per engine.",
    )
    parser.add_argument(
        "--vllm.sync_check_tolerance",
        type=float,
        default=0.5,
        help="Stop the run when the engines and the trainer disagree by more than this mean |dlogp| on "
        "the probe after a sync (bf16 vs bf16 kernels differ by ~0.01-0.05).",
    )
    parser.add_argument(
        "--logger.run_dir",
        type=str,
        default=None,
        help="Run directory of the run store (metrics.jsonl, ...). Default: ./runs/<UTC timestamp>.",
    )

    # Rollout precision (openrlhf_tis.rollout, docs/rollout_precision.md; DESIGN §4).
    parser.add_argument(
        "--vllm.rollout_precision",
        type=str,
        default="bf16",
        choices=["bf16", "fp32", "int8", "fp8"],
        help="Precision of the vLLM rollout engines. int8: W8A8 compressed-tensors (per-channel int8 weights, "
        "dynamic per-token int8 activations; embeddings and lm_head unquantized), written under the run dir "
        "before the engines start and re-quantized at every weight sync (FlashRL-style calibration transfer). "
        "fp32/fp8 are available to openrlhf_tis.rollout and the benchmark but not yet to this command.",
    )
    parser.add_argument(
        "--vllm.int8_scales",
        type=str,
        default="recompute",
        choices=["recompute", "frozen"],
        help="Per-channel int8 weight scales at each sync: recomputed from the new weights (exact, never "
        "saturates) or frozen at their initial values (saturation counted in "
        "<run_dir>/rollout_model/sync_stats.jsonl).",
    )
    parser.add_argument(
        "--vllm.int8_calibration",
        type=str,
        default=None,
        help="SmoothQuant smoothing factors calibrated once on prompts (python -m openrlhf_tis.rollout.calibration); "
        "applied to the initial checkpoint and to every sync. Refused when made for another model.",
    )
    parser.add_argument(
        "--vllm.fp32_lm_head",
        action="store_true",
        default=False,
        help="Run the engines' lm_head projection in fp32 (vLLM's head_dtype override) to shrink the mismatch.",
    )
