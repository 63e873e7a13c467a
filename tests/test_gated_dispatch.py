"""Both ends of a gated dispatch (rollout/batch_gate.py): the controller's upstream dispatch, its calls marked and
counted per engine and sealed; and the engine actor, which adds a dispatch's requests to vLLM between a pause that
keeps the caches and a resume, in key order, however its calls arrive.

The engine actor runs over a fake upstream (one executor task a sample, which calls the actor's `generate`, as
openrlhf 0.11.2 does) and a fake vLLM whose log is the order its scheduler would meet the requests in."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import ray
from _support import engine_actor_over

from openrlhf_tis.rollout.batch_gate import GATE_KWARG
from openrlhf_tis.rollout.sampling_seeds import prompt_key, sample_seeds
from openrlhf_tis.trainer.eval_samples import WholeSetEvalSamplesGenerator


class _FakeLLM:
    def __init__(self):
        self.log: list = []
        self.output_processor = SimpleNamespace(get_num_unfinished_requests=lambda: len(self.requests))
        self.requests: list[int] = []

    async def pause_generation(self, *, mode, clear_cache):
        self.log.append(("pause", mode, clear_cache))

    async def resume_generation(self):
        self.log.append("resume")


@pytest.fixture()
def actor(monkeypatch):
    async def upstream_generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        self.llm.requests.append(sampling_params.seed)
        self.llm.log.append(sampling_params.seed)
        return SimpleNamespace(seed=sampling_params.seed)

    async def upstream_generate_responses(self, *, prompt, sampling_params, num_samples=1, delay=0.0, **kwargs):
        async def execute():
            await asyncio.sleep(delay)  # the executor's own work before its request
            output = await self.generate([1, 2], sampling_params)
            return {"seed": output.seed, "extra_logs": {}}
        return await asyncio.gather(*[execute() for _ in range(num_samples)])

    return engine_actor_over(monkeypatch, _FakeLLM(), upstream_generate, upstream_generate_responses, engine_seed=5)


def _params():
    from vllm import SamplingParams

    return SamplingParams(temperature=1.0, max_tokens=4)


def _call(actor, prompt, delay, **kwargs):
    return actor.generate_responses(prompt=prompt, label="l", sampling_params=_params(), max_length=64,
                                    hf_tokenizer=None, num_samples=3, delay=delay, **kwargs)


def test_a_dispatch_reaches_vllm_paused_and_in_key_order_however_its_calls_arrive(actor):
    async def run():
        calls = [asyncio.create_task(_call(actor, "q", 0.0, **{GATE_KWARG: "d"})),
                 asyncio.create_task(_call(actor, "p", 0.02, **{GATE_KWARG: "d"}))]
        await asyncio.sleep(0.05)
        assert actor.llm.log == []  # all arrived, none admitted: the dispatch is not sealed yet
        await actor.seal_dispatch("d", 2)
        return await asyncio.wait_for(asyncio.gather(*calls), 5)

    outputs = asyncio.run(run())
    first, second = sorted("pq", key=lambda p: prompt_key(p, "l"))
    seeds = [seed for p in (first, second) for seed in sample_seeds(5, 0, prompt_key(p, "l"), 0, 3)]
    assert actor.llm.log == [("pause", "keep", False), *seeds, "resume"]
    assert [o["seed"] for o in outputs[0]] == sample_seeds(5, 0, prompt_key("q", "l"), 0, 3)  # each call its own


def test_requests_outside_a_dispatch_are_not_held(actor):
    outputs = asyncio.run(asyncio.wait_for(_call(actor, "p", 0.0), 5))
    assert actor.llm.log == [o["seed"] for o in outputs]  # no pause, no wait


class _Handle:
    def __init__(self, name, log):
        self.name, self.log = name, log
        self.generate_responses = SimpleNamespace(remote=lambda **kw: log.append((name, "generate", kw)) or name)
        self.get_num_unfinished_requests = SimpleNamespace(remote=lambda: 0)
        self.seal_dispatch = SimpleNamespace(remote=lambda d, n: log.append((name, "seal", d, n)))


def _generator(engines):
    gen = WholeSetEvalSamplesGenerator.__new__(WholeSetEvalSamplesGenerator)
    gen.args = SimpleNamespace(algo=SimpleNamespace(advantage=SimpleNamespace(is_correction_level="off")),
                               rollout=SimpleNamespace(n_samples_per_prompt=2))
    gen.vllm_engines, gen.tokenizer = engines, None
    return gen


def test_the_controller_marks_counts_and_seals_each_engines_calls(monkeypatch):
    monkeypatch.setattr(ray, "get", lambda refs: refs)
    log: list = []
    engines = [_Handle("e0", log), _Handle("e1", log), _Handle("e2", log)]
    gen = _generator(engines)
    refs = gen._dispatch_prompts_to_vllm([f"q{i}" for i in range(4)], ["l"] * 4, max_new_tokens=4)
    assert gen.vllm_engines is engines  # the stand-ins are gone
    calls = [e for e in log if e[1] == "generate"]
    seals = [e for e in log if e[1] == "seal"]
    assert refs == [name for name, *_ in calls] and len(calls) == 4  # upstream's refs, upstream's engine choice
    (dispatch,) = {kw[GATE_KWARG] for _, _, kw in calls}
    assert sorted((name, n) for name, _, d, n in seals if d == dispatch) == sorted(
        (name, sum(1 for c in calls if c[0] == name)) for name in {c[0] for c in calls})
    assert log.index(seals[0]) > max(log.index(c) for c in calls)  # sealed after every call went
    gen._dispatch_prompts_to_vllm(["q9"], ["l"], max_new_tokens=4)
    later = [e[2][GATE_KWARG] for e in log if e[1] == "generate"][4:]
    assert later and dispatch not in later  # each dispatch its own id


def test_calls_already_sent_are_sealed_when_the_dispatch_fails_part_way(monkeypatch):
    monkeypatch.setattr(ray, "get", lambda refs: refs)
    log: list = []
    engines = [_Handle("e0", log), _Handle("e1", log)]
    sent = []

    def second_fails(**kw):
        if sent:
            raise ConnectionError("actor died")
        sent.append(kw)
        log.append(("e0", "generate", kw))
        return "e0"

    engines[0].generate_responses = SimpleNamespace(remote=second_fails)
    engines[1].generate_responses = engines[0].generate_responses
    with pytest.raises(ConnectionError):
        _generator(engines)._dispatch_prompts_to_vllm(["a", "b", "c"], ["l"] * 3, max_new_tokens=4)
    assert [e[:2] + e[3:] for e in log if e[1] == "seal"] == [("e0", "seal", 1)]


def test_the_engine_actor_takes_more_calls_at_once_than_a_dispatch_can_hold(monkeypatch):
    """Ray's default of 1,000 concurrent calls for an async actor would leave a larger dispatch held for ever."""
    import openrlhf.trainer.ray.vllm_engine as upstream_engine

    from openrlhf_tis.patches.rollout_engine import use_fork_engine_actor
    from openrlhf_tis.rollout.batch_gate import CALLS_AT_ONCE

    monkeypatch.setattr(upstream_engine, "RolloutRayActor", upstream_engine.RolloutRayActor)  # restored after
    for routed in (False, True):
        use_fork_engine_actor(routed_experts=routed)
        assert upstream_engine.RolloutRayActor._default_options["max_concurrency"] == CALLS_AT_ONCE > 10_000
