"""Routing replay (R3, `--vllm.routing_replay r3`) in the trainer's forwards, and the routing mismatch it measures.

Each sample carries the experts the engine routed its tokens to (`Experience.info[ROUTED_EXPERTS]`,
moe/routing_batch.py). The actor runs two kinds of forward on it, and both replay that routing:

- π_old, the experience maker's forward on the actor group (trainer/moe_experience.py hands each micro-batch's
  routings to the actor's `forward`, trainer/ppo_actor.py);
- π_θ, each training step, whose backward runs inside the same block (gradient checkpointing recomputes the
  forward in the backward: it must route the same way).

The reference model is not replayed: π_ref is the fixed anchor of the KL term and routes as the initial model does,
whatever the engine chose for the current policy (its own routing is part of what the KL measures). Bypass mode
(π_old := μ) dispatches no π_old forward; only the π_θ forwards replay.

With replay on, what the routers would have chosen themselves is recorded in the π_θ forward (`trainer_choice`), so
the engine-vs-trainer agreement is still measured: `moe/*` per step (moe/routing_metrics.py), its token metrics
against log π_old − log μ of the response tokens, summed over the step's micro-batches and data-parallel ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

from openrlhf_tis.moe.routing_batch import ROUTED_EXPERTS, batch_routing, position_log_ratio, router_rows
from openrlhf_tis.moe.routing_metrics import RoutingTally
from openrlhf_tis.moe.routing_replay import RoutingRecord, install_routing_replay, replaying


class ActorRouting:
    """The actor model's replaying routers and the step's routing-mismatch tally."""

    def __init__(self, model: torch.nn.Module, *, packed: bool):
        """`model`: the actor's transformers model (unwrapped from DeepSpeed); `packed`: `--ds.packing_samples`."""
        self.routers = install_routing_replay(model)
        self.num_layers = model.config.get_text_config().num_hidden_layers
        self.packed = packed
        self.tally = RoutingTally(self.num_layers)

    @contextmanager
    def replaying(self, routings: Sequence[torch.Tensor],
                  attention_mask: torch.Tensor) -> Iterator[tuple[RoutingRecord, torch.Tensor]]:
        """Inside the block the actor's forwards on this batch use the samples' routings; yields the routers'
        record and the batch's engine routing (batch, seq, layers, k)."""
        mask = attention_mask.cpu()
        engine = batch_routing(routings, mask)
        with replaying(self.routers, router_rows(engine, mask, packed=self.packed),
                       num_layers=self.num_layers) as record:
            yield record, engine

    def observe(self, record: RoutingRecord, engine: torch.Tensor, log_ratio: torch.Tensor,
                attention_mask: torch.Tensor) -> None:
        """Tally the engine's routing against the routers' own choice in the forward just run; `log_ratio`
        (batch, seq) from `position_log_ratio`."""
        mask = attention_mask.cpu()
        self.tally.add(router_rows(engine, mask, packed=self.packed).numpy(), record.trainer_choice().numpy(),
                       router_rows(log_ratio, mask, packed=self.packed).numpy())

    def step_metrics(self, allreduce: Callable[[torch.Tensor], torch.Tensor] | None, device) -> dict[str, float]:
        """The step's moe/* metrics over every rank (a collective when `allreduce` is given); the tally restarts."""
        sums = torch.from_numpy(self.tally.as_array())
        if allreduce is not None:
            sums = allreduce(sums.to(device)).cpu()
        self.tally = RoutingTally(self.num_layers)
        return RoutingTally.from_array(sums.numpy()).metrics()


def replay_training_step(routing: ActorRouting, experience, step: Callable[[], dict]) -> dict:
    """Run a training step (`step`: forward, loss, backward) inside the experience's replayed routing and tally the
    routing mismatch; the routing leaves `info` first (upstream logs every `info` entry)."""
    routings = experience.info.pop(ROUTED_EXPERTS)
    with routing.replaying(routings, experience.attention_mask) as (record, engine):
        status = step()
    old, rollout = experience.action_log_probs, experience.rollout_log_probs
    seq_len = experience.attention_mask.shape[1]
    if old is None or rollout is None:
        log_ratio = torch.full(experience.attention_mask.shape, float("nan"), dtype=torch.float64)
    else:
        log_ratio = position_log_ratio(old, rollout, experience.action_mask, seq_len)
    routing.observe(record, engine, log_ratio, experience.attention_mask)
    return status


def unwrapped_model(actor) -> torch.nn.Module:
    """The transformers model inside upstream's `Actor` (DeepSpeed wraps it in an engine's `module`)."""
    model = actor.model
    return getattr(model, "module", model)
