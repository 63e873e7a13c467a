"""CPU patch: the trainer's end of the DeepSpeed -> vLLM weight sync goes through the fork's weight sync.

Upstream (OpenRLHF 0.11.2) builds the trainer's sync group with openrlhf/utils/distributed_util.py
`stateless_init_process_group`, always a vLLM PyNcclCommunicator whatever --vllm.sync_backend says; without NCCL
it disables itself, vLLM keeps uninitialised (NaN) weights and the run still exits 0. The engine's end has a seam
(vLLM's `worker_extension_cls`, the fork's rollout/weight_sync/receive.py); the trainer's has none (ppo_actor
builds the group and runs the broadcast loop inside ActorPPOTrainer). So, applied only in a CPU run, this patch:
- makes the trainer's sync group the gloo group the engines join (ppo_actor imports the function by name);
- makes ActorPPOTrainer.broadcast_to_vllm the fork's bucketed send (rollout/weight_sync/send.py), except under
  DeepSpeed tensor parallelism, which keeps upstream's per-parameter loop (the receive takes that too).
Every sync is verified end to end by the trainer's sync check (openrlhf_tis.trainer.sync_check).
"""

from __future__ import annotations

from openrlhf_tis.import_hooks import after_import
from openrlhf_tis.upstream_guards import replace, require_version, upstream_original

NAME = "cpu_weight_sync"
DEVICES = ("cpu",)  # the run's device, decided by its driver (patches/__init__.py)


def _patch_sync_group(module) -> None:
    from openrlhf_tis.rollout.weight_sync.group import gloo_sync_group

    replace(module, "stateless_init_process_group", gloo_sync_group, patch=NAME)


def _patch_trainer(module) -> None:
    replace(module.ActorPPOTrainer, "broadcast_to_vllm", _broadcast_to_vllm, patch=NAME)


def _broadcast_to_vllm(self) -> None:
    # DeepSpeed tensor parallelism gathers through its own layer wrappers: keep upstream's per-parameter loop.
    if self.strategy.args.ds.tensor_parallel_size > 1:
        from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer

        return upstream_original(ActorPPOTrainer, "broadcast_to_vllm")(self)
    from openrlhf_tis.rollout.weight_sync.send import broadcast_in_buckets

    return broadcast_in_buckets(self)


def apply() -> bool:
    require_version("openrlhf", "==0.11.2", patch=NAME)
    require_version("vllm", ">=0.32,<0.33", patch=NAME)
    # ppo_actor binds stateless_init_process_group by name; patching distributed_util right after it is
    # imported (before ppo_actor's from-import completes) covers the trainer's end. The engine's end is the
    # worker extension's init_process_group, which the fork's engine actor names on CPU (no patch).
    after_import("openrlhf.utils.distributed_util", _patch_sync_group)
    after_import("openrlhf.trainer.ray.ppo_actor", _patch_sync_group)
    after_import("openrlhf.trainer.ray.ppo_actor", _patch_trainer)
    return True
