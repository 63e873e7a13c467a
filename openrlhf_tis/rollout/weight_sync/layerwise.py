"""A sync into a quantized CUDA engine streamed through vLLM's layer-wise reload, a few layers at a time.

vLLM 0.29's `GPUModelRunner.reload_weights` is three steps: `initialize_layerwise_reload(model)` puts every layer
back on the meta device and wraps its parameters' weight loaders; `model.load_weights(weights)` then buffers each
layer's tensors and processes the layer (materialise, load, quantization post-processing, copy into the storage
the engine and its CUDA graphs point at) as soon as all of them arrived; `finalize_layerwise_reload(model,
model_config)` processes what is left. The reload takes weights as they come, so a sync need not hold the model:
each received tensor is re-quantized and handed to `load_weights` at once, and the engine holds only the layers
whose tensors are still arriving (one fused layer's q/k/v or gate/up when the trainer sends a layer's tensors
together, as upstream's parameter order does), besides the tensor being received.

A tensor-parallel rank still receives each tensor whole (upstream broadcasts unsharded parameters) and the
layer's buffered loader keeps the quantized whole until it cuts its shard, as vLLM's loaders must see it.

Between a sync's first and last tensor the engine's layers are mid-reload: a failed sync leaves the engine
unusable, which the run's sync check (every sync, for quantized rollouts) stops on.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from openrlhf_tis.rollout.weight_sync.reload import as_vllm_loads, refresh_after_reload
from openrlhf_tis.rollout.weight_sync.requantize import merged_stats, requantize_part, sync_record

Named = list[tuple[str, torch.Tensor]]


class LayerwiseSync:
    """One sync into the engine of `model_runner`: begin(), load() for each received part, finish()."""

    def __init__(self, model_runner, load_weights):
        """`load_weights`: the model's own `load_weights` (the receive swaps the model's for `load`)."""
        self.runner, self.load_weights = model_runner, load_weights
        self.stats: dict | None = None
        self.quantize_s = 0.0

    def begin(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        with as_vllm_loads(self.runner):
            initialize_layerwise_reload(self.runner.model)

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Re-quantize and load one received part (in place of `model.load_weights`, its signature)."""
        named = list(weights)
        t0 = time.perf_counter()
        part, stats = requantize_part(self.runner, named)
        self.quantize_s += time.perf_counter() - t0
        self.stats = merged_stats(self.stats, stats)
        with as_vllm_loads(self.runner):
            return self.load_weights(owned(part, named))

    def finish(self) -> dict | None:
        """Process what the loads left, refresh what the reload leaves stale; the sync's re-quantization record."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        with as_vllm_loads(self.runner):
            finalize_layerwise_reload(self.runner.model, self.runner.model_config)
        refresh_after_reload(self.runner.model)
        return None if self.stats is None else sync_record(self.runner, self.stats, self.quantize_s)


def owned(part: Named, received: Named) -> Named:
    """`part` with every tensor that is still a received one copied: a layer's loader keeps its tensors until the
    layer is complete, and a received tensor may be the trainer's memory (CUDA IPC), reused once the call returns.
    Quantized tensors are new already; a plain tensor already in the engine's dtype is the received one."""
    received_storage = {t.untyped_storage().data_ptr() for _, t in received}
    return [(n, t.clone() if t.untyped_storage().data_ptr() in received_storage else t) for n, t in part]
