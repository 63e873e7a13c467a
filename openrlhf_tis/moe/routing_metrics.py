"""Routing mismatch between two routings of the same tokens (engine vs trainer, or replayed vs the trainer's own):
where they agree, per layer, and how much the tokens whose routing differed account for the log-prob mismatch.

A routing is an integer array (tokens, layers, k) of expert indices, as vLLM returns it per sample; NO_ROUTE
marks a slot without routing (a layer without experts, a token the engine did not route). Two routings agree on a
(token, layer) when they chose the same *set* of experts: the order of a top-k is the kernel's, not the model's.
numpy only: the metrics run on the host on what the forward recorded.

    moe/routing_agreement           share of routed (token, layer) pairs with equal top-k sets
    moe/routing_agreement_layer_<i> the same share in decoder layer i (only layers with experts)
    moe/tokens_routing_differed     share of compared tokens with at least one layer whose sets differ
    moe/k3_routing_differed         (1/N_d) Σ (r − 1 − log r) over those tokens, log r = log π − log μ
    moe/k3_routing_same             the same over the compared tokens routed alike in every layer

A token is compared when both routings routed it in at least one layer; the others count in none of these.
"""

from __future__ import annotations

import numpy as np

NO_ROUTE = -1
"""An expert index meaning "no routing here"."""

PREFIX = "moe/"
AGREEMENT, TOKENS_DIFFERED = PREFIX + "routing_agreement", PREFIX + "tokens_routing_differed"
K3_DIFFERED, K3_SAME = PREFIX + "k3_routing_differed", PREFIX + "k3_routing_same"


def agreement_layer_key(layer: int) -> str:
    return f"{AGREEMENT}_layer_{layer}"


def _pair(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.ndim != 3:
        raise ValueError(f"two routings (tokens, layers, k) of one shape expected, got {a.shape} and {b.shape}")
    return a, b


def routed(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(tokens, layers): both routings routed this token in this layer."""
    a, b = _pair(a, b)
    return (a[..., 0] != NO_ROUTE) & (b[..., 0] != NO_ROUTE)


def same_expert_sets(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(tokens, layers): the two top-k sets are equal (order ignored)."""
    a, b = _pair(a, b)
    return (np.sort(a, axis=-1) == np.sort(b, axis=-1)).all(axis=-1)


def agreement_by_layer(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(layers,): share of routed tokens with equal sets in each layer; NaN for a layer nothing routed."""
    both, same = routed(a, b), same_expert_sets(a, b)
    counts = both.sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, (same & both).sum(axis=0) / counts, np.nan)


def routing_differed(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(tokens,): in at least one layer both routed, the sets differ."""
    return (routed(a, b) & ~same_expert_sets(a, b)).any(axis=-1)


def compared(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(tokens,): both routings routed the token in at least one layer (vLLM does not route a sample's last
    token: the engine never runs it through the model)."""
    return routed(a, b).any(axis=-1)


def k3(log_ratio: np.ndarray) -> float:
    """Mean of r − 1 − log r (NaN for no tokens); expm1 keeps it exact for |log r| near 0."""
    log_ratio = np.asarray(log_ratio, dtype=np.float64)
    return float(np.mean(np.expm1(log_ratio) - log_ratio)) if log_ratio.size else float("nan")


def routing_metrics(engine: np.ndarray, trainer: np.ndarray, log_ratio: np.ndarray) -> dict[str, float]:
    """The moe/* metrics of one batch: `engine`, `trainer` routings (tokens, layers, k) of the same tokens,
    `log_ratio` (tokens,) = log π − log μ of each token under the trainer's and the engine's policy."""
    both = routed(engine, trainer)
    same = same_expert_sets(engine, trainer)
    differed, seen = routing_differed(engine, trainer), compared(engine, trainer)
    log_ratio = np.asarray(log_ratio, dtype=np.float64)
    if log_ratio.shape != differed.shape:
        raise ValueError(f"one log-ratio per token expected: {differed.shape}, got {log_ratio.shape}")
    metrics = {
        AGREEMENT: float((same & both).sum() / both.sum()) if both.any() else float("nan"),
        TOKENS_DIFFERED: float(differed.sum() / seen.sum()) if seen.any() else float("nan"),
        K3_DIFFERED: k3(log_ratio[differed]),
        K3_SAME: k3(log_ratio[seen & ~differed]),
    }
    for layer, share in enumerate(agreement_by_layer(engine, trainer)):
        if both[:, layer].any():
            metrics[agreement_layer_key(layer)] = float(share)
    return metrics
