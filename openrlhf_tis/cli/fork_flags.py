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
