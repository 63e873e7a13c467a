"""The engine's end of a CUDA weight sync into a quantized (block-FP8) engine: upstream's receive, one reload.

Upstream's CUDA `WorkerWrap` receives each tensor (NCCL broadcast, Ray collective, or a CUDA IPC handle when
colocated) and loads it at once with `model.load_weights`, which for a serialized FP8 engine casts the bf16 values
into e4m3 parameters without a scale (vLLM 0.29's parameter loaders only check shapes): silently wrong weights.
This subclass keeps upstream's receive, whichever transport the run uses, and takes the tensor where upstream
hands it to `load_weights`: each tensor is kept (a copy: an IPC tensor is the trainer's memory) until the sync's
last one (`empty_cache=True`, upstream's marker), then the whole set is re-quantized and loaded by one layer-wise
reload (reload.py), as on CPU. The buffer holds one bf16 copy of the model on the GPU during a sync. The fork's
engine actor names this class for a CUDA run whose engines are quantized (rollout/engine_actor.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap

from openrlhf_tis.rollout.weight_sync.reload import pending_weights, reload_if_last


@contextmanager
def loads_collected(model: torch.nn.Module, into: list[tuple[str, torch.Tensor]]) -> Iterator[None]:
    """Inside the block, `model.load_weights(weights)` keeps a copy of each (name, tensor) in `into` instead of
    loading it; the model's own method is back on exit (an instance attribute shadows the class's, then is gone)."""
    def collect(weights) -> None:
        into.extend((name, tensor.detach().clone()) for name, tensor in weights)

    model.load_weights = collect
    try:
        yield
    finally:
        del model.load_weights


class QuantizedCUDAWorkerExtension(WorkerWrap):
    """Upstream's CUDA receive, buffered until the sync's last tensor, then one re-quantizing reload."""

    def update_weight(self, name, dtype, shape, empty_cache=False) -> dict | None:
        return self._received(super().update_weight, (name, dtype, shape, empty_cache), empty_cache)

    def update_weight_cuda_ipc(self, name, dtype, shape, ipc_handles=None, empty_cache=False) -> dict | None:
        return self._received(super().update_weight_cuda_ipc, (name, dtype, shape, ipc_handles, empty_cache),
                              empty_cache)

    def _received(self, receive: Callable, args: tuple, last: bool) -> dict | None:
        """Run upstream's receive with its load collected; after the last tensor, reload them all and return the
        re-quantization's statistics (requantize.py)."""
        with loads_collected(self.model_runner.model, pending_weights(self)):
            receive(*args)
        return reload_if_last(self, last)
