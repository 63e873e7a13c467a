"""Whether a quantized CUDA sync's receive fits beside its engine: computed before Ray starts, where it can be.

An engine's GPU holds vLLM's share, `--vllm.gpu_memory_utilization` of the card (weights, activations, KV cache,
CUDA graphs); a sync's receive must fit in the rest. Streamed through the layer-wise reload
(weight_sync/layerwise.py), it holds at its peak about three copies of the largest tensor the trainer sends in bf16:
the received buffer, the copy the layer's loader keeps, and the layer vLLM materialises to process it (quantized
projections are held smaller, so the largest tensor, the embedding or the head for today's vocabularies, bounds it).

It can be computed where the card is one Ray names in `accelerator_type:*` with a known memory (nominal, from the
vendors' spec sheets; a name that covers several cards takes the smallest), the model is a local safetensors
directory, and the engines have their GPUs to themselves: colocated ones share theirs with DeepSpeed's states,
which are not modelled here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from openrlhf_tis.errors import UsageError

CARD_BYTES = {"H100": 80e9, "H200": 141e9, "H20": 96e9, "A100": 40e9, "A100-40G": 40e9, "A100-80G": 80e9,
              "L40S": 48e9, "L4": 24e9}
RECEIVE_COPIES = 3  # the received buffer, the loader's kept copy, the layer vLLM materialises to process
BF16_BYTES = 2


def receive_peak_bytes(largest_numel: int) -> int:
    """The most a streamed quantized sync holds on an engine's GPU beside vLLM's share."""
    return RECEIVE_COPIES * largest_numel * BF16_BYTES


def check_receive_fits(*, precision: str, colocated: bool, utilization: float, accelerators: Sequence[str],
                       largest_numel: int | None, cluster: str) -> None:
    """Refuse, naming the flags, quantized rollouts whose sync cannot fit beside the engine on the cluster's
    smallest known card; say nothing where it cannot be computed (see the module doc)."""
    if precision not in ("fp8", "int8") or colocated or largest_numel is None or not accelerators:
        return
    if any(name not in CARD_BYTES for name in accelerators):
        return
    card = min(CARD_BYTES[name] for name in accelerators)
    need, free = receive_peak_bytes(largest_numel), (1 - utilization) * card
    if need > free:
        highest = math.floor((1 - need / card) * 100) / 100
        raise UsageError("--vllm.gpu_memory_utilization",
                         f"{utilization:g} leaves {free / 1e9:.1f} GB of each {card / 1e9:g} GB card ({cluster}) "
                         f"beside its engine, and a --vllm.rollout_precision {precision} sync holds up to "
                         f"{need / 1e9:.1f} GB there ({RECEIVE_COPIES} x the model's largest tensor in bf16, "
                         f"{largest_numel} values): use --vllm.gpu_memory_utilization {highest:g} or lower, or bf16 "
                         "rollouts")
