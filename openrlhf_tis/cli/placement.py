"""What a run's placement asks of its Ray cluster, compared with what the cluster has, before Ray places anything.

Upstream (OpenRLHF 0.11.2 `cli/train_ppo_ray.py`, `trainer/ray/launcher.py`, `trainer/ray/vllm_engine.py`) reserves
one `{"GPU": 1, "CPU": 1}` bundle per GPU of each model group and engine set, in placement groups it then waits for
with no time limit (`ray.get(pg.ready())`): on a cluster too small for them the driver waits forever, saying
nothing. Colocated groups share bundles: `--train.colocate_actor_ref` puts the reference model in the actor's,
`--train.colocate_all` (synchronous) the engines and every model too, `--train.colocate_critic_reward` the reward
model in the critic's. Each controller actor (one synchronous, three asynchronous) needs one CPU more to be
scheduled.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from openrlhf_tis.cli.cluster_device import ClusterResources
from openrlhf_tis.errors import UsageError


@dataclass(frozen=True)
class Placement:
    """The GPU bundles each part of a run reserves (0 for a part that shares another's), and its CPUs."""

    parts: tuple[tuple[str, str, int], ...]  # (part, the flags that size it, GPU bundles)
    controllers: int

    @property
    def gpus(self) -> int:
        return sum(n for _, _, n in self.parts)

    @property
    def cpus(self) -> int:
        return self.gpus + self.controllers

    def __str__(self) -> str:
        shown = ", ".join(f"{part} {n}" for part, _, n in self.parts if n)
        return f"{self.gpus} GPU slot(s) ({shown}) and {self.cpus} CPU(s)"

    @property
    def flags(self) -> str:
        return ", ".join(flags for _, flags, n in self.parts if n)


def _group(args: argparse.Namespace, role: str) -> int:
    return getattr(args, f"{role}.num_nodes") * getattr(args, f"{role}.num_gpus_per_node")


def placement(args: argparse.Namespace) -> Placement:
    """What upstream's train() will reserve for `args` (flat, dotted names as the CLI parses them)."""
    colocate_all = getattr(args, "train.colocate_all")
    asynchronous = getattr(args, "train.async_enable")
    shares_actor = colocate_all or getattr(args, "train.colocate_actor_ref")
    engines = (getattr(args, "vllm.num_engines") or 0) * getattr(args, "vllm.tensor_parallel_size")
    critic = _group(args, "critic") if getattr(args, "critic.model_name_or_path") else 0
    reward = 0 if getattr(args, "reward.remote_url") else _group(args, "reward")
    if colocate_all:
        critic = reward = 0
    elif critic and getattr(args, "train.colocate_critic_reward"):
        reward = 0
    parts = (
        ("actor", "--actor.num_nodes x --actor.num_gpus_per_node", _group(args, "actor")),
        ("reference", "--ref.num_nodes x --ref.num_gpus_per_node",
         _group(args, "ref") if getattr(args, "algo.kl.init_coef") > 0 and not shares_actor else 0),
        ("engines", "--vllm.num_engines x --vllm.tensor_parallel_size",
         0 if colocate_all and not asynchronous else engines),
        ("critic", "--critic.num_nodes x --critic.num_gpus_per_node", critic),
        ("reward model", "--reward.num_nodes x --reward.num_gpus_per_node", reward),
    )
    return Placement(parts, controllers=3 if asynchronous else 1)


def check_cluster_fits(args: argparse.Namespace, cluster: ClusterResources) -> None:
    """UsageError naming the flags that size the run and the cluster's figures when the cluster has fewer GPU slots
    or CPUs than the run's placement reserves (upstream would wait for them forever)."""
    need = placement(args)
    if need.gpus <= cluster.gpus and need.cpus <= cluster.cpus:
        return
    short = [f"{what} {have:g}" for what, have, wanted in (("GPU", cluster.gpus, need.gpus),
                                                           ("CPU", cluster.cpus, need.cpus)) if wanted > have]
    raise UsageError(need.flags, f"the run reserves {need}, but {cluster} has only {' and '.join(short)}: upstream "
                     "would wait for the rest forever; lower these, colocate (--train.colocate_all), or add nodes")
