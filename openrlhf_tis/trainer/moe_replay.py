"""Routing replay (`--vllm.routing_replay r3` / `r2`) in the trainer's forwards, and the routing mismatch it measures.

R3: each sample carries the experts the engine routed its tokens to (`Experience.info[ROUTED_EXPERTS]`,
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

Measure (`measure`): the samples carry the engines' routing as for R3, and nothing is replayed: the π_old forward is
upstream's, and each π_θ forward routes on its own while its routers record that choice, so `moe/*` is the routing
mismatch of a run without replay, and its k3 split by cause says how much of log π_old − log μ the tokens routed
differently carry (their π_old was computed through other experts than μ's).

R2 (verl's and ms-swift's): no engine routing. The π_old forward routes on its own and records that choice
(`record_own`); it rides with each sample in the same `info` slot and the π_θ forwards replay it, so the policy update
runs every token through the experts that computed its π_old, while the weights move within the step. The same
`moe/*` then compare π_old's routing with what the π_θ routers would choose themselves; the k3 split by cause is left
out (it splits log π_old − log μ, which R2's routing change within the step does not explain).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from openrlhf_tis.moe.routing_batch import (
    ROUTED_EXPERTS,
    batch_routing,
    position_log_ratio,
    positions_from_rows,
    router_rows,
    sample_routings,
)
from openrlhf_tis.moe.routing_metrics import K3_DIFFERED, K3_SAME, RoutingTally, layers_differed, routed
from openrlhf_tis.moe.routing_replay import RoutingRecord, install_routing_replay, replaying

T = TypeVar("T")


@dataclass(frozen=True)
class ReplayedBatch:
    """One batch inside its `replaying` block: the engine's routing per position, and the routers' record, which holds
    the trainer's own choice once a forward has run."""

    engine: torch.Tensor
    """(batch, seq, layers, k) long, NO_ROUTE where the engine routed nothing and on padding."""
    record: RoutingRecord
    attention_mask: torch.Tensor
    packed: bool

    def rows(self, per_position: torch.Tensor) -> np.ndarray:
        """A (batch, seq, ...) tensor in the routers' row order, as numpy."""
        return router_rows(per_position, self.attention_mask, packed=self.packed).numpy()

    def mismatch_by_position(self) -> tuple[np.ndarray, np.ndarray]:
        """After a forward: (batch, seq, layers) whether the engine's and the trainer's top-k sets differ there, and
        (batch, seq) whether both routed the position in some layer (False on padding and NO_ROUTE positions)."""
        trainer = positions_from_rows(self.record.trainer_choice(), self.attention_mask, packed=self.packed)
        engine, trainer = self.engine.flatten(0, 1).numpy(), trainer.flatten(0, 1).numpy()
        batch, seq, layers = self.engine.shape[:3]
        return (layers_differed(engine, trainer).reshape(batch, seq, layers),
                routed(engine, trainer).any(axis=-1).reshape(batch, seq))


class ActorRouting:
    """The actor model's replaying routers and the step's routing-mismatch tally."""

    def __init__(self, model: torch.nn.Module, *, packed: bool, k3_by_cause: bool = True, replays: bool = True):
        """`model`: the actor's transformers model (unwrapped from DeepSpeed); `packed`: `--ds.packing_samples`;
        `k3_by_cause`: whether the step's metrics split log π_old − log μ by routing (R3, measure: the samples'
        routing is the engine's; R2: it is π_old's own, and the split says nothing of μ); `replays`: whether the
        forwards use the samples' routing (False: measure, the routers choose and the choice is compared)."""
        self.routers = install_routing_replay(model)
        self.num_layers = model.config.get_text_config().num_hidden_layers
        self.packed = packed
        self.k3_by_cause = k3_by_cause
        self.replays = replays
        self.tally = RoutingTally(self.num_layers)

    def record_own(self, forward: Callable[[], T], attention_mask: torch.Tensor) -> tuple[T, list[torch.Tensor]]:
        """Run `forward` (on a right-padded batch) with the routers routing on their own; return its result and what
        they chose, one (tokens, layers, k) int16 tensor per sample (R2's π_old routing, NO_ROUTE in the layers
        without experts)."""
        mask = attention_mask.cpu()
        with replaying(self.routers, None, num_layers=self.num_layers) as record:
            result = forward()
        own = positions_from_rows(record.trainer_choice(), mask, packed=self.packed)
        return result, sample_routings(own, mask)

    @contextmanager
    def replaying(self, routings: Sequence[torch.Tensor], attention_mask: torch.Tensor) -> Iterator[ReplayedBatch]:
        """Inside the block the actor's forwards on this batch use the samples' routings (unless it only measures);
        yields the batch's engine routing and the routers' record."""
        mask = attention_mask.cpu()
        engine = batch_routing(routings, mask)
        replayed = router_rows(engine, mask, packed=self.packed) if self.replays else None
        with replaying(self.routers, replayed, num_layers=self.num_layers) as record:
            yield ReplayedBatch(engine, record, mask, self.packed)

    def observe(self, batch: ReplayedBatch, log_ratio: torch.Tensor) -> None:
        """Tally the engine's routing against the routers' own choice in the forward just run; `log_ratio`
        (batch, seq) from `position_log_ratio`."""
        self.tally.add(batch.rows(batch.engine), batch.record.trainer_choice().numpy(), batch.rows(log_ratio))

    def step_metrics(self, allreduce: Callable[[torch.Tensor], torch.Tensor] | None, device) -> dict[str, float]:
        """The step's moe/* metrics over every rank (a collective when `allreduce` is given); the tally restarts."""
        sums = torch.from_numpy(self.tally.as_array())
        if allreduce is not None:
            sums = allreduce(sums.to(device)).cpu()
        self.tally = RoutingTally(self.num_layers)
        metrics = RoutingTally.from_array(sums.numpy()).metrics()
        if not self.k3_by_cause:
            del metrics[K3_DIFFERED], metrics[K3_SAME]
        return metrics


def replay_training_step(routing: ActorRouting, experience, step: Callable[[ReplayedBatch], dict]) -> dict:
    """Run a training step (`step`: forward, loss, backward, given the batch's routing so that a token dump can read
    it) inside the experience's replayed routing and tally the routing mismatch; the routing leaves `info` first
    (upstream logs every `info` entry)."""
    routings = experience.info.pop(ROUTED_EXPERTS)
    with routing.replaying(routings, experience.attention_mask) as batch:
        status = step(batch)
    old, rollout = experience.action_log_probs, experience.rollout_log_probs
    seq_len = experience.attention_mask.shape[1]
    if not routing.k3_by_cause:  # R2: the log-ratio only marks the response tokens, which the token metrics count
        old = rollout = torch.zeros(experience.action_mask.shape)
    if old is None or rollout is None:
        log_ratio = torch.full(experience.attention_mask.shape, float("nan"), dtype=torch.float64)
    else:
        log_ratio = position_log_ratio(old, rollout, experience.action_mask, seq_len)
    routing.observe(batch, log_ratio)
    return status


def unwrapped_model(actor) -> torch.nn.Module:
    """The transformers model inside upstream's `Actor` (DeepSpeed wraps it in an engine's `module`)."""
    model = actor.model
    return getattr(model, "module", model)
