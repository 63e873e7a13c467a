"""The held-out set reaches the engines in one dispatch, and the rollout batch size is left as it was."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from openrlhf_tis.trainer.eval_samples import WholeSetEvalSamplesGenerator, whole_set_eval


class _RecordingGenerator(WholeSetEvalSamplesGenerator):
    """Stands in for the engine round trip only: upstream's eval loop above it runs unchanged."""

    def __init__(self, prompts: int, rollout_batch: int, fail: bool = False):
        args = SimpleNamespace(rollout=SimpleNamespace(batch_size=rollout_batch),
                               vllm=SimpleNamespace(enable_sleep=False))
        loader = [(i, [f"q{i}"], [str(i)], [None]) for i in range(prompts)]
        super().__init__(SimpleNamespace(args=args), [], _Loader(loader), tokenizer=object(), vllm_engines=["engine"])
        self.calls, self.fail = [], fail

    def _generate_vllm(self, dataloader_iter, num_prompts, dynamic_filtering, **kwargs):
        if self.fail:
            raise RuntimeError("engine died")
        taken = [next(dataloader_iter, None) for _ in range(num_prompts)]
        taken = [t for t in taken if t is not None]
        self.calls.append(len(taken))
        return [t[1][0] for t in taken], len(taken), len(taken) < num_prompts or not taken


class _Loader(list):
    @property
    def dataset(self):
        return self


@pytest.mark.parametrize("prompts,batch", [(64, 4), (3, 4), (10, 10)])
def test_every_held_out_prompt_goes_in_one_dispatch(prompts, batch):
    gen = _RecordingGenerator(prompts, batch)
    samples = gen.generate_eval_samples(temperature=1.0)
    assert samples == [f"q{i}" for i in range(prompts)]
    assert gen.calls[0] == prompts and sum(gen.calls) == prompts  # upstream would have made ceil(prompts/batch)
    assert gen.args.rollout.batch_size == batch


def test_the_rollout_batch_size_is_restored_when_the_engines_fail():
    gen = _RecordingGenerator(8, 4, fail=True)
    with pytest.raises(RuntimeError, match="engine died"):
        gen.generate_eval_samples()
    assert gen.args.rollout.batch_size == 4


def test_the_replacement_shares_the_original_generators_parts():
    original = _RecordingGenerator(5, 2)
    replaced = whole_set_eval(original)
    assert type(replaced) is WholeSetEvalSamplesGenerator
    for part in ("strategy", "prompts_dataloader", "eval_dataloader", "tokenizer", "vllm_engines"):
        assert getattr(replaced, part) is getattr(original, part)


def test_each_finished_response_is_counted_after_upstream_turned_it_into_an_experience(monkeypatch):
    from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator

    seen = []  # upstream's responses are dicts (the engine's output for one sample)
    monkeypatch.setattr(SamplesGenerator, "_process_response_into_experience",
                        lambda self, response, **kwargs: seen.append(("upstream", response["id"])) or
                        f"exp {response['id']}")
    replaced = whole_set_eval(_RecordingGenerator(5, 2), on_response=lambda: seen.append("counted"))
    assert [replaced._process_response_into_experience({"id": r}, max_len=8) for r in "ab"] == ["exp a", "exp b"]
    assert seen == [("upstream", "a"), "counted", ("upstream", "b"), "counted"]
    unseen = whole_set_eval(_RecordingGenerator(5, 2))
    assert unseen._process_response_into_experience({"id": "c"}) == "exp c"  # no counter
