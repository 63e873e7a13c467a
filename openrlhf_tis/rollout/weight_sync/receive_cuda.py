"""The engine's end of a CUDA weight sync: upstream's receive, each tensor taken where upstream hands it to
`load_weights`, converted to the engine's checkpoint layout, and loaded (re-quantized, for a quantized engine).

Upstream's CUDA `WorkerWrap` receives each tensor (NCCL broadcast, Ray collective, or a CUDA IPC handle when
colocated) under the trainer's parameter name and loads it at once with `model.load_weights`. Two things go wrong
there, and these subclasses keep upstream's receive, whichever transport the run uses, and fix them where the tensor
is loaded:
- **Layout.** transformers 5 holds some models' parameters under other names and shapes than their checkpoints
  (Mixtral's experts fused as `mlp.experts.gate_up_proj`), and vLLM 0.29's Mixtral loads only the checkpoint's
  per-expert tensors: the first sync would stop. Each tensor goes through the checkpoint layout first
  (checkpoint_layout.py `EngineLayout`: transformers' own reverse conversion of a meta-device skeleton of the model).
- **Quantization.** For a serialized FP8 or INT8 engine `load_weights` casts the bf16 values into the quantized
  parameters without a scale (vLLM 0.29's parameter loaders only check shapes): silently wrong weights. The sync's
  first tensor starts a layer-wise reload, each tensor is re-quantized and loaded as it comes (layerwise.py: the
  engine holds the layers still arriving, not the model), and the sync's last one (`empty_cache=True`, upstream's
  marker) finishes it.
The fork's engine actor names `QuantizedCUDAWorkerExtension` for a CUDA run whose engines are quantized and
`CUDAWorkerExtension` for one whose model converts (rollout/engine_actor.py); other CUDA runs keep upstream's class.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap

from openrlhf_tis.rollout.weight_sync.checkpoint_layout import EngineLayout
from openrlhf_tis.rollout.weight_sync.layerwise import LayerwiseSync
from openrlhf_tis.upstream_guards import PatchTargetMissingError, require_version, swapped

_THIS_FILE = "openrlhf_tis/rollout/weight_sync/receive_cuda.py"  # named by the guards' errors: the file to review
_SYNC = "_openrlhf_tis_sync"  # the sync in progress, on the worker instance (vLLM refuses class names)
_LAYOUT = "_openrlhf_tis_layout"  # the engine's checkpoint layout, built at the first tensor a sync loads


class _DirectSync:
    """A sync into an engine of plain weights: each tensor loaded as it comes, as upstream does."""

    def __init__(self, load_weights: Callable):
        self.load = load_weights

    def finish(self) -> None:
        return None


class CUDAWorkerExtension(WorkerWrap):
    """Upstream's CUDA receive, each tensor loaded in the engine's checkpoint layout."""

    def update_weight(self, name, dtype, shape, empty_cache=False) -> dict | None:
        return self._received(super().update_weight, (name, dtype, shape, empty_cache), empty_cache)

    def update_weight_cuda_ipc(self, name, dtype, shape, ipc_handles=None, empty_cache=False) -> dict | None:
        return self._received(super().update_weight_cuda_ipc, (name, dtype, shape, ipc_handles, empty_cache),
                              empty_cache)

    def _begin_sync(self, load_weights: Callable):
        """The sync that loads what this sync's tensors become (`load(weights)`, `finish()`)."""
        return _DirectSync(load_weights)

    def _in_checkpoint_layout(self, weights: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        layout = self.__dict__.get(_LAYOUT)
        if layout is None:
            layout = self.__dict__[_LAYOUT] = EngineLayout(self.model_runner.model_config.hf_config)
        return layout(weights)

    def _received(self, receive: Callable, args: tuple, last: bool) -> dict | None:
        """Run upstream's receive with its load converted and routed into this sync; after the last tensor, finish
        the sync and return what it recorded (the re-quantization's statistics, requantize.py; None for plain
        weights)."""
        model = self.model_runner.model
        sync = self.__dict__.get(_SYNC)
        if sync is None:  # a sync's first tensor: the upstream whose receive this intercepts, checked once a sync
            require_version("openrlhf", "==0.11.2", patch=_THIS_FILE)
            if not hasattr(model, "load_weights"):
                raise PatchTargetMissingError(f"patch {_THIS_FILE!r}: {type(model).__name__}.load_weights no longer "
                                              "exists upstream")
            sync = self.__dict__[_SYNC] = self._begin_sync(model.load_weights)
        calls = []

        def load(weights):
            calls.append(1)
            return sync.load(self._in_checkpoint_layout(weights))

        try:
            with swapped(model, "load_weights", load, patch=_THIS_FILE):
                receive(*args)
            if not calls:  # upstream loaded it some other way: the conversion and the reload would miss it
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


class QuantizedCUDAWorkerExtension(CUDAWorkerExtension):
    """Upstream's CUDA receive, each tensor in the checkpoint layout, re-quantized and streamed into one layer-wise
    reload per sync."""

    def _begin_sync(self, load_weights: Callable) -> LayerwiseSync:
        sync = LayerwiseSync(self.model_runner, load_weights)
        sync.begin()
        return sync
