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

The agreement counts every routed (token, layer) pair, prompt and response; the token metrics count the tokens with
a log-ratio (the response's) that both routings routed in at least one layer. The names live in metric_names.py.
"""

from __future__ import annotations

import numpy as np

from openrlhf_tis.metric_names import (
    MOE_AGREEMENT,
    MOE_K3_DIFFERED,
    MOE_K3_SAME,
    MOE_TOKENS_DIFFERED,
    moe_agreement_layer_key,
)

NO_ROUTE = -1
"""An expert index meaning "no routing here"."""

AGREEMENT, TOKENS_DIFFERED = MOE_AGREEMENT, MOE_TOKENS_DIFFERED
K3_DIFFERED, K3_SAME = MOE_K3_DIFFERED, MOE_K3_SAME
agreement_layer_key = moe_agreement_layer_key


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


def layers_differed(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(tokens, layers): both routed the token in the layer and their sets differ."""
    return routed(a, b) & ~same_expert_sets(a, b)


def routing_differed(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(tokens,): in at least one layer both routed, the sets differ."""
    return layers_differed(a, b).any(axis=-1)


def compared(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(tokens,): both routings routed the token in at least one layer (vLLM does not route a sample's last
    token: the engine never runs it through the model)."""
    return routed(a, b).any(axis=-1)


def k3(log_ratio: np.ndarray) -> float:
    """Mean of r − 1 − log r (NaN for no tokens); expm1 keeps it exact for |log r| near 0."""
    log_ratio = np.asarray(log_ratio, dtype=np.float64)
    return float(np.mean(np.expm1(log_ratio) - log_ratio)) if log_ratio.size else float("nan")


def _ratio(num: float, den: float) -> float:
    return float(num / den) if den > 0 else float("nan")


class RoutingTally:
    """The moe/* metrics summed over batches (a step's micro-batches, then its data-parallel ranks).

    Kept as sums, not means: a step's share is the ratio of its totals, whatever the batches' sizes, and the
    ranks' tallies add (`as_array` / `from_array` around an all-reduce).
    """

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.tokens = np.zeros(2)  # compared, differed
        self.k3 = np.zeros(2)  # sums of k3 over the tokens whose routing differed, and those routed alike
        self.pairs = np.zeros((2, num_layers))  # routed (token, layer) pairs, of which the sets agree

    def add(self, engine: np.ndarray, trainer: np.ndarray, log_ratio: np.ndarray) -> None:
        """`engine`, `trainer`: routings (tokens, layers, k) of the same tokens; `log_ratio` (tokens,): log π − log μ,
        NaN for a token without one (a prompt token): its pairs count in the agreement, not in the token metrics."""
        both, same = routed(engine, trainer), same_expert_sets(engine, trainer)
        if both.shape[1] != self.num_layers:
            raise ValueError(f"routings of {both.shape[1]} layers in a tally of {self.num_layers}")
        log_ratio = np.asarray(log_ratio, dtype=np.float64)
        if log_ratio.shape != both.shape[:1]:
            raise ValueError(f"one log-ratio per token expected: {both.shape[:1]}, got {log_ratio.shape}")
        self.pairs += [both.sum(axis=0), (both & same).sum(axis=0)]
        seen = both.any(axis=-1) & np.isfinite(log_ratio)
        differed = seen & (both & ~same).any(axis=-1)
        kl = np.expm1(log_ratio) - log_ratio
        self.tokens += [seen.sum(), differed.sum()]
        self.k3 += [kl[differed].sum(), kl[seen & ~differed].sum()]

    def as_array(self) -> np.ndarray:
        return np.concatenate([self.tokens, self.k3, self.pairs.ravel()])

    @classmethod
    def from_array(cls, values: np.ndarray) -> RoutingTally:
        values = np.asarray(values, dtype=np.float64)
        tally = cls((len(values) - 4) // 2)
        tally.tokens, tally.k3 = values[:2].copy(), values[2:4].copy()
        tally.pairs = values[4:].reshape(2, tally.num_layers).copy()
        return tally

    def metrics(self) -> dict[str, float]:
        """The moe/* metrics of the module doc (NaN where nothing was counted); a per-layer share only for the
        layers something was routed in."""
        (seen, differed), (k3_differed, k3_same), (pairs, agree) = self.tokens, self.k3, self.pairs
        metrics = {
            AGREEMENT: _ratio(agree.sum(), pairs.sum()),
            TOKENS_DIFFERED: _ratio(differed, seen),
            K3_DIFFERED: _ratio(k3_differed, differed),
            K3_SAME: _ratio(k3_same, seen - differed),
        }
        metrics.update({agreement_layer_key(layer): _ratio(agree[layer], pairs[layer])
                        for layer in range(self.num_layers) if pairs[layer] > 0})
        return metrics


def routing_metrics(engine: np.ndarray, trainer: np.ndarray, log_ratio: np.ndarray) -> dict[str, float]:
    """The moe/* metrics of one batch: `engine`, `trainer` routings (tokens, layers, k) of the same tokens,
    `log_ratio` (tokens,) = log π − log μ of each token under the trainer's and the engine's policy (NaN: none)."""
    engine, trainer = _pair(engine, trainer)
    tally = RoutingTally(engine.shape[1])
    tally.add(engine, trainer, log_ratio)
    return tally.metrics()
