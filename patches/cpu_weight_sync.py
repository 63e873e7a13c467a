"""CPU patch: the trainer's end of the DeepSpeed -> vLLM weight sync, without NCCL or CUDA.

Upstream (OpenRLHF 0.11.2) syncs weights by broadcasting each parameter over a group built by
openrlhf/utils/distributed_util.py:stateless_init_process_group, which is always a vLLM
PyNcclCommunicator whatever --vllm.sync_backend says. Without NCCL that communicator disables
itself and its broadcast does nothing: vLLM keeps uninitialised (NaN) weights and the run still
exits 0. The engine's end has a seam (vLLM's `worker_extension_cls`) and is the fork's own class,
openrlhf_tis.rollout.cpu_worker_extension.CPUWorkerExtension: a gloo group, CPU buffers, one reload
per sync. The trainer's end has none (ppo_actor builds the group and runs the broadcast loop inside
ActorPPOTrainer), so this patch, applied only in a CPU run:
- builds the trainer's sync group as the same gloo group (ppo_actor imports the function by name);
- replaces ActorPPOTrainer.broadcast_to_vllm with a few flat broadcasts of one dtype instead of one
  Ray call and one broadcast per parameter (DeepSpeed tensor parallelism keeps upstream's loop, which
  the extension's per-tensor `update_weight` receives).
Every sync is verified end to end by the trainer's sync check (openrlhf_tis.trainer.sync_check).
"""

from __future__ import annotations

import torch

from ._guard import replace, require_version, upstream_original
from ._import_hooks import after_import

NAME = "cpu_weight_sync"
DEVICES = ("cpu",)  # the run's device, decided by its driver (patches/__init__.py)
# One flat broadcast carries at most this much (the engine holds it until the sync's last bucket anyway).
BUCKET_BYTES = 512 << 20


def gloo_stateless_init_process_group(master_address, master_port, rank, world_size, device=None):
    """Drop-in for openrlhf.utils.distributed_util.stateless_init_process_group on CPU: the gloo group the
    fork's worker extension joins from the engine's side."""
    from openrlhf_tis.rollout.cpu_worker_extension import GlooBroadcastGroup

    return GlooBroadcastGroup(master_address, master_port, rank, world_size)


def sync_buckets(params: list[tuple[str, torch.dtype, int]], limit_bytes: int) -> list[list[int]]:
    """Group parameter indices into buckets of one dtype and at most `limit_bytes` (one oversized
    parameter gets a bucket of its own), keeping the parameters' order."""
    buckets: list[list[int]] = []
    size, dtype = 0, None
    for i, (_, param_dtype, numel) in enumerate(params):
        nbytes = numel * param_dtype.itemsize
        if not buckets or param_dtype != dtype or size + nbytes > limit_bytes:
            buckets.append([])
            size, dtype = 0, param_dtype
        buckets[-1].append(i)
        size += nbytes
    return buckets


def cpu_broadcast_to_vllm(self) -> None:
    """ActorPPOTrainer.broadcast_to_vllm on CPU: a few flat gloo broadcasts instead of one per parameter.

    Same contract as upstream's: rank 0 sends every synced parameter (ZeRO-3 parameters gathered
    first), prefix caches are reset, all ranks meet at a barrier.
    """
    import deepspeed
    import ray

    args = self.strategy.args
    rank0 = torch.distributed.get_rank() == 0
    resets = [e.reset_prefix_cache.remote() for e in self.vllm_engines] if rank0 and getattr(
        args.vllm, "enable_prefix_caching", False) else []
    zero3 = args.ds.zero_stage == 3
    is_vlm = getattr(self.actor, "is_vlm", False)
    params = [(n, p) for n, p in self.actor.model.module.named_parameters() if p.requires_grad or not is_vlm]
    meta = [(n, p.dtype, p.ds_numel if zero3 else p.numel()) for n, p in params]
    buckets = sync_buckets(meta, BUCKET_BYTES)
    for b, indices in enumerate(buckets):
        bucket = [params[i] for i in indices]
        with deepspeed.zero.GatheredParameters([p for _, p in bucket], enabled=zero3):
            if not rank0:
                continue
            names_shapes = [(n, tuple(p.ds_shape if zero3 else p.shape)) for n, p in bucket]
            flat = torch.cat([p.data.reshape(-1) for _, p in bucket])
            refs = [e.update_weights_bucket.remote(names_shapes, flat.dtype, b == len(buckets) - 1)
                    for e in self.vllm_engines]
            self._model_update_group.broadcast(flat, src=0)
            ray.get(refs)
    ray.get(resets)
    torch.distributed.barrier()


def _patch_sync_group(module) -> None:
    replace(module, "stateless_init_process_group", gloo_stateless_init_process_group, patch=NAME)


def _patch_trainer(module) -> None:
    replace(module.ActorPPOTrainer, "broadcast_to_vllm", _broadcast_to_vllm, patch=NAME)


def _broadcast_to_vllm(self) -> None:
    # DeepSpeed tensor parallelism gathers through its own layer wrappers: keep upstream's per-parameter
    # loop there (the fork's worker extension receives it through its per-tensor update_weight).
    if self.strategy.args.ds.tensor_parallel_size > 1:
        from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer

        return upstream_original(ActorPPOTrainer, "broadcast_to_vllm")(self)
    return cpu_broadcast_to_vllm(self)


def apply() -> bool:
    require_version("openrlhf", "==0.11.2", patch=NAME)
    require_version("vllm", ">=0.32,<0.33", patch=NAME)
    # ppo_actor binds stateless_init_process_group by name; patching distributed_util right after it is
    # imported (before ppo_actor's from-import completes) covers the trainer's end. The engine's end is
    # CPUWorkerExtension.init_process_group, which the fork's engine actor names on CPU (no patch).
    after_import("openrlhf.utils.distributed_util", _patch_sync_group)
    after_import("openrlhf.trainer.ray.ppo_actor", _patch_sync_group)
    after_import("openrlhf.trainer.ray.ppo_actor", _patch_trainer)
    return True
