"""The demo task: a deterministic train/held-out split, the reward rule on hand-written answers, bad task
or reward files refused before Ray starts (held-out evaluation in a real run: tests/test_e2e_ray_job.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from _support import refused

from openrlhf_tis.demo import task

REWARD = Path(task.__file__).with_name("task_reward.py")
DENSE_REWARD = Path(task.__file__).with_name("dense_reward.py")
QUESTION = re.compile(r"^What is (\d) ([-+*]) (\d)\? Put the final answer after 'Answer:'\.$")


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _load_reward():
    from openrlhf_tis.cli.reward_probe import load_reward_func

    return load_reward_func(str(REWARD))


def test_same_seed_writes_the_same_files_and_another_seed_another_split(tmp_path):
    first, again, other = (task.write_task(tmp_path / name, 64, seed) for name, seed in
                           (("a", 0), ("b", 0), ("c", 1)))
    assert [p.read_bytes() for p in first] == [p.read_bytes() for p in again]
    assert first[1].read_bytes() != other[1].read_bytes()


def test_held_out_questions_are_never_trained_on_and_together_cover_the_task(tmp_path):
    train_path, eval_path = task.write_task(tmp_path, 64, seed=3)
    train, held_out = _records(train_path), _records(eval_path)
    train_q, held_q = [r["input"] for r in train], [r["input"] for r in held_out]
    assert len(held_q) == 64 and len(set(held_q)) == 64 and len(set(train_q)) == len(train_q)
    assert not set(train_q) & set(held_q)
    # 0..9 x 0..9 for + and *, and the 55 pairs a >= b for -
    assert len(train_q) + len(held_q) == 100 + 55 + 100


def test_every_label_is_the_value_of_its_question(tmp_path):
    train_path, eval_path = task.write_task(tmp_path, 64)
    for record in _records(train_path) + _records(eval_path):
        a, op, b = QUESTION.match(record["input"]).groups()
        expected = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert expected >= 0 and record["label"] == str(expected), record


def test_held_out_size_must_leave_training_questions():
    for n_eval in (0, 255):
        with pytest.raises(ValueError, match="n_eval"):
            task.split(n_eval)


PROMPT = ("<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n<|im_start|>user\n"
          "What is 0 + 7? Put the final answer after 'Answer:'.<|im_end|>\n<|im_start|>assistant\n")


# digit_share: digits / characters of the response without its chat markers, counted by hand
HAND_SCORED = [
    ("0 + 7 = 7<|im_end|>", 1, 0, 1, 3 / 9),                   # the model's own style: last number
    ("Answer: 7<|im_end|>", 1, 1, 1, 1 / 9),                   # the asked-for format
    ("The answer is 7.0.", 1, 0, 1, 2 / 18),                    # same value written as a decimal
    ("0 + 7 = 8<|im_end|>", 0, 0, 1, 3 / 9),                   # wrong
    ("Answer: 8\nWait, 0 + 7 = 7", 0, 1, 1, 4 / 25),           # the tagged answer is the final one
    ("It is 7, no: 70", 0, 0, 1, 3 / 15),                       # only the last number counts
    ("seven<|im_end|>", 0, 0, 0, 0),                            # badly formatted: no number at all
    ("", 0, 0, 0, 0),                                           # nothing: the question's own 7 is not an answer
]


@pytest.mark.parametrize(("response", "correct", "tagged", "answered", "digit_share"), HAND_SCORED)
def test_reward_scores_hand_written_responses(response, correct, tagged, answered, digit_share):
    out = _load_reward()([PROMPT + response], [PROMPT], ["7"])
    assert out["rewards"] == out["scores"] == correct
    logs = out["extra_logs"]
    assert {k: logs[k] for k in ("correct", "tagged", "answered")} == {"correct": correct, "tagged": tagged,
                                                                       "answered": answered}
    assert logs["digit_share"] == pytest.approx(digit_share, abs=1e-12)


@pytest.mark.parametrize(("response", "correct", "tagged", "answered", "digit_share"), HAND_SCORED)
def test_dense_reward_is_the_task_reward_plus_the_digit_share(response, correct, tagged, answered, digit_share):
    from openrlhf_tis.cli.reward_probe import load_reward_func

    out = load_reward_func(str(DENSE_REWARD))([PROMPT + response], [PROMPT], ["7"])
    assert out["rewards"] == pytest.approx(correct + digit_share, abs=1e-12)
    assert out["extra_logs"]["correct"] == correct


def test_training_prompts_are_training_questions_repeated_in_order(tmp_path):
    train, held_out = task.split()
    records = _records(task.write_prompts(tmp_path / "p.jsonl", 2 * len(train) + 3))
    assert [r["input"] for r in records] == [p.question for p in (train * 3)[: 2 * len(train) + 3]]
    assert not {r["input"] for r in records} & {p.question for p in held_out}
    with pytest.raises(ValueError, match="n must be at least 1"):
        task.write_prompts(tmp_path / "none.jsonl", 0)


def test_reward_scores_a_batch_and_refuses_a_query_without_its_prompt():
    reward_func = _load_reward()
    out = reward_func([PROMPT + "Answer: 7", PROMPT + "6"], [PROMPT, PROMPT], ["7", "7"])
    assert out["rewards"] == [1.0, 0.0] and out["extra_logs"]["tagged"] == [1.0, 0.0]
    with pytest.raises(ValueError, match="does not start with its prompt"):
        reward_func(["user: What is 0 + 7? assistant: 7"], [PROMPT], ["7"])


@pytest.fixture()
def task_argv(tiny_model_dir, tmp_path):
    train, held_out = task.write_task(tmp_path / "task")
    return ["--actor.model_name_or_path", str(tiny_model_dir), "--reward.remote_url", str(REWARD),
            "--data.prompt_dataset", str(train), "--eval.dataset", str(held_out),
            "--data.input_key", "input", "--data.label_key", "label", "--data.apply_chat_template",
            "--logger.run_dir", str(tmp_path / "run")]


def _with(argv: list[str], flag: str, value: str) -> list[str]:
    argv = list(argv)
    argv[argv.index(flag) + 1] = value
    return argv


def test_the_task_files_and_reward_pass_the_cli_checks(task_argv):
    from openrlhf_tis.cli import train_ppo_ray

    args = train_ppo_ray.parse(task_argv, cpu=True)  # includes calling reward_func on the first prompt
    assert getattr(args, "eval.dataset").endswith("eval.jsonl")


def test_unreadable_task_or_reward_files_are_refused_naming_them(task_argv, tmp_path, capsys):
    garbled = tmp_path / "garbled.jsonl"
    garbled.write_text('{"input": "What is 1 + 1?", "label": "2"}\n{"input": "What is\n')
    broken = tmp_path / "broken_reward.py"
    broken.write_text("import no_such_module_anywhere\n\ndef reward_func(queries, prompts, labels):\n    return {}\n")
    cases = [
        ("--data.prompt_dataset", str(tmp_path / "missing_train.jsonl")),
        ("--eval.dataset", str(tmp_path / "missing_eval.jsonl")),
        ("--eval.dataset", str(garbled)),
        ("--reward.remote_url", str(tmp_path / "missing_reward.py")),
        ("--reward.remote_url", str(broken)),
    ]
    for flag, value in cases:
        err = refused(_with(task_argv, flag, value), capsys)
        assert flag in err and Path(value).name in err, (flag, err)


def test_main_job_trains_the_task_and_scores_the_held_out_set(tmp_path, monkeypatch):
    """The main job's notebook parameters: the task's own files and reward, held-out scored at the start and end."""
    from openrlhf_tis.pipeline import main_job

    captured = {}
    monkeypatch.setattr(main_job, "run_main_job", lambda params, out_dir: captured.update(params=params) or {})
    monkeypatch.setattr(main_job, "describe", lambda result: "")
    main_job.main(["--out", str(tmp_path), "--model", "tiny", "--set", "steps=6", "--ds.zero_stage", "3"])
    assert len(_records(tmp_path / "eval.jsonl")) == 64 and len(_records(tmp_path / "train.jsonl")) == 255 - 64
    params = captured["params"]
    assert params.prompts == str(tmp_path / "train.jsonl") and params.reward == str(REWARD)
    assert params.train_dtype in ("bf16", "fp32") and params.rollout_precision == "int8"
    argv = params.argv(tmp_path / "model", Path(params.prompts), tmp_path / "run")
    flags = dict(zip(argv, argv[1:], strict=False))
    assert flags["--eval.dataset"] == str(tmp_path / "eval.jsonl") and flags["--eval.steps"] == "6"
    assert flags["--ds.param_dtype"] == params.train_dtype
    assert argv[-2:] == ["--ds.zero_stage", "3"]  # a training flag given to the main job comes last and wins
