"""Rollout routing replay (R3) in the trainer's transformers MoE blocks.

An MoE layer's router picks each token's top-k experts from its logits; the engine and the trainer compute those
logits with different kernels, and where two logits nearly tie they pick different experts: a different function,
not a rounding error. Replay makes the trainer's forward use the experts the engine chose. Only the choice is
replayed: the gating weights are the trainer's own router probabilities at the replayed experts, renormalised the
way the architecture renormalises its own top-k, so the router still receives its gradient (the method of "Stabilizing
MoE Reinforcement Learning by Aligning Training and Inference Routers", arXiv 2510.11370).

Each covered router of the live model is re-classed (`upstream_guards.reclass`) to a subclass whose `forward`
runs upstream's own routing first, records its top-k (what the trainer would have chosen: the routing-mismatch
metrics need it with replay on) and, inside `replaying`, swaps in the replayed experts. Outside `replaying` the
subclass returns upstream's result untouched.

The layer axis of a routing is the decoder layer index (`model.layers.<i>`), as vLLM's routed-experts capture
writes it; slots of layers without experts (Qwen3-MoE's `mlp_only_layers`) are ignored and recorded as -1.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from openrlhf_tis.errors import UsageError
from openrlhf_tis.moe.coverage import REPLAY_FLAG, replay_refusal
from openrlhf_tis.moe.routing_metrics import NO_ROUTE
from openrlhf_tis.upstream_guards import reclass

_THIS_FILE = "openrlhf_tis/moe/routing_replay.py"
TRANSFORMERS_SUPPORTED = ">=5.19,<5.20"
"""The transformers release whose routers (their softmax, top-k, renormalisation and cast) this file was read in."""

_STATE = "_openrlhf_tis_routes"
"""The fork's attribute on a re-classed router: its _RouterRoutes while `replaying` runs, else absent."""


@dataclass
class _RouterRoutes:
    """One router's part of a replay: the experts to use (None: record only) and the trainer's own last choice."""

    replayed: torch.Tensor | None
    own: torch.Tensor | None = None


class _ReplayingRouter:
    """Placed before an upstream top-k router in a fork class's bases; the subclass says how its architecture
    turns the chosen experts' probabilities into gating weights."""

    casts_weights: ClassVar[bool]
    """Whether upstream casts the gating weights back to the logits' dtype (Mixtral keeps them float32)."""

    def renormalises(self) -> bool:
        """Whether upstream divides the top-k probabilities by their sum."""
        raise NotImplementedError

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits, weights, chosen = super().forward(hidden_states)
        routes = getattr(self, _STATE, None)
        if routes is None:
            return logits, weights, chosen
        routes.own = chosen.detach()
        if routes.replayed is None:
            return logits, weights, chosen
        if routes.replayed.shape != chosen.shape:
            raise ValueError(f"routing replay: the router sees {tuple(chosen.shape)} (tokens, top-k) but was given "
                             f"{tuple(routes.replayed.shape)} replayed experts; the replay must cover the forward's "
                             "tokens in its order")
        experts = torch.where(routes.replayed[:, :1] == NO_ROUTE, chosen, routes.replayed)
        probs = F.softmax(logits, dim=-1, dtype=torch.float)  # as upstream: float32 over every expert
        gated = probs.gather(1, experts)
        if self.renormalises():
            gated = gated / gated.sum(dim=-1, keepdim=True)
        return logits, gated.to(logits.dtype) if self.casts_weights else gated, experts


class ReplayQwen3MoeTopKRouter(_ReplayingRouter, Qwen3MoeTopKRouter):
    casts_weights = True

    def renormalises(self) -> bool:
        return self.norm_topk_prob


class ReplayOlmoeTopKRouter(_ReplayingRouter, OlmoeTopKRouter):
    casts_weights = True

    def renormalises(self) -> bool:
        return self.norm_topk_prob


class ReplayMixtralTopKRouter(_ReplayingRouter, MixtralTopKRouter):
    casts_weights = False

    def renormalises(self) -> bool:
        return True


_FORK_ROUTERS: dict[type, type[_ReplayingRouter]] = {
    Qwen3MoeTopKRouter: ReplayQwen3MoeTopKRouter,
    OlmoeTopKRouter: ReplayOlmoeTopKRouter,
    MixtralTopKRouter: ReplayMixtralTopKRouter,
}
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def install_routing_replay(model: nn.Module, *, flag: str = REPLAY_FLAG) -> dict[int, nn.Module]:
    """Re-class every top-k router of `model` for replay; return them by decoder layer index.

    Refuses (UsageError naming `flag`) a dense model, an architecture whose router is not covered, and a router
    outside a `layers.<i>` decoder layer. Idempotent.
    """
    refusal = replay_refusal(model.config.to_dict())
    if refusal:
        raise UsageError(flag, refusal)
    routers = {}
    for name, module in model.named_modules():
        fork_class = _FORK_ROUTERS.get(type(module))
        if fork_class is None and not isinstance(module, _ReplayingRouter):
            if type(module).__name__.endswith("TopKRouter"):
                raise UsageError(flag, f"{type(module).__qualname__} at {name} is a router the fork does not replace")
            continue
        layer = _LAYER.search(name)
        if layer is None:
            raise UsageError(flag, f"the router at {name} sits outside a decoder layer (layers.<i>)")
        if fork_class is not None:
            reclass(module, fork_class, supported=TRANSFORMERS_SUPPORTED, patch=_THIS_FILE, overrides=("forward",),
                    distribution="transformers")
        routers[int(layer.group(1))] = module
    return dict(sorted(routers.items()))


@dataclass
class RoutingRecord:
    """What the routers chose in the forwards inside one `replaying` block."""

    num_layers: int
    routes: dict[int, _RouterRoutes] = field(default_factory=dict)

    def trainer_choice(self) -> torch.Tensor:
        """The trainer's own top-k per (token, layer) in the last forward: (tokens, num_layers, k), NO_ROUTE in
        the slots of layers without experts."""
        own = [routes.own for routes in self.routes.values()]
        if any(o is None for o in own):
            raise RuntimeError("routing replay: no forward ran inside the replaying block")
        tokens, k = own[0].shape
        choice = torch.full((tokens, self.num_layers, k), NO_ROUTE, dtype=torch.long)
        for layer, routes in self.routes.items():
            choice[:, layer] = routes.own.cpu()
        return choice


def _check_replayed(replayed: torch.Tensor, routers: Mapping[int, nn.Module], num_layers: int) -> torch.Tensor:
    """`replayed` as (tokens, num_layers, k) long; refuses what would silently route wrong."""
    if replayed.dim() < 3 or replayed.shape[-2] != num_layers:
        raise ValueError(f"routing replay: expected (..., {num_layers} layers, top-k) expert indices, got "
                         f"{tuple(replayed.shape)}")
    if replayed.dtype.is_floating_point or replayed.dtype == torch.bool:
        raise ValueError(f"routing replay: expert indices must be integers, got {replayed.dtype}")
    flat = replayed.reshape(-1, num_layers, replayed.shape[-1]).long()
    for layer, router in routers.items():
        chosen = flat[:, layer]
        if chosen.shape[-1] != router.top_k:
            raise ValueError(f"routing replay: layer {layer} routes to {router.top_k} experts, replay gives "
                             f"{chosen.shape[-1]}")
        unrouted = chosen == NO_ROUTE
        if (unrouted.any(-1) != unrouted.all(-1)).any():
            raise ValueError(f"routing replay: layer {layer} has a token with some experts replayed and some not")
        if ((chosen < NO_ROUTE) | (chosen >= router.num_experts)).any():
            raise ValueError(f"routing replay: layer {layer} names an expert outside 0..{router.num_experts - 1}")
        ordered = chosen.sort(dim=-1).values
        if ((ordered[:, 1:] == ordered[:, :-1]) & ~unrouted[:, 1:]).any():
            raise ValueError(f"routing replay: layer {layer} names the same expert twice for one token")
    return flat


@contextmanager
def replaying(routers: Mapping[int, nn.Module], replayed: torch.Tensor | None, *,
              num_layers: int) -> Iterator[RoutingRecord]:
    """Inside the block, the routers of `install_routing_replay` use `replayed` and record their own choice.

    `replayed`: expert indices (..., num_layers, k) whose leading dimensions flatten to the forward's tokens in the
    order the routers see them (batch-major, as the MoE block flattens its input); NO_ROUTE for a token replay
    leaves to the trainer's router; None records without replaying (the routing-mismatch metrics with replay off).
    With gradient checkpointing the backward recomputes the forward: keep it inside the block too.
    """
    flat = None if replayed is None else _check_replayed(replayed, routers, num_layers)
    record = RoutingRecord(num_layers)
    for layer, router in routers.items():
        device = router.weight.device
        routes = _RouterRoutes(None if flat is None else flat[:, layer].contiguous().to(device))
        record.routes[layer] = routes
        setattr(router, _STATE, routes)
    try:
        yield record
    finally:
        for router in routers.values():
            delattr(router, _STATE)
