"""A sample's routed experts on their way from the engine to the trainer's routers, aligned to the trainer's rows.

The engine returns, per sample, a (tokens, layers, k) array of expert indices over the sample's prompt + response
(rollout/routing_capture.py), NO_ROUTE where it routed nothing. It rides beside μ:

    engine actor's response dict[ROUTED_EXPERTS]  (rollout/engine_actor.py)
    -> Experience.info[ROUTED_EXPERTS]            a list of one (tokens, layers, k) int16 tensor per sample
    -> the π_old forward and each π_θ training step (trainer/moe_replay.py)

A list, not a tensor: upstream's batching helpers (openrlhf 0.11.2 `Experience.concat_experiences`,
`split_experience_batch`, `make_experience_batch`) concatenate and split an `info` list per sample, but pad an
`info` tensor on its *last* axis with 0, a valid expert index. Position j of a sample's routing is the routing of
its token j, the token the trainer's forward feeds at column j of its batch.

The trainer's rows: upstream right-pads a batch (`zero_pad_sequences(..., "right")`), so sample i's token j sits at
(i, j); a dense forward's MoE block flattens (batch, seq) batch-major, and a packed one (`--ds.packing_samples`)
keeps only the attended tokens in the same order (`unpad_input`). Padding rows replay nothing (NO_ROUTE: the
trainer routes them itself; their outputs are masked anyway).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from openrlhf_tis.moe.routing_metrics import NO_ROUTE

ROUTED_EXPERTS = "routed_experts"
"""The key of a sample's routing in the engine's response dict and in `Experience.info`."""


def sample_routing(routed: np.ndarray, length: int) -> torch.Tensor:
    """A sample's routing as it rides in `Experience.info`: the engine's (tokens, layers, k) array cut to the
    sample's `length` tokens (upstream truncates a sample to `--max_len`), NO_ROUTE beyond what the engine returned."""
    routed = np.asarray(routed)
    if routed.ndim != 3:
        raise ValueError(f"routed experts: a (tokens, layers, k) array expected, got shape {routed.shape}")
    out = torch.full((length, *routed.shape[1:]), NO_ROUTE, dtype=torch.int16)
    kept = min(length, len(routed))
    out[:kept] = torch.from_numpy(routed[:kept].astype(np.int16, copy=False))
    return out


def carry_routing(experience, response: dict) -> None:
    """Put a response's routing (if the engine sent one) in its single-sample Experience's `info`, cut to the
    sample's tokens as upstream cut them."""
    routed = response.get(ROUTED_EXPERTS)
    if routed is not None:
        experience.info[ROUTED_EXPERTS] = [sample_routing(routed, experience.sequences.shape[-1])]


def _check_right_padded(attention_mask: torch.Tensor) -> torch.Tensor:
    """Each row's token count, refusing a row whose tokens do not start at column 0 contiguously."""
    lengths = attention_mask.long().sum(dim=1)
    columns = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    if not torch.equal(attention_mask.bool(), columns[None, :] < lengths[:, None]):
        raise ValueError("routing replay: the batch is not right-padded (upstream's layout); its routing cannot be "
                         "placed on its tokens")
    return lengths


def batch_routing(routings: Sequence[torch.Tensor], attention_mask: torch.Tensor) -> torch.Tensor:
    """(batch, seq, layers, k) long: sample i's routing at row i, NO_ROUTE on padding and past a routing's end."""
    if len(routings) != attention_mask.shape[0]:
        raise ValueError(f"routing replay: {len(routings)} routings for a batch of {attention_mask.shape[0]}")
    lengths = _check_right_padded(attention_mask).tolist()
    layers, k = routings[0].shape[1:]
    out = torch.full((*attention_mask.shape, layers, k), NO_ROUTE, dtype=torch.long)
    for i, (routing, length) in enumerate(zip(routings, lengths, strict=True)):
        if tuple(routing.shape[1:]) != (layers, k):
            raise ValueError(f"routing replay: sample {i} has (layers, k) {tuple(routing.shape[1:])}, sample 0 "
                             f"{(layers, k)}")
        kept = min(length, len(routing))
        out[i, :kept] = routing[:kept].long()
    return out


def sample_routings(per_position: torch.Tensor, attention_mask: torch.Tensor) -> list[torch.Tensor]:
    """The inverse of `batch_routing`: a right-padded batch's (batch, seq, layers, k) routing as one (tokens, layers,
    k) int16 tensor per sample, cut to the sample's tokens, as a sample carries it in `Experience.info` (R2: the
    trainer's own π_old routing, recorded per batch, rides with each sample to its π_θ forwards)."""
    lengths = _check_right_padded(attention_mask.cpu()).tolist()
    per_position = per_position.cpu()
    if per_position.dim() != 4 or per_position.shape[:2] != attention_mask.shape:
        raise ValueError(f"routing replay: a (batch, seq, layers, k) routing for a {tuple(attention_mask.shape)} "
                         f"batch expected, got {tuple(per_position.shape)}")
    return [per_position[i, :length].to(torch.int16) for i, length in enumerate(lengths)]


def router_rows(per_position: torch.Tensor, attention_mask: torch.Tensor, *, packed: bool) -> torch.Tensor:
    """A (batch, seq, ...) tensor in the order the MoE blocks see the forward's tokens: batch-major, only the attended
    tokens when the forward packs its samples."""
    if packed:
        return per_position[attention_mask.bool().to(per_position.device)]
    return per_position.reshape(-1, *per_position.shape[2:])


def positions_from_rows(rows: torch.Tensor, attention_mask: torch.Tensor, *, packed: bool,
                        fill: int = NO_ROUTE) -> torch.Tensor:
    """The inverse of `router_rows`: (tokens, ...) in the MoE blocks' order back to (batch, seq, ...), `fill` on the
    padding a packed forward left out."""
    mask = attention_mask.bool().to(rows.device)
    if not packed:
        return rows.reshape(*mask.shape, *rows.shape[1:])
    out = torch.full((*mask.shape, *rows.shape[1:]), fill, dtype=rows.dtype, device=rows.device)
    out[mask] = rows
    return out


def position_log_ratio(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, action_mask: torch.Tensor,
                       seq_len: int) -> torch.Tensor:
    """(batch, seq) float64 log π − log μ at the column of the token that *predicts* each action token (column t
    scores token t + 1, as `Actor.forward` returns them), NaN at the other columns and where μ is not finite."""
    ratio = old_log_probs.double() - rollout_log_probs.double()
    scored = action_mask.bool() & torch.isfinite(ratio)
    out = torch.full((old_log_probs.shape[0], seq_len), float("nan"), dtype=torch.float64)
    width = ratio.shape[1]
    out[:, :width] = torch.where(scored, ratio, torch.nan).cpu()
    return out
