"""Each sample carries its own request's routed experts out of the engine actor (rollout/engine_actor.py), over a fake
upstream and a fake engine: upstream's `generate_responses` runs each sample's executor in a task of its own that calls
the actor's `generate`, as openrlhf 0.11.2 does; the fake engine's capture returns, per request id, an array naming
that request, so a routing handed to another sample's response reads as the wrong number."""

from __future__ import annotations

import asyncio
import re
from types import SimpleNamespace

import numpy as np
import pytest
from _support import engine_actor_over

from openrlhf_tis.moe.routing_batch import ROUTED_EXPERTS
from openrlhf_tis.rollout import engine_actor


class _FakeEngine:
    """`collective_rpc` of an engine whose capture holds, for request r, a (tokens, 1, 1) array filled with r."""

    def __init__(self):
        self.taken: list[dict] = []

    async def collective_rpc(self, method, args=()):
        if method == "start_routing_capture":
            return [[0, 2]]
        if method == "forget_stale_routing":
            self.taken.append("forget")
            return [["7-aaaaaaaa", "9-bbbbbbbb"]]
        assert method == "take_routed_experts"
        (lengths,) = args
        self.taken.append(dict(lengths))
        return [{rid: np.full((n, 1, 1), int(rid), dtype=np.int16) for rid, n in lengths.items()}]


@pytest.fixture()
def actor(monkeypatch):
    counter = iter(range(1000))

    async def upstream_generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        rid = next(counter)
        await asyncio.sleep(0.001 * (rid % 3))  # requests end out of order
        return SimpleNamespace(request_id=str(rid), prompt_token_ids=list(prompt_token_ids),
                               outputs=[SimpleNamespace(token_ids=[7] * (1 + rid % 4))])

    async def upstream_generate_responses(self, *args, sampling_params=None, num_samples=1, turns=1, **kwargs):
        async def execute():  # the executor: one generate per turn, then the response dict
            outputs = [await self.generate([1, 2, 3], sampling_params) for _ in range(turns)]
            return {"request": outputs[-1].request_id, "extra_logs": {}}
        return await asyncio.gather(*[execute() for _ in range(num_samples)])

    return engine_actor_over(monkeypatch, _FakeEngine(), upstream_generate, upstream_generate_responses)


def _params():
    from vllm import SamplingParams

    return SamplingParams(temperature=1.0, max_tokens=4)


async def _rollout(actor, prompts=("p", "q"), samples=3, **kwargs):
    calls = [actor.generate_responses(prompt=p, label="l", sampling_params=_params(), max_length=64,
                                      hf_tokenizer=None, num_samples=samples, **kwargs) for p in prompts]
    return [o for outputs in await asyncio.gather(*calls) for o in outputs]


def test_without_the_capture_nothing_is_taken_or_carried(actor):
    outputs = asyncio.run(_rollout(actor))
    assert actor.llm.taken == [] and all(ROUTED_EXPERTS not in o for o in outputs)


def test_each_sample_carries_its_own_requests_routing(actor):
    assert asyncio.run(actor.start_routing_capture()) == [0, 2]
    outputs = asyncio.run(_rollout(actor))
    assert len(outputs) == 6
    for output in outputs:
        routing = output[ROUTED_EXPERTS]
        rid = int(output["request"])
        assert (routing == rid).all() and len(routing) == 3 + 1 + rid % 4  # prompt + the request's sampled tokens
    assert len(actor.llm.taken) == 6  # one take a request


def test_a_request_outside_a_sample_is_taken_and_dropped(actor):
    """The sync check's scoring calls `generate` directly: its routing must not stay in the engine."""
    asyncio.run(actor.start_routing_capture())
    output = asyncio.run(actor.generate([1, 2], _params()))
    assert actor.llm.taken == [{output.request_id: 2 + len(output.outputs[0].token_ids)}]


def test_a_sample_of_several_requests_is_refused(actor):
    asyncio.run(actor.start_routing_capture())
    with pytest.raises(RuntimeError, match="2 engine requests"):
        asyncio.run(_rollout(actor, prompts=("p",), samples=1, turns=2))


def test_a_sync_drops_the_routing_never_taken_only_once_the_capture_runs(actor, capsys):
    assert asyncio.run(actor.forget_stale_routing()) == 0 and actor.llm.taken == []  # no capture: no call
    asyncio.run(actor.start_routing_capture())
    assert asyncio.run(actor.forget_stale_routing()) == 2 and actor.llm.taken == ["forget"]
    assert "dropped the routing of 2 request(s) never taken" in capsys.readouterr().out


def test_the_engine_actor_calls_methods_the_cpu_worker_extension_has():
    """`collective_rpc` names a method of the engine's worker extension; a renamed one would fail only in an engine."""
    import inspect

    from openrlhf_tis.rollout.weight_sync.receive import CPUWorkerExtension

    source = inspect.getsource(engine_actor.PrecisionRolloutRayActor)
    called = set(re.findall(r'collective_rpc\("(\w+)"', source))
    assert {"start_routing_capture", "take_routed_experts", "forget_stale_routing"} <= called
    assert [name for name in sorted(called) if not callable(getattr(CPUWorkerExtension, name, None))] == []
