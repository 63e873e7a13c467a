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

from openrlhf_tis.patches._guard import PatchTargetMissingError, require_version, swapped
from openrlhf_tis.rollout.weight_sync.reload import pending_weights, reload_if_last

_THIS_FILE = "openrlhf_tis/rollout/weight_sync/receive_cuda.py"  # named by the guards' errors: the file to review


@contextmanager
def loads_collected(model: torch.nn.Module, into: list[tuple[str, torch.Tensor]]) -> Iterator[None]:
    """Inside the block, `model.load_weights(weights)` keeps a copy of each (name, tensor) in `into` instead of
    loading it; the model's own method is back on exit, even on error (`_guard.swapped`: an instance attribute
    shadows the class's, then is gone). A model without `load_weights` is refused, naming this file."""
    def collect(weights) -> None:
        into.extend((name, tensor.detach().clone()) for name, tensor in weights)

    with swapped(model, "load_weights", collect, patch=_THIS_FILE):
        yield


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
        pending = pending_weights(self)
        if not pending:  # a sync's first tensor: the upstream whose receive this intercepts, checked once a sync
            require_version("openrlhf", "==0.11.2", patch=_THIS_FILE)
        before = len(pending)
        with loads_collected(self.model_runner.model, pending):
            receive(*args)
        if len(pending) == before:  # upstream loaded it some other way: the reload would miss it
            raise PatchTargetMissingError(
                f"patch {_THIS_FILE!r}: openrlhf's WorkerWrap.{receive.__name__} received a tensor without loading it "
                "through model.load_weights; review the patch")
        return reload_if_last(self, last)
