"""Seeded rollout requests and their canonical order (rollout/sampling_seeds.py): pure parts, no engine."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from hypothesis import given
from hypothesis import strategies as st

from openrlhf_tis.rollout.sampling_seeds import (
    ENGINE_SEED,
    OCCURRENCE,
    PROMPT_KEY,
    STAMPS,
    in_canonical_order,
    prompt_key,
    sample_seeds,
)


def test_seeds_are_stable_distinct_and_valid():
    seeds = sample_seeds(42, 0, prompt_key("1+2=", "3"), 0, 8)
    assert seeds == sample_seeds(42, 0, prompt_key("1+2=", "3"), 0, 8)  # a function of its inputs alone
    assert len(set(seeds)) == 8
    assert all(0 <= s < 2**31 for s in seeds)
    # every input moves every seed: engine, policy version (a resumed run), prompt, label, occurrence
    key = prompt_key("1+2=", "3")
    others = [sample_seeds(43, 0, key, 0, 8), sample_seeds(42, 1, key, 0, 8), sample_seeds(42, 0, key, 1, 8),
              sample_seeds(42, 0, prompt_key("1+3=", "3"), 0, 8), sample_seeds(42, 0, prompt_key("1+2=", "4"), 0, 8)]
    for other in others:
        assert not set(seeds) & set(other)
    # the first samples of a longer request are the same draws: n only says how many
    assert sample_seeds(42, 0, key, 0, 3) == seeds[:3]
    assert sample_seeds(42, 0, key, 0, 0) == []


def _sample(key: int | None, occurrence: int, engine: int, tag: str):
    info = {"reward": torch.tensor([1.0])}
    if key is not None:
        info |= {PROMPT_KEY: torch.tensor([key]), OCCURRENCE: torch.tensor([occurrence]),
                 ENGINE_SEED: torch.tensor([engine])}
    return SimpleNamespace(info=info, tag=tag)


@given(st.lists(st.tuples(st.integers(0, 2**56 - 1), st.integers(0, 2), st.integers(0, 2)), min_size=1, max_size=8,
                unique=True),
       st.integers(1, 4), st.randoms(use_true_random=False))
def test_order_is_the_same_whatever_order_requests_finished(requests, n, rnd):
    """Groups of n samples, one per (prompt, occurrence, engine), arriving in any order: the result is always the same
    list, sorted by those keys, each group whole and in its own internal order, the stamps removed."""
    groups = [[_sample(k, o, e, f"{k}/{o}/{e}/{j}") for j in range(n)] for k, o, e in requests]
    arrived = groups[:]
    rnd.shuffle(arrived)
    ordered = in_canonical_order([s for g in arrived for s in g])
    assert [s.tag for s in ordered] == [f"{k}/{o}/{e}/{j}" for k, o, e in sorted(requests) for j in range(n)]
    assert all(not set(STAMPS) & set(s.info) and "reward" in s.info for s in ordered)


def test_unstamped_samples_keep_their_place_after_the_stamped():
    samples = [_sample(None, 0, 0, "a"), _sample(9, 0, 0, "c"), _sample(None, 0, 0, "b"), _sample(9, 0, 1, "d"),
               _sample(2, 5, 0, "e")]
    assert [s.tag for s in in_canonical_order(samples)] == ["e", "c", "d", "a", "b"]
    assert in_canonical_order([]) == []
    assert 0 <= prompt_key("x" * 1000, {"a": 1}) < 2**56  # fits an int64 info tensor


def test_the_engine_sends_one_seeded_request_a_sample_and_stamps_its_key(monkeypatch):
    """PrecisionRolloutRayActor.generate_responses over a fake upstream: n requests of one sample, each with the seed
    sample_seeds gives, outputs in request order, every output stamped; a request already seeded passes through."""
    import asyncio

    from vllm import SamplingParams

    from openrlhf_tis.rollout import engine_actor
    from openrlhf_tis.rollout.versions import VERSION_FIRST

    sent = []

    async def upstream(self, *args, sampling_params=None, num_samples=1, **kwargs):
        sent.append((sampling_params.seed, num_samples, kwargs["prompt"]))
        return [{"seed": sampling_params.seed, "extra_logs": {}} for _ in range(num_samples)]

    monkeypatch.setattr(engine_actor._UpstreamRolloutRayActor, "generate_responses", upstream)
    actor = engine_actor.PrecisionRolloutRayActor.__new__(engine_actor.PrecisionRolloutRayActor)
    actor._engine_seed, actor._policy_version, actor._asked = 45, 3, {}
    params = SamplingParams(temperature=1.0, max_tokens=4)

    def call(prompt="p", **kwargs):
        return asyncio.run(actor.generate_responses(prompt=prompt, label="l", sampling_params=kwargs.get("sp", params),
                                                    max_length=64, hf_tokenizer=None, num_samples=3))

    key = prompt_key("p", "l")
    first, other, second = call(), call("q"), call()
    assert [o["seed"] for o in first] == sample_seeds(45, 3, key, 0, 3) and [s[1] for s in sent] == [1] * 9
    assert [o["seed"] for o in second] == sample_seeds(45, 3, key, 1, 3)  # the same prompt again: its next draws
    assert [o["seed"] for o in other] == sample_seeds(45, 3, prompt_key("q", "l"), 0, 3)
    assert params.seed is None  # the caller's parameters are not touched
    stamped = [(o["extra_logs"][PROMPT_KEY], o["extra_logs"][OCCURRENCE], o["extra_logs"][ENGINE_SEED],
                o["extra_logs"][VERSION_FIRST]) for outs in (first, other, second) for o in outs]
    assert stamped == [(key, 0, 45, 3)] * 3 + [(prompt_key("q", "l"), 0, 45, 3)] * 3 + [(key, 1, 45, 3)] * 3
    asyncio.run(actor.set_policy_version(4))  # a new version: each prompt's count starts again
    actor._policy_version = 3
    assert [o["seed"] for o in call()] == sample_seeds(45, 3, key, 0, 3)
    sent.clear()
    assert [o["seed"] for o in call(sp=SamplingParams(seed=7))] == [7, 7, 7] and sent == [(7, 3, "p")]


def test_the_data_order_is_seeded_from_the_strategy_the_controller_is_given():
    """Two loaders built after seed_data_order with one seed shuffle alike (and unlike another seed's)."""
    from torch.utils.data import DataLoader

    from openrlhf_tis.rollout.sampling_seeds import seed_data_order

    def order(seed: int, by_name: bool) -> list[int]:
        strategy = SimpleNamespace(args=SimpleNamespace(train=SimpleNamespace(seed=seed)))
        seed_data_order(strategy=strategy) if by_name else seed_data_order("model", strategy)
        torch.rand(3)  # whatever the process draws between seeding and the loader's first epoch is drawn alike
        return [int(x) for x in DataLoader(list(range(20)), batch_size=1, shuffle=True)]

    assert order(7, True) == order(7, False) != order(8, True)
    import pytest

    with pytest.raises(TypeError, match="no upstream strategy"):
        seed_data_order("model")
