"""The batch gate (rollout/batch_gate.py) admits a dispatch's requests together, in key order, between a pause and a
resume, whatever order and timing they arrive in; a sample that never reaches the engine holds nothing up.

The engine is a fake holding a list: `pause`/`resume` append markers, a request "registers" by appending its key, so
the list is exactly what the engine's scheduler would meet, and in which order."""

from __future__ import annotations

import asyncio
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from openrlhf_tis.rollout.batch_gate import BatchGate


class _Engine:
    def __init__(self):
        self.log: list = []
        self.paused = False

    async def pause(self):
        self.paused = True
        self.log.append("pause")

    async def resume(self):
        self.paused = False
        self.log.append("resume")

    def registered(self) -> int:
        return sum(1 for entry in self.log if isinstance(entry, tuple))

    def gate(self, **kwargs) -> BatchGate:
        return BatchGate(self.pause, self.resume, self.registered, **kwargs)


async def _sample(gate, engine, slot, delay: float, fails_first: bool = False, register_delay: float = 0.0):
    """A sample's task: some work (the executor), its request through the gate, then the engine registers it."""
    try:
        await asyncio.sleep(delay)
        if fails_first:
            raise ValueError("the executor refused the prompt")
        await gate.arrive(slot)
        assert engine.paused, "a gated request reached an engine that was not paused"
        await asyncio.sleep(register_delay)
        engine.log.append(slot.key)
    finally:
        gate.leave(slot)


async def _dispatch(calls: list[int], order: list[int], delays: list[float], seal_after: float, **gate_kwargs):
    """`calls[i]` samples in call i; the calls arrive in `order`, each sample after its delay; sealed after
    `seal_after` s. Returns the engine's log."""
    engine = _Engine()
    gate = engine.gate(**gate_kwargs)
    tasks = []

    async def call(i):
        slots = gate.open_call("d", [(i, j) for j in range(calls[i])])
        await asyncio.gather(*[_sample(gate, engine, s, delays[(i * 7 + j) % len(delays)])
                               for j, s in enumerate(slots)])

    async def seal():
        await asyncio.sleep(seal_after)
        gate.seal("d", len(calls))

    for i in order:
        tasks.append(asyncio.create_task(call(i)))
        await asyncio.sleep(0)
    await asyncio.gather(seal(), *tasks)
    return engine.log


@settings(max_examples=60, deadline=None)
@given(calls=st.lists(st.integers(1, 4), min_size=1, max_size=6), data=st.data())
def test_requests_are_admitted_together_in_key_order_whatever_their_arrival(calls, data):
    order = data.draw(st.permutations(range(len(calls))))
    delays = data.draw(st.lists(st.sampled_from([0.0, 0.001, 0.003]), min_size=1, max_size=8))
    seal_after = data.draw(st.sampled_from([0.0, 0.002, 0.01]))
    log = asyncio.run(_dispatch(calls, order, delays, seal_after))
    keys = sorted((i, j) for i, n in enumerate(calls) for j in range(n))
    assert log == ["pause", *keys, "resume"]


def test_without_a_seal_nothing_is_admitted():
    async def run():
        engine = _Engine()
        gate = engine.gate()
        (slot,) = gate.open_call("d", [("a",)])
        task = asyncio.create_task(_sample(gate, engine, slot, 0.0))
        await asyncio.sleep(0.05)
        assert engine.log == [] and not task.done()
        gate.seal("d", 1)
        await asyncio.wait_for(task, 1)
        return engine.log

    assert asyncio.run(run()) == ["pause", ("a",), "resume"]


def test_a_sample_that_fails_before_its_request_holds_nothing_up():
    async def run():
        engine = _Engine()
        gate = engine.gate()
        slots = gate.open_call("d", [(k,) for k in "cab"])
        gate.seal("d", 1)
        outcomes = await asyncio.gather(*[_sample(gate, engine, s, 0.002 * n, fails_first=(s.key == ("a",)))
                                          for n, s in enumerate(slots)], return_exceptions=True)
        return engine.log, outcomes

    log, outcomes = asyncio.run(asyncio.wait_for(run(), 5))
    assert log == ["pause", ("b",), ("c",), "resume"]
    assert [type(o).__name__ for o in outcomes] == ["NoneType", "ValueError", "NoneType"]


def test_a_request_that_never_registers_ends_the_wait_when_its_task_ends():
    """Admitted, then its task fails before the engine holds it: the next one goes at once, not after the bound."""
    async def run():
        engine = _Engine()
        gate = engine.gate(admit_wait_s=30.0)
        first, second = gate.open_call("d", [(1,), (2,)])
        gate.seal("d", 1)

        async def dies_in_the_engine():
            try:
                await gate.arrive(first)
                raise RuntimeError("prompt too long")
            finally:
                gate.leave(first)

        results = await asyncio.gather(dies_in_the_engine(), _sample(gate, engine, second, 0.0),
                                       return_exceptions=True)
        return engine.log, results

    log, results = asyncio.run(asyncio.wait_for(run(), 5))
    assert log == ["pause", (2,), "resume"] and isinstance(results[0], RuntimeError)


def test_a_slow_request_is_waited_for_only_up_to_the_bound_and_said(capsys):
    async def run():
        engine = _Engine()
        gate = engine.gate(admit_wait_s=0.05)
        slow, fast = gate.open_call("d", [(1,), (2,)])
        gate.seal("d", 1)
        await asyncio.gather(_sample(gate, engine, slow, 0.0, register_delay=0.3), _sample(gate, engine, fast, 0.0))
        return engine.log

    log = asyncio.run(asyncio.wait_for(run(), 5))
    assert log[0] == "pause" and sorted(e for e in log if isinstance(e, tuple)) == [(1,), (2,)]
    assert log.index((2,)) < log.index((1,))  # the fast one was let through while the slow one still registered
    assert "took over 0 s to reach the engine" in capsys.readouterr().out


def test_a_later_request_of_an_admitted_sample_passes_straight_through():
    """A multi-turn agent's second turn: the gate has no say over it."""
    async def run():
        engine = _Engine()
        gate = engine.gate()
        (slot,) = gate.open_call("d", [(1,)])
        gate.seal("d", 1)
        await gate.arrive(slot)
        engine.log.append(slot.key)
        await asyncio.wait_for(gate.arrive(slot), 1)
        return engine.log

    assert asyncio.run(run())[:2] == ["pause", (1,)]


def test_a_miscounted_dispatch_is_refused():
    gate = _Engine().gate()
    gate.seal("d", 1)
    assert gate.open_call("d", []) == []  # a call counted, gating nothing (a request seeded by its caller)
    with pytest.raises(RuntimeError, match="after all 1 sealed calls"):
        gate.open_call("d", [(1,)])
    gate.seal("e", 1)
    with pytest.raises(RuntimeError, match="sealed twice"):
        gate.seal("e", 2)


def test_two_dispatches_on_one_engine_are_admitted_each_as_a_block():
    async def run():
        engine = _Engine()
        gate = engine.gate()
        rng = random.Random(3)
        a = gate.open_call("a", [("a", k) for k in (3, 1, 2)])
        b = gate.open_call("b", [("b", k) for k in (2, 1)])
        gate.seal("a", 1)
        gate.seal("b", 1)
        await asyncio.gather(*[_sample(gate, engine, s, rng.choice([0, 0.002])) for s in a + b])
        return engine.log

    log = asyncio.run(run())
    a, b = [("a", k) for k in (1, 2, 3)], [("b", k) for k in (1, 2)]
    assert log in (["pause", *a, "resume", "pause", *b, "resume"], ["pause", *b, "resume", "pause", *a, "resume"])
