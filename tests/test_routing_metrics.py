"""Routing-mismatch metrics (openrlhf_tis/moe/routing_metrics.py) against hand-computed cases and properties."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from openrlhf_tis.moe import routing_metrics as rm

U = rm.NO_ROUTE
# 4 tokens x 3 decoder layers (layer 1 has no experts) x top-2. Token 3 is the sample's last: the engine did not
# route it. Differences, by hand: token 0 layer 0 is the same set in another order; token 1 layer 0 differs
# ({1,2} vs {1,3}); token 2 agrees everywhere.
ENGINE = np.array([
    [[0, 1], [U, U], [2, 3]],
    [[1, 2], [U, U], [0, 3]],
    [[3, 0], [U, U], [1, 2]],
    [[U, U], [U, U], [U, U]],
])
TRAINER = np.array([
    [[1, 0], [U, U], [2, 3]],
    [[1, 3], [U, U], [3, 0]],
    [[0, 3], [U, U], [2, 1]],
    [[4, 1], [U, U], [0, 2]],
])
LOG_RATIO = np.array([0.1, -0.5, 0.2, 2.0])


def test_agreement_by_hand():
    assert rm.same_expert_sets(ENGINE, TRAINER)[:3].tolist() == [[True, True, True], [False, True, True],
                                                                  [True, True, True]]
    by_layer = rm.agreement_by_layer(ENGINE, TRAINER)
    assert by_layer[0] == pytest.approx(2 / 3) and by_layer[2] == 1.0 and math.isnan(by_layer[1])
    assert rm.routing_differed(ENGINE, TRAINER).tolist() == [False, True, False, False]
    assert rm.layers_differed(ENGINE, TRAINER).tolist() == [[False] * 3, [True, False, False], [False] * 3,
                                                            [False] * 3]  # token 3: the engine routed nothing
    assert rm.compared(ENGINE, TRAINER).tolist() == [True, True, True, False]


def test_metrics_by_hand():
    metrics = rm.routing_metrics(ENGINE, TRAINER, LOG_RATIO)

    def k3(lr):  # r - 1 - log r, written from the definition
        return math.exp(lr) - 1 - lr

    assert metrics == pytest.approx({
        "moe/routing_agreement": 5 / 6,  # 6 routed (token, layer) pairs, one differs
        "moe/routing_agreement_layer_0": 2 / 3,
        "moe/routing_agreement_layer_2": 1.0,
        "moe/tokens_routing_differed": 1 / 3,  # token 3 was not compared
        "moe/k3_routing_differed": k3(-0.5),
        "moe/k3_routing_same": (k3(0.1) + k3(0.2)) / 2,
    }, rel=1e-12)


def test_nothing_compared_gives_nan_not_zero():
    unrouted = np.full((2, 1, 2), U)
    metrics = rm.routing_metrics(unrouted, unrouted, np.zeros(2))
    assert all(math.isnan(metrics[k]) for k in (rm.AGREEMENT, rm.TOKENS_DIFFERED, rm.K3_DIFFERED, rm.K3_SAME))


@pytest.mark.parametrize("engine, trainer, log_ratio", [
    (ENGINE, TRAINER[:, :2], LOG_RATIO),
    (ENGINE[0], TRAINER[0], LOG_RATIO),
    (ENGINE, TRAINER, LOG_RATIO[:3]),
])
def test_shapes_that_do_not_pair_are_refused(engine, trainer, log_ratio):
    with pytest.raises(ValueError):
        rm.routing_metrics(engine, trainer, log_ratio)


ROUTINGS = hnp.arrays(np.int64, st.tuples(st.integers(1, 6), st.integers(1, 4), st.just(3)),
                      elements=st.integers(0, 7))


@settings(max_examples=60, deadline=None)
@given(ROUTINGS, st.randoms(use_true_random=False))
def test_a_reordered_top_k_agrees_and_agreement_is_symmetric(routing, rnd):
    shuffled = np.array([[rnd.sample(list(s), len(s)) for s in layer] for layer in routing])
    assert (rm.agreement_by_layer(routing, shuffled) == 1.0).all()
    assert not rm.routing_differed(routing, shuffled).any()
    other = (routing + 1) % 8
    np.testing.assert_array_equal(rm.agreement_by_layer(routing, other), rm.agreement_by_layer(other, routing))


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.float64, st.integers(1, 20), elements=st.floats(-5, 5)))
def test_k3_is_nonnegative_and_zero_only_at_no_mismatch(log_ratio):
    assert rm.k3(log_ratio) >= 0
    assert rm.k3(np.zeros_like(log_ratio)) == 0
