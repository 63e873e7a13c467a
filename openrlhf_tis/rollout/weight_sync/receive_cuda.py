"""The engine's end of a CUDA weight sync into a quantized (block-FP8 or INT8) engine: upstream's receive, streamed
through vLLM's layer-wise reload.

Upstream's CUDA `WorkerWrap` receives each tensor (NCCL broadcast, Ray collective, or a CUDA IPC handle when
colocated) and loads it at once with `model.load_weights`, which for a serialized FP8 engine casts the bf16 values
into e4m3 parameters without a scale (vLLM 0.29's parameter loaders only check shapes): silently wrong weights.
This subclass keeps upstream's receive, whichever transport the run uses, and takes the tensor where upstream
hands it to `load_weights`: the sync's first tensor starts a layer-wise reload, each tensor is re-quantized and
loaded as it comes (layerwise.py: the engine holds the layers still arriving, not the model), and the sync's last
one (`empty_cache=True`, upstream's marker) finishes it. The fork's engine actor names this class for a CUDA run
whose engines are quantized (rollout/engine_actor.py).
"""

from __future__ import annotations

from collections.abc import Callable

from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap

from openrlhf_tis.rollout.weight_sync.layerwise import LayerwiseSync
from openrlhf_tis.upstream_guards import PatchTargetMissingError, require_version, swapped

_THIS_FILE = "openrlhf_tis/rollout/weight_sync/receive_cuda.py"  # named by the guards' errors: the file to review
_SYNC = "_openrlhf_tis_layerwise_sync"  # the sync in progress, on the worker instance (vLLM refuses class names)


class QuantizedCUDAWorkerExtension(WorkerWrap):
    """Upstream's CUDA receive, each tensor re-quantized and streamed into one layer-wise reload per sync."""

    def update_weight(self, name, dtype, shape, empty_cache=False) -> dict | None:
        return self._received(super().update_weight, (name, dtype, shape, empty_cache), empty_cache)

    def update_weight_cuda_ipc(self, name, dtype, shape, ipc_handles=None, empty_cache=False) -> dict | None:
        return self._received(super().update_weight_cuda_ipc, (name, dtype, shape, ipc_handles, empty_cache),
                              empty_cache)

    def _received(self, receive: Callable, args: tuple, last: bool) -> dict | None:
        """Run upstream's receive with its load streamed into this sync's reload; after the last tensor, finish
        the reload and return the re-quantization's statistics (requantize.py)."""
        model = self.model_runner.model
        sync = self.__dict__.get(_SYNC)
        if sync is None:  # a sync's first tensor: the upstream whose receive this intercepts, checked once a sync
            require_version("openrlhf", "==0.11.2", patch=_THIS_FILE)
            if not hasattr(model, "load_weights"):
                raise PatchTargetMissingError(f"patch {_THIS_FILE!r}: {type(model).__name__}.load_weights no longer "
                                              "exists upstream")
            sync = self.__dict__[_SYNC] = LayerwiseSync(self.model_runner, model.load_weights)
            sync.begin()
        calls = []

        def load(weights):
            calls.append(1)
            return sync.load(weights)

        try:
            with swapped(model, "load_weights", load, patch=_THIS_FILE):
                receive(*args)
            if not calls:  # upstream loaded it some other way: the reload would miss it
                raise PatchTargetMissingError(
                    f"patch {_THIS_FILE!r}: openrlhf's WorkerWrap.{receive.__name__} received a tensor without "
                    "loading it through model.load_weights; review the patch")
            return sync.finish() if last else None
        except BaseException:
            del self.__dict__[_SYNC]  # the next sync starts afresh
            raise
        finally:
            if last:
                self.__dict__.pop(_SYNC, None)
