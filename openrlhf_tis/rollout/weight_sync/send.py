"""The trainer's end of a CPU weight sync: a few flat broadcasts of one dtype instead of one per parameter.

Upstream's `ActorPPOTrainer.broadcast_to_vllm` makes one Ray call and one broadcast per parameter (hundreds per
sync, each a round trip). Here rank 0 groups the synced parameters into buckets of one dtype and at most
`BUCKET_BYTES`, and each engine receives a bucket with one call (receive.py `update_weights_bucket`). The contract
is upstream's: rank 0 sends every synced parameter (ZeRO-3 parameters gathered first), prefix caches are reset,
all ranks meet at a barrier. Each parameter goes in its checkpoint's layout (checkpoint_layout.py: a transformers 5
Mixtral's fused experts as the per-expert tensors the engine loaded). patches/cpu_weight_sync.py puts this in place
of upstream's method on a CPU run.
"""

from __future__ import annotations

import torch

# One flat broadcast carries at most this much (the engine holds it until the sync's last bucket anyway).
BUCKET_BYTES = 512 << 20


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


def broadcast_in_buckets(trainer) -> None:
    """Send the trainer's synced parameters to every engine of `trainer` (upstream's `ActorPPOTrainer`)."""
    import deepspeed
    import ray

    from openrlhf_tis.rollout.weight_sync.checkpoint_layout import check_convertible, checkpoint_tensors

    args = trainer.strategy.args
    rank0 = torch.distributed.get_rank() == 0
    resets = [e.reset_prefix_cache.remote() for e in trainer.vllm_engines] if rank0 and getattr(
        args.vllm, "enable_prefix_caching", False) else []
    zero3 = args.ds.zero_stage == 3
    is_vlm = getattr(trainer.actor, "is_vlm", False)
    model = trainer.actor.model.module
    check_convertible(model)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad or not is_vlm]
    meta = [(n, p.dtype, p.ds_numel if zero3 else p.numel()) for n, p in params]
    buckets = sync_buckets(meta, BUCKET_BYTES)
    for b, indices in enumerate(buckets):
        bucket = [params[i] for i in indices]
        with deepspeed.zero.GatheredParameters([p for _, p in bucket], enabled=zero3):
            if not rank0:
                continue
            sent = checkpoint_tensors(model, [(n, p.data) for n, p in bucket])
            names_shapes = [(n, tuple(t.shape)) for n, t in sent]
            flat = torch.cat([t.reshape(-1) for _, t in sent])
            refs = [e.update_weights_bucket.remote(names_shapes, flat.dtype, b == len(buckets) - 1)
                    for e in trainer.vllm_engines]
            trainer._model_update_group.broadcast(flat, src=0)
            ray.get(refs)
    ray.get(resets)
    torch.distributed.barrier()
