"""The routed experts a CUDA engine returns with a finished request (vLLM 0.29.0), shaped as the CPU capture's take.

With `enable_return_routed_experts=True` (a `ModelConfig` field in vLLM 0.29.0) vLLM's GPU worker binds a capturer to
every MoE router, the scheduler files each step's top-k ids under the KV-cache slots of the tokens that step ran,
and a finished request's `CompletionOutput.routed_experts` is the concatenation the scheduler emitted for it
(vLLM 0.29.0 `v1/core/sched/scheduler.py`, `v1/engine/output_processor.py`):

    rows 0 .. P-1        the prompt, read from the slot buffer when prefill completes: prompt tokens served from
                         the prefix cache come back with the routing of the forward that computed their block
    rows P .. P+N-2      each sampled token but the last, as the step that fed it to the model routed it
    the last sampled token is never fed to the model: no row

a uint8 array (uint16 above 256 experts) of (P + N - 1, num_hidden_layers, top_k), one per request whatever the
tensor parallelism (the scheduler reads the driver worker's output; the ranks route the same tokens alike). A
decoder layer without experts keeps the capture buffer's initial 0, a valid expert index.

`take_routing` turns it into what the CPU capture's `take_routed_experts` hands the rollout
(rollout/routing_capture.py): int16 (P + N, layers, k), NO_ROUTE on the last token and in the layers without
experts, so the samples' path from moe/routing_batch.py on is the same on both devices.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from openrlhf_tis.moe.routing_metrics import NO_ROUTE
from openrlhf_tis.rollout.routing_capture import ROUTED_DTYPE


def take_routing(routed_experts: np.ndarray | None, *, prompt_tokens: int, response_tokens: int, num_layers: int,
                 moe_layers: Sequence[int]) -> np.ndarray:
    """A request's routing as (prompt + response tokens, num_layers, k) int16, NO_ROUTE where the engine routed
    nothing, from the `CompletionOutput.routed_experts` vLLM 0.29.0 returned for it.

    Refused (RuntimeError): no array (the engine was started without `enable_return_routed_experts`, or the
    request did not finish), another shape than (P + N - 1, num_layers, k), expert indices beyond int16.
    """
    if routed_experts is None:
        raise RuntimeError("routing replay: the engine returned no routed experts with a finished request (was it "
                           "started with enable_return_routed_experts=True?)")
    routed = np.asarray(routed_experts)
    expected = prompt_tokens + response_tokens - 1
    if routed.ndim != 3 or routed.shape[0] != expected or routed.shape[1] != num_layers:
        raise RuntimeError(f"routing replay: the engine returned routed experts of shape {routed.shape} for a request "
                           f"of {prompt_tokens} prompt and {response_tokens} sampled tokens; expected ({expected}, "
                           f"{num_layers}, top-k): every token but the last, every decoder layer")
    if routed.size and int(routed.max()) > np.iinfo(ROUTED_DTYPE).max:
        raise RuntimeError(f"routing replay: expert index {int(routed.max())} does not fit {np.dtype(ROUTED_DTYPE)}")
    out = np.full((expected + 1, num_layers, routed.shape[2]), NO_ROUTE, dtype=ROUTED_DTYPE)
    out[:expected] = routed
    dense = np.setdiff1d(np.arange(num_layers), np.asarray(moe_layers, dtype=np.int64))
    out[:, dense] = NO_ROUTE
    return out
