"""The run resolved once, on the driver: the command line's flags and the cluster in, one frozen RunSpec out.

`resolve` decides (the device, upstream's defaults a CPU run replaces, the correction, the rollout plan, the sync
and the dumps) and runs the checks, which only check; `apply_spec` is the one place the fork writes into upstream's
namespace, so what upstream and every actor see follows from the spec (openrlhf_tis/spec/run_spec.py).
"""

from __future__ import annotations

import argparse

from openrlhf_tis.cli.checks import check_flags, cpu_replacements, resolve_correction
from openrlhf_tis.cli.cluster_device import DEVICE_DEST, ClusterResources, decide_device
from openrlhf_tis.rollout.precision import rollout_plan
from openrlhf_tis.spec import SPEC_DEST, ClusterPlan, DumpPlan, RunSpec, SyncPlan

# Upstream asks vLLM for the rollout log-probs only when its own correction level is not off; the mismatch metrics
# need them every step, whatever the loss, so a run whose correction came from the fork's flags sets upstream's to a
# level upstream accepts and that collects them. Upstream's PolicyLoss, which would read it, is replaced by the
# fork's (trainer/policy_loss.py), which reads only the spec's correction.
COLLECT_ROLLOUT_LOG_PROBS = {
    "algo.advantage.is_correction_level": "token",
    "algo.advantage.is_correction_mode": "mask",
    "algo.advantage.is_correction_gating": "ratio",
    "algo.advantage.is_correction_threshold": [0.0, 1.0e9],  # finite: configs go to JSON
}


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
        sync=SyncPlan(every=getattr(run, "vllm.sync_every"), check_steps=getattr(run, "vllm.sync_check_steps"),
                      check_tolerance=getattr(run, "vllm.sync_check_tolerance")),
        dumps=DumpPlan(steps=getattr(run, "logger.token_dump_steps"),
                       samples=getattr(run, "logger.token_dump_samples")),
    )


def apply_spec(args: argparse.Namespace, spec: RunSpec) -> None:
    """Write `spec` into upstream's namespace: the CPU replacements, upstream's flags that make vLLM return log-probs
    (when its own correction flags were not given), and the spec itself at `fork.spec`, which Ray hands to every
    actor and the run store records in config.json."""
    for dest, value in spec.cluster.cpu_defaults:
        setattr(args, dest, value)
    if getattr(args, "algo.advantage.is_correction_level") == "off" and getattr(args, "vllm.num_engines"):
        for dest, value in COLLECT_ROLLOUT_LOG_PROBS.items():
            setattr(args, dest, value)
    setattr(args, SPEC_DEST, spec)
