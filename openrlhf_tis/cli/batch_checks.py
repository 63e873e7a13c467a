"""Batch sizes and sampling choices that upstream only asserts after Ray has started, refused here by flag.

The rules are upstream's own: the asserts in `openrlhf/cli/train_ppo_ray.py` (OpenRLHF 0.11.2, run after
the fork's checks) and DeepSpeed's `_batch_assertion` (train batch = micro batch x gradient accumulation
x data-parallel size), which fails inside every actor with a bare AssertionError.
"""

from __future__ import annotations

import argparse

from openrlhf_tis.errors import UsageError

# Estimators with a per-prompt-group baseline: with one sample per prompt every advantage is 0
# (upstream's assert, and experience_maker's group reshape).
GROUP_ESTIMATORS = ("rloo", "reinforce_baseline", "group_norm", "dr_grpo")

_POSITIVE = ("train.batch_size", "train.micro_batch_size", "rollout.batch_size", "rollout.micro_batch_size",
             "rollout.n_samples_per_prompt", "train.max_epochs", "train.num_episodes")


def data_parallel_size(args: argparse.Namespace) -> int:
    """Actor processes that train on different data (ring-attention and tensor-parallel peers share theirs)."""
    processes = getattr(args, "actor.num_nodes") * getattr(args, "actor.num_gpus_per_node")
    return max(processes // getattr(args, "ds.ring_attn_size") // getattr(args, "ds.tensor_parallel_size"), 1)


def check_batches(args: argparse.Namespace) -> None:
    def get(dest):
        return getattr(args, dest)

    for dest in _POSITIVE:
        if get(dest) < 1:
            raise UsageError(f"--{dest}", f"must be >= 1, got {get(dest)}")
    dp = data_parallel_size(args)
    train, micro = get("train.batch_size"), get("train.micro_batch_size")
    if not get("train.dynamic_batch_enable") and train % (micro * dp):
        raise UsageError("--train.batch_size", f"{train} is not a multiple of --train.micro_batch_size ({micro}) x "
                         f"{dp} data-parallel actor process(es) = {micro * dp} (DeepSpeed's gradient accumulation)")
    n = get("rollout.n_samples_per_prompt")
    samples = get("rollout.batch_size") * n
    if samples // get("rollout.micro_batch_size") < dp:
        raise UsageError("--rollout.micro_batch_size", f"{get('rollout.micro_batch_size')} leaves fewer than one "
                         f"micro batch per data-parallel actor process: --rollout.batch_size x "
                         f"--rollout.n_samples_per_prompt = {samples} samples for {dp} process(es)")
    if get("reward.nonfinite") == "drop" and samples - n < micro * dp:
        # screen_rewards (trainer/rewards.py) keeps whole prompt groups and needs a micro batch per actor.
        fits = [d for d in range(1, (samples - n) // dp + 1) if train % (d * dp) == 0]
        fix = f"lower --train.micro_batch_size to {fits[-1]}" if fits else "raise --rollout.batch_size"
        raise UsageError("--reward.nonfinite", f"drop could never train a step that loses a prompt group: the "
                         f"{samples - n} samples left of {samples} are fewer than --train.micro_batch_size "
                         f"({micro}) x {dp} data-parallel actor process(es); {fix}")
    estimator = get("algo.advantage.estimator")
    if estimator in GROUP_ESTIMATORS and n < 2:
        raise UsageError("--rollout.n_samples_per_prompt", f"{estimator} normalizes rewards within each prompt's "
                         "group of samples and needs at least 2 per prompt (with 1 every advantage is 0)")
    remote = get("reward.remote_url") or get("train.agent_func_path")
    if get("algo.dynamic_filtering_enable"):
        low, high = get("algo.dynamic_filtering_range")
        if not low < high:
            raise UsageError("--algo.dynamic_filtering_range", f"needs LOW < HIGH, got {low} {high}")
        if not remote:
            raise UsageError("--algo.dynamic_filtering_enable", "filters on rewards from --reward.remote_url or "
                             "--train.agent_func_path; give one")
        if n < 2:
            raise UsageError("--rollout.n_samples_per_prompt", "dynamic filtering averages each prompt's group of "
                             "samples and needs at least 2 per prompt")
    async_training = get("train.async_enable")
    generate = get("rollout.vllm_generate_batch_size")
    if generate is not None and generate > get("rollout.batch_size") and not async_training:
        raise UsageError("--rollout.vllm_generate_batch_size", f"{generate} > --rollout.batch_size "
                         f"{get('rollout.batch_size')} needs --train.async_enable (extra samples wait in its queue)")
    if get("train.partial_rollout_enable") and not async_training:
        raise UsageError("--train.partial_rollout_enable", "needs --train.async_enable")
    if get("eval.dataset") and not remote:
        raise UsageError("--eval.dataset", "evaluation scores answers with --reward.remote_url or "
                         "--train.agent_func_path; give one")
