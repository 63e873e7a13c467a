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
BLOCK = 4  # KV-cache block size, in tokens


def _experts(request: int, position: int, layer: int, epoch: int) -> list[int]:
    """Two distinct experts, different for each argument (epoch: the how-many-th computation of the position)."""
    first = (31 * request + 7 * position + 3 * layer + 5 * epoch) % EXPERTS
    return [first, (first + 1 + (position + layer) % (EXPERTS - 1)) % EXPERTS]


class _Router:
    def set_capture_fn(self, fn):
        self.capture = fn


class _Engine:
    """A model runner and its MoE routers, running steps as vLLM does: lay the step out, then each layer reports.

    With `block_tables` (engine request id -> its KV block ids) prefix caching is on and the runner's block table
    holds each scheduled request's blocks, in the input batch's order."""

    def __init__(self, block_tables: dict[str, list[int]] | None = None):
        self.runner = SimpleNamespace(input_batch=SimpleNamespace(), query_start_loc=SimpleNamespace())
        self.block_tables = block_tables
        if block_tables is not None:
            self.runner.cache_config = SimpleNamespace(enable_prefix_caching=True)
            self.runner.input_batch.block_table = [SimpleNamespace(block_size=BLOCK, block_table=SimpleNamespace())]
        self.routers = {layer: _Router() for layer in MOE_LAYERS}
        self.capture = RoutingCapture(self.runner, LAYERS, self.routers)

    def step(self, scheduled: list[tuple[str, int, int, int]], padding: int = 0, skip_layer: int | None = None):
        """`scheduled`: (engine request id, first position, rows, epoch) in the input batch's order."""
        rows = [n for _, _, n, _ in scheduled]
        if self.block_tables is not None:  # rows in the batch's order, wider than needed, spare rows of stale ids
            table = np.full((len(scheduled) + 2, 64), 9999, dtype=np.int32)
            for i, (req_id, *_) in enumerate(scheduled):
                table[i, :len(self.block_tables[req_id])] = self.block_tables[req_id]
            self.runner.input_batch.block_table[0].block_table.np = table
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


@st.composite
def _shared_prefixes(draw):
    """Requests over prompts: a request may share the full blocks of an earlier request's prefix (a prefix-cache hit:
    its first steps start past them, on the same KV blocks), or start after cached blocks the capture never saw
    computed; each is computed in chunks, steps interleaving requests, and may be preempted (recomputed from its
    cached prefix, on its own blocks)."""
    num = draw(st.integers(1, 4))
    total = [draw(st.integers(1, 60)) for _ in range(num)]  # positions each request will compute up to
    blocks, next_block, donors, cached = [], 0, [], []
    for r in range(num):
        own = list(range(next_block, next_block + 16))
        next_block += 16
        donor = draw(st.sampled_from([None, *range(r)])) if r else None
        shared = draw(st.integers(0, min(total[donor], total[r]) // BLOCK)) if donor is not None else 0
        unseen = draw(st.integers(0, 2)) if donor is None else 0  # cached before the capture: never computed here
        own[:shared] = blocks[donor][:shared] if shared else []
        blocks.append(own)
        donors.append(donor)
        cached.append(BLOCK * (shared or unseen))
    computed, epoch, steps, started = list(cached), [0] * num, [], [False] * num
    for r in range(num):  # in order: a request starts once its donor computed the shared blocks
        while computed[r] < max(total[r], cached[r] + 1):
            step = []
            if started[r] and draw(st.integers(0, 9)) == 0 and computed[r] > cached[r]:
                computed[r], epoch[r] = cached[r], epoch[r] + 1
            n = draw(st.integers(1, 24))
            step.append((r, computed[r], n, epoch[r]))
            started[r] = True
            computed[r] += n
            others = [o for o in range(r) if computed[o] < total[o] + 8]
            if others and draw(st.booleans()):  # an earlier request decodes on in the same step
                o = draw(st.sampled_from(others))
                step.append((o, computed[o], 1, epoch[o]))
                computed[o] += 1
            steps.append(step)
    return num, blocks, donors, cached, steps


@settings(max_examples=80, deadline=None)
@given(_shared_prefixes())
def test_a_prefix_cache_hit_brings_the_routing_of_the_forward_that_computed_its_blocks(case):
    """With prefix caching on, a request's cached prefix comes back as the donor's routing at those positions, as its
    last computation before the request's first step left it; blocks never computed under the capture: NO_ROUTE."""
    num, blocks, donors, cached, steps = case
    engine = _Engine({f"r{r}-abcd123{r}": blocks[r] for r in range(num)})
    expected = {r: {} for r in range(num)}  # position -> (request whose forward computed it, epoch)
    seen = [False] * num
    for step in steps:
        for r, first, _, _ in step:
            if not seen[r]:
                seen[r] = True
                donor = donors[r]
                for p in range(first):
                    expected[r][p] = expected[donor].get(p) if donor is not None and p < cached[r] else None
        engine.step([(f"r{r}-abcd123{r}", first, n, epoch) for r, first, n, epoch in step])
        for r, first, n, epoch in step:
            for p in range(first, first + n):
                expected[r][p] = (r, epoch)
    lengths = {f"r{r}": max(expected[r]) + 2 for r in range(num)}
    taken = engine.capture.take(lengths)
    for r in range(num):
        want = np.full((lengths[f"r{r}"], LAYERS, 2), NO_ROUTE)
        for p, origin in expected[r].items():
            if origin is not None:
                for layer in MOE_LAYERS:
                    want[p, layer] = _experts(origin[0], p, layer, origin[1])
        np.testing.assert_array_equal(taken[f"r{r}"], want)


def test_without_prefix_caching_a_cached_prefix_stays_unrouted():
    """The same hit with prefix caching off in the runner's config: nothing is filed by slot, nothing brought."""
    engine = _Engine({"r0-aaaaaaaa": [0, 1], "r1-bbbbbbbb": [0, 2]})
    engine.runner.cache_config.enable_prefix_caching = False
    engine.capture = RoutingCapture(engine.runner, LAYERS, engine.routers)
    engine.step([("r0-aaaaaaaa", 0, 6, 0)])
    engine.step([("r1-bbbbbbbb", 4, 2, 0)])
    taken = engine.capture.take({"r0": 7, "r1": 7})
    assert (taken["r1"][:4] == NO_ROUTE).all() and (taken["r0"][:4, 0] != NO_ROUTE).all()
    assert engine.capture.store is None


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
