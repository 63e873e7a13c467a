"""Held-out accuracy of the kept policy (pipeline/kept_eval.py): the pass@k arithmetic, and a real engine run
that scores a base model and a "trained" one on the same questions and samples, with the base cached."""

from __future__ import annotations

import json

import pytest
import torch
from _support import save_as_source, trainer_model

from openrlhf_tis.pipeline.kept_eval import cache_key, evaluate_kept
from openrlhf_tis.runs.kept_score import HeldoutSettings, kept_label, pass_at_k, read_kept


def test_pass_at_k_against_a_hand_computed_case():
    # 3 questions x 4 samples: means 0.5, 0, 0.75 -> pass1 1.25 / 3; best-of-4 1, 0, 1 -> passk 2 / 3.
    scored = pass_at_k([[1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 0, 1]])
    assert scored == {"pass1": pytest.approx(1.25 / 3), "passk": pytest.approx(2 / 3), "k": 4,
                      "per_question": [0.5, 0.0, 0.75]}
    assert pass_at_k([[0.25], [1.0]]) == {"pass1": 0.625, "passk": 0.625, "k": 1, "per_question": [0.25, 1.0]}
    for bad in ([], [[1, 0], [1]], [[]]):
        with pytest.raises(ValueError, match="same, non-zero number of samples"):
            pass_at_k(bad)


# The demo task's questions with a reward that varies on a random model: 1 for an even-length response. It checks
# the query as upstream builds it (prompt + response, special tokens kept), which the demo reward relies on.
REWARD = '''
def reward_func(queries, prompts, labels):
    assert len(queries) == 1 and queries[0].startswith(prompts[0]) and "<|im_start|>assistant" in prompts[0]
    return {"rewards": float(len(queries[0][len(prompts[0]):]) % 2 == 0)}
'''


@pytest.fixture()
def held_out_files(tmp_path):
    questions = tmp_path / "heldout.jsonl"
    questions.write_text("".join(json.dumps({"input": f"What is {a} + {b}?", "label": str(a + b)}) + "\n"
                                 for a, b in [(1, 2), (3, 4), (5, 1), (2, 2), (7, 0)]))
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    return questions, reward


@pytest.mark.engine
def test_kept_policy_and_base_are_scored_on_the_same_samples_and_the_base_is_cached(
        tiny_model_dir, held_out_files, tmp_path):
    questions, reward = held_out_files
    settings = HeldoutSettings(dtype="fp32", n_samples=3, seed=7, temperature=1.0, max_new_tokens=12, max_len=140)
    cache = tmp_path / "cache"
    # A run whose kept model is the base model itself: same weights, same seeds -> the same samples, so the
    # same scores to the last question (and the cache must not be consulted for "after").
    same = tmp_path / "runs" / "same"
    save_as_source(trainer_model(tiny_model_dir), tiny_model_dir, same / "model")
    first = evaluate_kept(same, tiny_model_dir, questions, reward, settings, cache)
    assert read_kept(same) == first and kept_label(first) == "kept policy (trainer weights, fp32)"
    assert first["schema"] == 1 and first["questions"] == 5 and first["n_samples"] == 3 and first["seed"] == 7
    before, after = first["before"], first["after"]
    assert before["model"] == str(tiny_model_dir) and after["model"] == str(same / "model")
    assert not before["cached"] and not after["cached"]
    assert len(before["per_question"]) == 5 and before["k"] == 3
    assert after["per_question"] == before["per_question"] and after["passk"] == before["passk"]
    assert 0 < before["pass1"] < 1  # the reward varies, so equality above is not 0 == 0
    # A second cell of the same seed with a trained model: the base comes from the cache, unchanged.
    trained = tmp_path / "runs" / "trained"
    model = trainer_model(tiny_model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)  # far from the base: other responses
    save_as_source(model, tiny_model_dir, trained / "model")
    second = evaluate_kept(trained, tiny_model_dir, questions, reward, settings, cache)
    assert second["before"] == {**before, "cached": True}
    assert second["after"]["per_question"] != before["per_question"]
    # Every setting is part of the cache key.
    key = cache_key(tiny_model_dir, questions, reward, {"n": 3})
    assert key != cache_key(tiny_model_dir, questions, reward, {"n": 4})
    assert key == cache_key(tiny_model_dir, questions, reward, {"n": 3})


@pytest.mark.engine
def test_a_run_without_a_saved_model_is_refused(tiny_model_dir, held_out_files, tmp_path):
    questions, reward = held_out_files
    with pytest.raises(FileNotFoundError, match="saved no final model"):
        evaluate_kept(tmp_path / "run", tiny_model_dir, questions, reward,
                      HeldoutSettings(dtype="fp32", n_samples=1, seed=0, temperature=1.0, max_new_tokens=4, max_len=64),
                      tmp_path / "cache")


def test_the_notebook_job_asks_for_the_runs_own_settings(tmp_path, monkeypatch):
    """pipeline/train.py's command line for the kept-policy evaluation: the run's dtype, samples, seed, eval
    temperature and lengths, parsed by heldout's own parser."""
    from openrlhf_tis.pipeline.kept_eval import build_parser, settings_from_args
    from openrlhf_tis.pipeline.train import kept_eval_argv
    from openrlhf_tis.pipeline.train_params import DEMO_REWARD, TrainParams

    monkeypatch.setenv("OPENRLHF_TIS_CACHE", str(tmp_path / "cache"))
    questions = tmp_path / "q.jsonl"
    questions.write_text('{"input": "1 + 1?", "label": "2"}\n')
    params = TrainParams.checked({"eval_prompts": str(questions), "eval_samples": 4, "seed": 9, "train_dtype": "fp32",
                                  "max_new_tokens": 20}, where="test")
    argv = kept_eval_argv(params, tmp_path / "base", tmp_path / "run")
    assert argv[1:3] == ["-m", "openrlhf_tis.pipeline.kept_eval"]
    args = build_parser().parse_args(argv[3:])
    assert (args.dtype, args.n_samples, args.seed, args.temperature, args.max_new_tokens, args.max_len) == (
        "fp32", 4, 9, 1.0, 20, 148)
    assert args.reward == str(DEMO_REWARD) and args.eval_prompts == str(questions)
    assert args.cache_dir == str(tmp_path / "cache" / "heldout") and args.run_dir == str(tmp_path / "run")
    assert settings_from_args(args) == params.heldout_settings() == HeldoutSettings(
        dtype="fp32", n_samples=4, seed=9, temperature=1.0, max_new_tokens=20, max_len=148)


def test_the_settings_round_trip_through_the_command_line_and_key_the_cache_as_before(tmp_path):
    """pipeline/kept_eval.py's own command line carries every setting its parser reads back, and the base model's
    cache key is built from the same names and values as before HeldoutSettings existed (cached scores stay valid)."""
    import dataclasses

    from openrlhf_tis.pipeline.kept_eval import build_parser, command, settings_from_args

    for settings in (HeldoutSettings("bf16", 4, 3, 0.7, 16, 144),
                     HeldoutSettings("fp32", 1, 42, 1.0, 24, 152, chat_template=False)):
        argv = command(tmp_path / "run", tmp_path / "base", tmp_path / "q.jsonl", tmp_path / "r.py", settings,
                       tmp_path / "cache")
        assert argv[1:3] == ["-m", "openrlhf_tis.pipeline.kept_eval"]
        assert settings_from_args(build_parser().parse_args(argv[3:])) == settings
    assert dataclasses.asdict(HeldoutSettings("fp32", 4, 9, 1.0, 20, 148)) == {
        "dtype": "fp32", "n_samples": 4, "seed": 9, "temperature": 1.0, "max_new_tokens": 20, "max_len": 148,
        "chat_template": True, "input_key": "input", "label_key": "label"}


def test_the_command_runs_the_evaluation_with_the_settings_it_carries(held_out_files, tmp_path, monkeypatch, capsys):
    """`python -m openrlhf_tis.pipeline.kept_eval` as train.py starts it: main hands evaluate_kept the same files,
    settings and cache directory (the engine itself is the engine tests' business)."""
    from openrlhf_tis.pipeline import kept_eval

    questions, reward = held_out_files
    settings = HeldoutSettings("fp32", 3, 5, 1.0, 8, 136)
    calls = []

    def evaluate(*args):
        calls.append(args)
        score = {"pass1": 0.25}
        return {"policy": "trainer weights", "dtype": "fp32", "questions": 5, "before": score, "after": score}

    monkeypatch.setattr(kept_eval, "evaluate_kept", evaluate)
    argv = kept_eval.command(tmp_path / "run", tmp_path / "base", questions, reward, settings, tmp_path / "cache")
    kept_eval.main(argv[3:])
    assert calls == [(tmp_path / "run", tmp_path / "base", questions, reward, settings, tmp_path / "cache")]
    assert "kept policy (trainer weights, fp32): pass1 0.250 -> 0.250 (5 questions x 3)" in capsys.readouterr().err


def test_the_kept_file_is_written_as_documented_and_read_back(tmp_path):
    from openrlhf_tis.runs.kept_score import KEPT_FILE, read_kept_heldout, write_kept

    score = {"model": "m", "pass1": 0.5, "passk": 1.0, "k": 2, "per_question": [0.5, 0.5], "seconds": 1.0,
             "cached": False}
    written = write_kept(tmp_path, HeldoutSettings("fp32", 2, 7, 1.0, 12, 140), tmp_path / "q.jsonl", 2, score,
                         {**score, "pass1": 1.0})
    assert list(json.loads((tmp_path / KEPT_FILE).read_text())) == [
        "schema", "policy", "dtype", "n_samples", "seed", "temperature", "max_new_tokens", "eval_prompts",
        "questions", "before", "after"]
    assert read_kept(tmp_path) == written and written["eval_prompts"] == str(tmp_path / "q.jsonl")
    kept = read_kept_heldout(tmp_path)
    assert (kept.dtype, kept.n_samples, kept.seed, kept.before.pass1, kept.after.pass1) == ("fp32", 2, 7, 0.5, 1.0)


@pytest.mark.engine
def test_more_prompt_tokens_than_one_engine_step_holds_are_scored(tiny_model_dir, tmp_path):
    """A study cell's 300 held-out questions exceed one engine step's token budget; with chunked prefill a
    seeded request split across steps crashed the CPU engine ("CPU Generator does not use offset")."""
    questions = tmp_path / "heldout.jsonl"
    questions.write_text("".join(json.dumps({"input": f"What is {i % 10} + {i // 10 % 10}? Think step by step.",
                                             "label": str(i % 10 + i // 10 % 10)}) + "\n" for i in range(300)))
    reward = tmp_path / "reward.py"
    reward.write_text("def reward_func(queries, prompts, labels):\n    return {'rewards': 1.0}\n")
    run = tmp_path / "run"
    save_as_source(trainer_model(tiny_model_dir), tiny_model_dir, run / "model")
    settings = HeldoutSettings(dtype="fp32", n_samples=1, seed=3, temperature=1.0, max_new_tokens=2, max_len=96)
    kept = evaluate_kept(run, tiny_model_dir, questions, reward, settings, tmp_path / "cache")
    assert kept["questions"] == 300
    assert kept["before"]["pass1"] == kept["after"]["pass1"] == 1.0
