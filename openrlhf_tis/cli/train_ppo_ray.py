"""`python -m openrlhf_tis.cli.train_ppo_ray`: upstream's train_ppo_ray with the fork wired in.

Every upstream flag works unchanged (upstream's own parser is reused, see patches/upstream_cli.py); the fork's
flags are added to it. Bad input ends here, naming the flag, before Ray starts.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from openrlhf_tis import patches
from openrlhf_tis.cli.checks import adapt_to_cpu, check_inputs, explicit_dests
from openrlhf_tis.cli.cluster_device import (
    DEVICE_DEST,
    RESOURCES_DEST,
    ClusterResources,
    assumed_cluster,
    decide_device,
    describe_decision,
    read_cluster,
)
from openrlhf_tis.cli.fork_flags import add_fork_arguments
from openrlhf_tis.cli.lifetime import die_with_parent
from openrlhf_tis.cli.ray_cluster import CPU_ENV, start_ray
from openrlhf_tis.cli.rollout_engines import prepare_rollout_engines
from openrlhf_tis.cli.run_dir import open_run_dir
from openrlhf_tis.errors import UsageError
from openrlhf_tis.patches import fork_classes
from openrlhf_tis.patches._guard import UnsupportedUpstreamError
from openrlhf_tis.patches.upstream_cli import run_upstream_main, upstream_parser
from openrlhf_tis.runs.reader import last_logged_step


def build_parser():
    """Upstream's parser plus the fork's flags (patches must be in place to import upstream)."""
    parser = upstream_parser()
    parser.prog = "openrlhf_tis.cli.train_ppo_ray"
    add_fork_arguments(parser)
    return parser


def parse(argv: list[str], cpu: bool | None = None, cluster: ClusterResources | None = None):
    """Parse and check the command line for the run's `cluster`; raises UsageError naming the flag at fault.

    Without `cluster`, `cpu` assumes a CPU (True) or CUDA (False) one, and None reads the cluster the run will use
    (cli/cluster_device.py read_cluster).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if cluster is None:
        cluster = read_cluster() if cpu is None else assumed_cluster(cuda=not cpu)
    if settle_device(args, cluster) == "cpu":
        go_offline()
        for note in adapt_to_cpu(args, explicit_dests(parser, argv), str(cluster)):
            print(f"[openrlhf_tis] CPU run: {note}", file=sys.stderr)
    run_dir = getattr(args, "logger.run_dir") or time.strftime("runs/%Y%m%d-%H%M%S", time.gmtime())
    setattr(args, "logger.run_dir", os.path.abspath(run_dir))  # every Ray process writes to the same place
    planned = check_inputs(args)
    open_run_dir(args, planned_steps=planned)
    return args


def settle_device(args: argparse.Namespace, cluster: ClusterResources) -> str:
    """Replace `--cluster.device` in `args` by the device `cluster` decides (cpu or cuda), record the cluster
    beside it, say both on the console; returns the device."""
    requested = getattr(args, DEVICE_DEST)
    device = decide_device(requested, cluster)
    setattr(args, DEVICE_DEST, device)
    setattr(args, RESOURCES_DEST, str(cluster))
    print(f"[openrlhf_tis] {describe_decision(requested, device, cluster)}", file=sys.stderr)
    return device


def go_offline() -> None:
    """Every process of a CPU run is offline (ray_cluster.CPU_ENV): the driver too, so hub model ids are judged the
    same way."""
    os.environ.setdefault("HF_HUB_OFFLINE", CPU_ENV["HF_HUB_OFFLINE"])


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    die_with_parent()
    try:
        cluster = read_cluster()
        # No GPU: a CPU run (or a refused one). Offline before the patches import huggingface_hub, which reads
        # HF_HUB_OFFLINE once; parse() sets it too, for a CPU run on logical GPU slots.
        if cluster.gpus <= 0:
            go_offline()
        patches.apply_platform_patches()
        args = parse(argv, cluster=cluster)
        fork_classes.apply()
        prepare_rollout_engines(args)
        start_ray(args, cpu=getattr(args, DEVICE_DEST) == "cpu")
    except (UsageError, UnsupportedUpstreamError) as err:
        print(f"openrlhf_tis.cli.train_ppo_ray: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    run_upstream_main(args)
    check_steps_logged(getattr(args, "logger.run_dir"))


def check_steps_logged(run_dir: str) -> None:
    """A run that trained no step must not end like one that did (exit 0, a saved "final" model)."""
    if last_logged_step(run_dir) is None:
        print(f"openrlhf_tis.cli.train_ppo_ray: error: the run logged no training step in {run_dir}/metrics.jsonl "
              "(no prompt batch reached the trainer: check --data.prompt_dataset, --data.max_samples and the batch "
              "sizes)", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
