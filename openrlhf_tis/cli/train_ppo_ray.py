"""`python -m openrlhf_tis.cli.train_ppo_ray`: upstream's train_ppo_ray with the fork wired in.

Every upstream flag works unchanged (upstream's own parser is reused, see patches/upstream_cli.py); the fork's
flags are added to it. Bad input ends here, naming the flag, before Ray starts.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

import ray
from ray.exceptions import RayError

from openrlhf_tis import patches
from openrlhf_tis.cli.actor_watch import ActorDeath, ActorWatch, death_in_error
from openrlhf_tis.cli.checks import (
    check_inputs,
    check_quantized_receive,
    explicit_dests,
    refuse_upstream_0110_flags,
)
from openrlhf_tis.cli.cluster_device import (
    DEVICE_DEST,
    ClusterResources,
    assumed_cluster,
    check_cuda_stack,
    check_driver_stack,
    decide_device,
    describe_decision,
    read_cluster,
    requested_device,
)
from openrlhf_tis.cli.fork_flags import add_fork_arguments
from openrlhf_tis.cli.lifetime import die_with_parent
from openrlhf_tis.cli.placement import check_cluster_fits
from openrlhf_tis.cli.ray_address import ADDRESS_VAR
from openrlhf_tis.cli.ray_cluster import CPU_ENV, RayStartError, start_ray
from openrlhf_tis.cli.resolve import apply_run_id, apply_spec, resolve
from openrlhf_tis.cli.rollout_engines import prepare_rollout_engines
from openrlhf_tis.cli.run_dir import RunFinished, interrupted_account, open_run_dir
from openrlhf_tis.cli.stall import DEST as STALL_DEST
from openrlhf_tis.cli.stall import Stall, StallCheck, kill_stalled_actors
from openrlhf_tis.errors import UsageError
from openrlhf_tis.patches import fork_classes
from openrlhf_tis.patches.upstream_cli import run_upstream_main, upstream_parser
from openrlhf_tis.run_device import DEVICE_ENV
from openrlhf_tis.run_spec import run_spec
from openrlhf_tis.runs.reader import last_logged_step
from openrlhf_tis.sigint import INTERRUPTED_EXIT, take_sigint
from openrlhf_tis.upstream_guards import UnsupportedUpstreamError

ACTOR_DIED_EXIT = 3  # an actor of the run died of an error (cli/actor_watch.py)
STALLED_EXIT = 4  # the controller made no progress within --train.stall_timeout_s (cli/stall.py)


def build_parser() -> argparse.ArgumentParser:
    """Upstream's parser plus the fork's flags (patches must be in place to import upstream)."""
    with quiet_deepspeed_import():
        parser = upstream_parser()
    parser.prog = "openrlhf_tis.cli.train_ppo_ray"
    add_fork_arguments(parser)
    return parser


@contextmanager
def quiet_deepspeed_import() -> Iterator[None]:
    """While upstream's CLI module is first imported (it imports DeepSpeed), keep DeepSpeed off the console of whoever
    checks flags (the main job, a sweep, a notebook kernel running one):

    - where there is no CUDA, name the CPU as its accelerator, as its own detection would, so it does not print
      "[WARNING] ... Setting accelerator to CPU";
    - its op probe compiles test programs with their stderr sent where `sys.stderr`'s file descriptor points; in a
      notebook kernel `sys.stderr` is not fd 2, which the compiler writes to (`ld: cannot find -laio`,
      `collect2: error`), so the process's own stderr stands in for it meanwhile.

    The environment and `sys.stderr` are left as they were."""
    import torch

    told = "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available()
    if told:
        os.environ["DS_ACCELERATOR"] = "cpu"
    kernel_stderr = sys.stderr
    if sys.__stderr__ is not None:
        sys.stderr = sys.__stderr__
    try:
        yield
    finally:
        sys.stderr = kernel_stderr
        if told:
            del os.environ["DS_ACCELERATOR"]


def parse_flags(parser: argparse.ArgumentParser, argv: list[str],
                cluster: ClusterResources) -> tuple[argparse.Namespace, list[str]]:
    """`argv` parsed by `parser` (build_parser) for a run on `cluster`, resolved once (cli/resolve.py: every check
    the flag values decide, no file read) and the run spec applied to the namespace. Returns the arguments and the
    console lines that say what the run computes on and what replaced upstream's GPU defaults; raises UsageError
    naming the flag at fault (argparse's own errors go to `parser.error`)."""
    refuse_upstream_0110_flags(argv)  # before argparse, which does not know them
    args = parser.parse_args(argv)
    if decide_device(getattr(args, DEVICE_DEST), cluster) == "cpu":
        go_offline()  # before a check imports huggingface_hub, which reads HF_HUB_OFFLINE once
    spec = resolve(args, explicit_dests(parser, argv), cluster)
    notes = [describe_decision(getattr(args, DEVICE_DEST), spec.cluster.device, cluster)]
    notes += [f"CPU run: --{dest} {getattr(args, dest)!r} -> {value!r}" for dest, value in spec.cluster.cpu_defaults]
    apply_spec(args, spec)
    return args, notes


def parse(argv: list[str], cpu: bool | None = None, cluster: ClusterResources | None = None,
          device_said: bool = False):
    """Parse, resolve and check the command line for the run's `cluster`; raises UsageError naming the flag at fault.

    Without `cluster`, `cpu` assumes a CPU (True) or CUDA (False) one, and None reads the cluster the run will use
    (cli/cluster_device.py read_cluster). `device_said`: the caller already printed the device decision's line.
    """
    if cluster is None:
        cluster = read_cluster() if cpu is None else assumed_cluster(cuda=not cpu)
    args, notes = parse_flags(build_parser(), argv, cluster)
    for note in notes[1:] if device_said else notes:
        say(note)
    spec = run_spec(args)
    if spec.cluster.device == "cuda" or os.environ.get(ADDRESS_VAR):  # a local CPU run declares its own slots
        check_cluster_fits(args, cluster)
    planned = check_inputs(args, spec)
    check_quantized_receive(args, spec, cluster.accelerators, str(cluster))
    apply_run_id(args, open_run_dir(args, planned_steps=planned))
    return args


def say(line: str) -> None:
    """One console line of the driver's (stderr, as upstream's own logging)."""
    print(f"[openrlhf_tis] {line}", file=sys.stderr)


def go_offline() -> None:
    """Every process of a CPU run is offline (ray_cluster.CPU_ENV): the driver too, so hub model ids are judged the
    same way."""
    os.environ.setdefault("HF_HUB_OFFLINE", CPU_ENV["HF_HUB_OFFLINE"])


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    take_sigint()
    die_with_parent()
    try:
        check_driver_stack()  # before the cluster is joined: without vLLM the parser cannot even be built
        cluster = read_cluster()
        requested = requested_device(argv)
        device = decide_device(requested, cluster)
        say(describe_decision(requested, device, cluster))  # first: every later refusal reads in its light
        if device == "cuda":
            check_cuda_stack()
        # Offline before the patches import huggingface_hub, which reads HF_HUB_OFFLINE once.
        if device == "cpu":
            go_offline()
        enter_run(device)
        args = parse(argv, cluster=cluster, device_said=True)
        fork_classes.apply()
        prepare_rollout_engines(args, run_spec(args).rollout)
        start_ray(args, device)
    except RunFinished as done:  # a resume of a finished run: said at once, not after Ray, vLLM and DeepSpeed start
        print(f"openrlhf_tis.cli.train_ppo_ray: nothing to do: {done}", file=sys.stderr)
        raise SystemExit(0) from None
    except (UsageError, UnsupportedUpstreamError) as err:
        print(f"openrlhf_tis.cli.train_ppo_ray: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except RayStartError as err:  # not the user's input: the machine's load
        print(f"openrlhf_tis.cli.train_ppo_ray: error: {err}", file=sys.stderr)
        raise SystemExit(1) from None
    # upstream waits on its actors without a time limit, even on dead or stopped ones
    bound = getattr(args, STALL_DEST)
    watch = ActorWatch(stall_check=StallCheck(bound) if bound > 0 else None).start()
    try:
        run_upstream_main(args)
    except KeyboardInterrupt:
        watch.stop()
        if watch.woke_main and watch.death is not None:
            stop_after_actor_death(args, watch.death)
        if watch.woke_main:
            stop_after_stall(args, watch.stalled)
        stop_after_interrupt(args)
    except RayError as err:  # upstream's ray.get saw a death before the watch did, or one the watch leaves alone
        watch.stop()
        death = watch.recorded_failure() or death_in_error(err)
        if death is None:
            raise
        stop_after_actor_death(args, death)
    finally:
        watch.stop()
    check_steps_logged(getattr(args, "logger.run_dir"))


def stop_after_interrupt(args: argparse.Namespace) -> NoReturn:
    """Ctrl-C during training: the run ended (end_run) with the shell's code for SIGINT."""
    end_run(args, "interrupted: ", INTERRUPTED_EXIT)


def stop_after_actor_death(args: argparse.Namespace, death: ActorDeath) -> NoReturn:
    """An actor of the run died of an error (cli/actor_watch.py): the run ended (end_run) naming it, instead of
    upstream waiting for it for ever."""
    end_run(args, f"error: {death}; ", ACTOR_DIED_EXIT)


def stop_after_stall(args: argparse.Namespace, stall: Stall) -> NoReturn:
    """The controller made no progress within --train.stall_timeout_s (cli/stall.py): the run ended (end_run) naming
    the stage and the actors it waited on, which are killed first (a stopped process outlives Ray's shutdown)."""
    kill_stalled_actors(stall)
    end_run(args, f"error: {stall}; ", STALLED_EXIT)


def end_run(args: argparse.Namespace, why: str, code: int) -> NoReturn:
    """Ray shut down (its actors end, so nothing more is logged), then one line: `why`, then what was kept and how to
    go on; exit `code`. A Ctrl-C does not cut the shutdown short."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ray.shutdown()
    account = interrupted_account(Path(getattr(args, "logger.run_dir")), getattr(args, "ckpt.path"))
    print(f"openrlhf_tis.cli.train_ppo_ray: {why}{account}", file=sys.stderr)
    raise SystemExit(code)


def enter_run(device: str) -> list[str]:
    """Make this driver process part of a `device` run: the decision in its environment (inherited by whatever it
    starts, and put in every Ray worker's by start_ray) and the platform patches of that device, before upstream is
    imported. Returns the patches applied now."""
    os.environ[DEVICE_ENV] = device
    return patches.apply_platform_patches(device)


def check_steps_logged(run_dir: str) -> None:
    """A run that trained no step must not end like one that did (exit 0, a saved "final" model)."""
    if last_logged_step(run_dir) is None:
        print(f"openrlhf_tis.cli.train_ppo_ray: error: the run logged no training step in {run_dir}/metrics.jsonl "
              "(no prompt batch reached the trainer: check --data.prompt_dataset, --data.max_samples and the batch "
              "sizes)", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
