"""The routing capture's row-to-token map (rollout/routing_capture.py) without an engine: routers and a model runner
stand in for vLLM's, laid out as vLLM 0.32's runner lays a step out (request order of its input batch, each request's
rows from `query_start_loc`, positions from its computed-token count). tests/test_routing_capture.py checks the same
capture inside a real engine against the trainer's routing.

The reference is a simulation written here: each (request, position, layer) has experts given by a formula, a
step computes some positions of some requests, and what was computed last is what must come back.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from openrlhf_tis.moe.routing_metrics import NO_ROUTE
from openrlhf_tis.rollout.routing_capture import RoutingCapture

LAYERS, MOE_LAYERS, EXPERTS = 3, (0, 2), 8  # layer 1 has no experts


def _experts(request: int, position: int, layer: int, epoch: int) -> list[int]:
    """Two distinct experts, different for each argument (epoch: the how-many-th computation of the position)."""
    first = (31 * request + 7 * position + 3 * layer + 5 * epoch) % EXPERTS
    return [first, (first + 1 + (position + layer) % (EXPERTS - 1)) % EXPERTS]


class _Router:
    def set_capture_fn(self, fn):
        self.capture = fn


class _Engine:
    """A model runner and its MoE routers, running steps as vLLM does: lay the step out, then each layer reports."""

    def __init__(self):
        self.runner = SimpleNamespace(input_batch=SimpleNamespace(), query_start_loc=SimpleNamespace())
        self.routers = {layer: _Router() for layer in MOE_LAYERS}
        self.capture = RoutingCapture(self.runner, LAYERS, self.routers)

    def step(self, scheduled: list[tuple[str, int, int, int]], padding: int = 0, skip_layer: int | None = None):
        """`scheduled`: (engine request id, first position, rows, epoch) in the input batch's order."""
        rows = [n for _, _, n, _ in scheduled]
        self.runner.input_batch.num_reqs = len(scheduled)
        self.runner.input_batch.req_ids = [r for r, *_ in scheduled] + [None] * 2  # the batch keeps spare slots
        self.runner.input_batch.num_computed_tokens_cpu = np.array([p for _, p, _, _ in scheduled] + [999, 999])
        self.runner.query_start_loc.np = np.concatenate([[0], np.cumsum(rows), [sum(rows)] * 2]).astype(np.int32)
        for layer, router in self.routers.items():
            if layer == skip_layer:
                continue
            ids = [_experts(int(r.split("-")[0][1:]), first + i, layer, epoch)
                   for r, first, n, epoch in scheduled for i in range(n)]
            router.capture(torch.tensor(ids + [[EXPERTS - 1, 0]] * padding, dtype=torch.int64))


@st.composite
def _schedules(draw):
    """Steps over up to 3 requests: each starts after a cached prefix (multiple of 4), is computed in chunks of any
    size, may be preempted (recomputed from its cached prefix); steps may carry padding rows."""
    num = draw(st.integers(1, 3))
    cached = [4 * draw(st.integers(0, 5)) for _ in range(num)]
    computed, epoch, steps = list(cached), [0] * num, []
    for _ in range(draw(st.integers(1, 8))):
        members = draw(st.lists(st.sampled_from(range(num)), min_size=1, max_size=num, unique=True))
        step = []
        for r in members:
            if draw(st.integers(0, 9)) == 0 and computed[r] > cached[r]:  # preempted: recomputed from the cache
                computed[r], epoch[r] = cached[r], epoch[r] + 1
            n = draw(st.integers(1, 40))
            step.append((r, computed[r], n, epoch[r]))
            computed[r] += n
        steps.append((step, draw(st.integers(0, 3))))
    return num, steps


@settings(max_examples=60, deadline=None)
@given(_schedules())
def test_each_row_lands_at_its_request_and_position_and_the_last_computation_wins(schedule):
    num, steps = schedule
    engine = _Engine()
    expected = {r: {} for r in range(num)}
    for step, padding in steps:
        engine.step([(f"r{r}-abcd123{r}", first, n, epoch) for r, first, n, epoch in step], padding=padding)
        for r, first, n, epoch in step:
            for p in range(first, first + n):
                expected[r][p] = epoch
    lengths = {f"r{r}": max(expected[r], default=-1) + 2 for r in range(num)}  # + the last, never computed, token
    taken = engine.capture.take({name: n for name, n in lengths.items() if n > 1})
    for r in range(num):
        if not expected[r]:
            assert f"r{r}" not in taken
            continue
        want = np.full((lengths[f"r{r}"], LAYERS, 2), NO_ROUTE)
        for p, epoch in expected[r].items():
            for layer in MOE_LAYERS:
                want[p, layer] = _experts(r, p, layer, epoch)
        np.testing.assert_array_equal(taken[f"r{r}"], want)


def test_requests_are_named_by_the_callers_id_or_the_engines_and_taken_once():
    engine = _Engine()
    engine.step([("r0-aaaaaaaa", 0, 5, 0), ("r1-bbbbbbbb", 0, 3, 0), ("r2-cccccccc", 0, 2, 0),
                 ("r2-dddddddd", 0, 2, 0)])
    with pytest.raises(KeyError, match="no captured requests for request id 'r7'"):
        engine.capture.take({"r7": 3})
    with pytest.raises(KeyError, match="2 captured requests for request id 'r2'"):  # the caller reused an id
        engine.capture.take({"r2": 3})
    with pytest.raises(ValueError, match="'r0' has 5 routed positions but 4 tokens"):
        engine.capture.take({"r1": 4, "r0": 4})
    taken = engine.capture.take({"r0": 6, "r1-bbbbbbbb": 4})  # nothing was forgotten by the refusal
    assert taken["r0"].shape == (6, LAYERS, 2) and (taken["r0"][5] == NO_ROUTE).all()
    assert (taken["r1-bbbbbbbb"][:3, 0] == [_experts(1, p, 0, 0) for p in range(3)]).all()
    with pytest.raises(KeyError, match="no captured requests"):
        engine.capture.take({"r0": 6})


def test_a_layer_the_routing_has_no_slot_for_is_refused():
    runner = SimpleNamespace(input_batch=SimpleNamespace(), query_start_loc=SimpleNamespace())
    with pytest.raises(RuntimeError, match=r"MoE layers \[3\] lie outside the model's 3 decoder layers"):
        RoutingCapture(runner, LAYERS, {0: _Router(), 3: _Router()})
    with pytest.raises(RuntimeError, match="model runner has no 'query_start_loc'"):
        RoutingCapture(SimpleNamespace(input_batch=None), LAYERS, {0: _Router()})


def test_a_step_that_breaks_the_row_map_stops_the_engine():
    engine = _Engine()
    engine.step([("r0-aaaaaaaa", 0, 4, 0)])
    with pytest.raises(RuntimeError, match="routed 3 rows but the step scheduled 4 tokens"):
        engine.routers[0].capture(torch.zeros(3, 2, dtype=torch.int64))  # the same layout, fewer rows routed
    engine = _Engine()
    engine.step([("r0-aaaaaaaa", 0, 4, 0)], skip_layer=2)
    with pytest.raises(RuntimeError, match=r"without reporting MoE layers \[2\]"):
        engine.capture.take({"r0": 5})


def test_a_request_never_taken_is_forgotten_at_the_second_sync_and_a_running_one_never():
    engine = _Engine()
    engine.step([("r0-aaaaaaaa", 0, 4, 0), ("r1-bbbbbbbb", 0, 3, 0)])  # r0 will be aborted: never taken
    assert engine.capture.forget_stale() == []  # a sync: both were routed since the capture started
    engine.step([("r1-bbbbbbbb", 3, 1, 0)])  # r1 runs on across the sync
    assert engine.capture.forget_stale() == ["r0-aaaaaaaa"]  # nothing routed for r0 since the previous sync
    engine.step([("r2-cccccccc", 0, 2, 0)])  # not yet filed when the sync comes: it counts as routed
    assert engine.capture.forget_stale() == ["r1-bbbbbbbb"]
    assert list(engine.capture.requests) == ["r2-cccccccc"]
    with pytest.raises(KeyError, match="no captured requests"):
        engine.capture.take({"r0": 4})
    assert (engine.capture.take({"r2": 3})["r2"][:2, 0] == [_experts(2, p, 0, 0) for p in range(2)]).all()
