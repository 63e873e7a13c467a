"""The run resolved once, on the driver: the command line's flags and the cluster in, one frozen RunSpec out.

Every decision lives here: `resolve` decides (the device, upstream's defaults a CPU run replaces:
`cpu_replacements`, the correction: `resolve_correction`, the rollout plan, the sync, the dumps, the reward's limits
and the staleness bound) and runs the
checks of cli/checks.py, which only check. This module is the one place the fork writes into upstream's namespace:
`apply_spec`, so what upstream and every actor see follows from the spec (openrlhf_tis/run_spec/plans.py), and
`apply_run_id`, the run directory's identity once it is opened.

On a CPU cluster (cli/cluster_device.py), upstream's GPU *defaults* are replaced by choices that run there
(docs/design.md §5) unless the user set the flag; a GPU-only choice the user did make is refused. On a CUDA cluster,
the CPU-only choices are refused (rollout/precision.py check_cuda_weight_sync).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from openrlhf_tis.cli.checks import check_flags
from openrlhf_tis.cli.cluster_device import DEVICE_DEST, ClusterResources, decide_device
from openrlhf_tis.correction.config import CorrectionConfig
from openrlhf_tis.errors import UsageError
from openrlhf_tis.flags import plan_from_flags
from openrlhf_tis.rollout.precision import rollout_plan
from openrlhf_tis.run_spec import SPEC_DEST, ClusterPlan, DumpPlan, RewardPlan, RunSpec, StalenessPlan, SyncPlan

# Upstream asks vLLM for the rollout log-probs only when its own correction level is not off; the mismatch metrics
# need them every step, whatever the loss, so a run whose correction came from the fork's flags sets upstream's to a
# level upstream accepts and that collects them. Upstream's PolicyLoss, which would read it, is replaced by the
# fork's (trainer/policy_loss.py), which reads only the spec's correction.
RUN_DIR_DEST = "logger.run_dir"
RUN_ID_DEST = "logger.run_id"

COLLECT_ROLLOUT_LOG_PROBS = {
    "algo.advantage.is_correction_level": "token",
    "algo.advantage.is_correction_mode": "mask",
    "algo.advantage.is_correction_gating": "ratio",
    "algo.advantage.is_correction_threshold": [0.0, 1.0e9],  # finite: configs go to JSON
}


# Upstream defaults that cannot run without CUDA, and what replaces them there.
CPU_DEFAULTS = {
    "ds.attn_implementation": "sdpa",
    "vllm.sync_backend": "gloo",
    "vllm.enforce_eager": True,
    "actor.num_gpus_per_node": 1,
    "ref.num_gpus_per_node": 1,
    "critic.num_gpus_per_node": 1,
    "reward.num_gpus_per_node": 1,
}


@dataclass(frozen=True)
class _GpuOnly:
    dest: str
    refused: object  # a predicate on the value
    why: str


GPU_ONLY = (
    _GpuOnly("ds.param_dtype", lambda v: v == "fp16", "fp16 training needs CUDA; use bf16 or fp32"),
    _GpuOnly("ds.attn_implementation", lambda v: "flash" in str(v), "flash attention needs CUDA; use sdpa or eager"),
    _GpuOnly("vllm.sync_backend", lambda v: v == "nccl", "NCCL needs CUDA; the CPU weight sync uses gloo"),
    _GpuOnly("vllm.sync_with_ray", bool, "Ray's collective gloo group cannot run beside DeepSpeed here"),
    _GpuOnly("vllm.enable_sleep", bool, "vLLM-CPU has no sleep mode (vLLM offers it on CUDA, ROCm and XPU only)"),
    _GpuOnly("vllm.tensor_parallel_size", lambda v: v > 1, "vLLM tensor parallelism is not supported on CPU"),
    _GpuOnly("train.colocate_all", bool, "colocation syncs weights through CUDA IPC"),
    _GpuOnly("ds.packing_samples", bool, "sample packing needs flash attention's varlen kernels"),
    _GpuOnly("ds.ring_attn_size", lambda v: v > 1, "ring attention needs flash attention"),
    _GpuOnly("ds.load_in_4bit", bool, "4-bit loading needs bitsandbytes' CUDA kernels"),
    _GpuOnly("ds.use_liger_kernel", bool, "Liger kernels are Triton GPU kernels"),
)


def cpu_replacements(args: argparse.Namespace, explicit: set[str], cluster: str = "a CPU cluster") -> dict[str, Any]:
    """Upstream's GPU defaults a CPU run replaces, {dest: CPU value} for those not already so; explicit GPU-only
    choices refused (naming `cluster`, the run's resources). Changes nothing: the run spec carries the replacements."""
    for rule in GPU_ONLY:
        value = getattr(args, rule.dest)
        if rule.refused(value):
            if rule.dest in explicit:
                raise UsageError(f"--{rule.dest}", f"{value!r} needs CUDA, and this is a CPU run on {cluster}: "
                                 f"{rule.why}")
            if rule.dest not in CPU_DEFAULTS:
                raise UsageError(f"--{rule.dest}", f"default {value!r} needs CUDA, and this is a CPU run on "
                                 f"{cluster}: {rule.why}")
    return {dest: cpu_value for dest, cpu_value in CPU_DEFAULTS.items()
            if dest not in explicit and getattr(args, dest) != cpu_value}


def resolve(args: argparse.Namespace, explicit: set[str], cluster: ClusterResources) -> RunSpec:
    """The run `args` asks for on `cluster` (`explicit`: the dests the command line set, checks.explicit_dests),
    every check the flag values decide passed first; raises UsageError naming the flag at fault. Reads no file and
    changes nothing in `args`."""
    device = decide_device(getattr(args, DEVICE_DEST), cluster)
    replaced = cpu_replacements(args, explicit, str(cluster)) if device == "cpu" else {}
    run = argparse.Namespace(**{**vars(args), **replaced})  # the flags as the run will hold them
    cuda = device == "cuda"
    check_flags(run, cuda=cuda, cluster=str(cluster))
    return RunSpec(
        cluster=ClusterPlan(device, str(cluster), tuple(replaced.items())),
        correction=resolve_correction(run),
        rollout=rollout_plan(run, cuda=cuda),
        sync=plan_from_flags(SyncPlan, run),
        dumps=plan_from_flags(DumpPlan, run),
        reward=plan_from_flags(RewardPlan, run),
        staleness=plan_from_flags(StalenessPlan, run),
        run_dir=os.path.abspath(getattr(run, "logger.run_dir") or time.strftime("runs/%Y%m%d-%H%M%S", time.gmtime())),
    )


def apply_spec(args: argparse.Namespace, spec: RunSpec) -> None:
    """Write `spec` into upstream's namespace: the CPU replacements, upstream's flags that make vLLM return log-probs
    (when its own correction flags were not given), the run directory, and the spec itself at `fork.spec`, which Ray
    hands to every actor and the run store records in config.json."""
    for dest, value in spec.cluster.cpu_defaults:
        setattr(args, dest, value)
    if getattr(args, "algo.advantage.is_correction_level") == "off" and getattr(args, "vllm.num_engines"):
        for dest, value in COLLECT_ROLLOUT_LOG_PROBS.items():
            setattr(args, dest, value)
    if spec.run_dir is not None:
        setattr(args, RUN_DIR_DEST, spec.run_dir)
    setattr(args, SPEC_DEST, spec)


def apply_run_id(args: argparse.Namespace, run_id: str | None) -> None:
    """Write the opened run directory's history id (cli/run_dir.py open_run_dir, from config.json) into upstream's
    namespace, for the actors to stamp on every checkpoint they save (trainer/ppo_actor.py). Not a flag, and not
    the spec's: it is known only once the directory is opened, after config.json recorded the applied spec."""
    setattr(args, RUN_ID_DEST, run_id)


def resolve_correction(args: argparse.Namespace) -> CorrectionConfig:
    """The rollout correction the flags ask for, as one CorrectionConfig (the run spec's; cli/resolve.py).

    Sources, in order: upstream's --algo.advantage.is_correction_* flags (mapped onto the equivalent
    config) or --algo.correction.preset, then every --algo.correction.<field> given. Refused: both
    sources at once, invalid or impossible bounds, a field given where the resolved config never reads it
    (CorrectionConfig.without_effect), a correction without vLLM rollouts, top-p sampling (vLLM's processed
    log-probs are renormalized over the nucleus, the trainer's are not), and under GSPO any per-token correction
    (its ratio is one per sequence: `validate_for_sequence_ratio`).

    Changes nothing in `args` (`apply_spec` sets what upstream must see).
    """
    from openrlhf_tis.correction import CorrectionConfigError, from_upstream, preset

    fields = [f.name for f in dataclasses.fields(CorrectionConfig)]  # one --algo.correction.<field> flag each

    def get(dest):
        return getattr(args, dest)

    up_level = get("algo.advantage.is_correction_level")
    name = get("algo.correction.preset")
    loss_type = get("actor.policy_loss_type")
    overrides: dict = {}
    try:
        if up_level != "off":
            if name is not None:
                raise UsageError("--algo.correction.preset", f"conflicts with --algo.advantage.is_correction_level "
                                 f"{up_level}; give upstream's flags or a preset, not both")
            cfg = from_upstream(up_level, get("algo.advantage.is_correction_mode"),
                                get("algo.advantage.is_correction_gating"),
                                get("algo.advantage.is_correction_threshold"), policy_loss_type=loss_type)
        else:
            cfg = preset(name or "off")
        overrides = {f: get(f"algo.correction.{f}") for f in fields
                     if get(f"algo.correction.{f}") is not None}
        if "rejection" in overrides:
            overrides["rejection"] = tuple(overrides["rejection"])
        cfg = cfg.replace(**overrides).validate(training=True)
        if unread := cfg.without_effect(overrides):  # a value given for nothing is a mistake: name the first
            unused, why = next(iter(unread.items()))
            raise UsageError(f"--algo.correction.{unused}", f"has no effect here: {why}")
    except CorrectionConfigError as err:
        flag = err.flag
        if up_level != "off" and not overrides and flag.startswith("--algo.correction."):
            flag = "--algo.advantage.is_correction_threshold"  # the bounds came from upstream's flags
        raise UsageError(flag, err.message) from None
    if loss_type == "gspo":
        try:
            cfg.validate_for_sequence_ratio()
        except CorrectionConfigError as err:
            if name is None or err.flag.removeprefix("--algo.correction.") in overrides:
                raise UsageError(err.flag, err.message) from None
            raise UsageError("--algo.correction.preset", f"{name} sets {err.flag}: {err.message}") from None

    engines = get("vllm.num_engines") or 0
    if cfg.enabled and engines < 1:
        raise UsageError("--vllm.num_engines", "the rollout correction needs vLLM's rollout log-probs; "
                         "start at least one engine or use --algo.correction.preset off")
    top_p = get("rollout.top_p")
    if top_p < 1.0:
        why = ("vLLM's processed log-probs are renormalized over the top-p nucleus and the trainer's are not, "
               "so every ratio π_old/μ would be biased below 1")
        if cfg.enabled:
            raise UsageError("--rollout.top_p", f"{top_p} < 1 with the rollout correction on: {why}")
        print(f"[openrlhf_tis] warning: --rollout.top_p {top_p}: mismatch metrics are biased ({why})",
              file=sys.stderr)
    return cfg
