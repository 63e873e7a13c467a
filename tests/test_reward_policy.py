"""Bad rewards never train silently: `--reward.nonfinite fail|drop` on NaN/inf rewards, and a
reward function that raises fails the run with its own exception and traceback. The real run holding both (a NaN
group dropped, then a raising reward) is in the extended tier (`bash scripts/run_tests.sh extended`)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch
from _support import execute_prompts
from openrlhf.trainer.ppo_utils.experience import Experience
from openrlhf.utils.agent import SingleTurnAgentExecutor

from openrlhf_tis.demo.task import write_prompts
from openrlhf_tis.rollout.reward_executor import LoudRewardExecutor, RewardFunctionError, make_rewards_loud
from openrlhf_tis.runs import query_tokens
from openrlhf_tis.trainer.rewards import DROP_FLAG, NonFiniteRewardError, RewardPolicy, screen_rewards


def _samples(rewards) -> list[Experience]:
    """One Experience per sample as upstream's samples generator makes them (prompt i // 2 for groups of 2)."""
    return [Experience(rewards=None if r is None else torch.tensor([r]), prompts=[f"question {i // 2}"],
                       labels=[str(i // 2)]) for i, r in enumerate(rewards)]


def test_finite_rewards_pass_untouched():
    samples = _samples([0.0, 1.0, -2.5, 3.0])
    kept, metrics = screen_rewards(samples, RewardPolicy("fail", 2, "r.py"), step=1)
    assert kept is samples and metrics == {"reward/nonfinite_samples": 0.0, "reward/dropped_samples": 0.0}


def test_fail_names_the_samples_and_the_reward_script():
    samples = _samples([1.0, 0.0, math.nan, 1.0, 0.0, math.inf])
    with pytest.raises(NonFiniteRewardError) as err:
        screen_rewards(samples, RewardPolicy("fail", 2, "/x/reward.py"), step=7)
    message = str(err.value)
    assert message.startswith("step 7: the reward from /x/reward.py is NaN or inf for 2 of 6 samples")
    assert "#2 (prompt group 1) reward nan, label '1'" in message and "#5 (prompt group 2) reward inf" in message
    assert "question 1" in message and DROP_FLAG in message


@pytest.mark.parametrize("seed", range(5))
def test_drop_removes_whole_groups_holding_a_nonfinite_reward(seed):
    rng = np.random.default_rng(seed)
    group = int(rng.integers(1, 4))
    rewards = rng.normal(size=group * 6)
    rewards[rng.random(len(rewards)) < 0.2] = rng.choice([np.nan, np.inf, -np.inf])
    rewards[0] = np.nan  # at least one
    samples = _samples(rewards.tolist())
    kept, metrics = screen_rewards(samples, RewardPolicy("drop", group, "r.py"), step=1)
    # reference: the groups (consecutive `group` samples) whose rewards are all finite, in order
    groups = [samples[i:i + group] for i in range(0, len(samples), group)]
    expected = [s for g in groups if all(np.isfinite(s.rewards.item()) for s in g) for s in g]
    assert [id(s) for s in kept] == [id(s) for s in expected]
    assert metrics["reward/nonfinite_samples"] == (~np.isfinite(rewards)).sum()
    assert metrics["reward/dropped_samples"] == len(samples) - len(expected)


def test_drop_keeps_data_parallel_actors_in_step():
    # 2 actors x rollout micro batch 2 -> kept samples in multiples of lcm(group 2, 4) = 4
    rules = RewardPolicy("drop", 2, "r.py", data_parallel=2, rollout_micro_batch=2, train_micro_batch=1)
    kept, metrics = screen_rewards(_samples([math.nan] + [1.0] * 15), rules, step=1)
    assert len(kept) == 12 and metrics["reward/dropped_samples"] == 4
    with pytest.raises(NonFiniteRewardError, match="leaves 0 samples"):
        screen_rewards(_samples([math.nan, 1.0, 1.0, 1.0]), rules, step=1)


def test_samples_without_a_reward_are_not_judged_here():
    kept, metrics = screen_rewards(_samples([None, None]), RewardPolicy("fail", 1, "rm"), step=1)
    assert len(kept) == 2 and metrics["reward/nonfinite_samples"] == 0


# --- the engine side: a reward that raises -------------------------------------------------------------




@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_a_raising_reward_fails_with_its_own_exception(tmp_path, tokenizer, capsys):
    script = tmp_path / "reward.py"
    script.write_text("def reward_func(queries, prompts, labels):\n"
                      "    if 'bad' in prompts[0]:\n"
                      "        raise KeyError('no answer field')\n"
                      "    return {'rewards': 2.0}\n")
    upstream = SingleTurnAgentExecutor(str(script))
    swallowed = execute_prompts(upstream, tokenizer, ["a bad prompt"])[0]
    assert swallowed["reward"] is None  # upstream: logged at INFO, the sample goes on without a reward

    loud = SingleTurnAgentExecutor(str(script))
    assert make_rewards_loud(loud) and isinstance(loud, LoudRewardExecutor)
    failed, fine = execute_prompts(loud, tokenizer, ["a bad prompt", "a good prompt"])  # concurrent samples
    assert isinstance(failed, KeyError) and failed.args == ("no answer field",)
    frames = traceback.extract_tb(failed.__traceback__)
    assert any(f.filename == str(script) and f.lineno == 3 for f in frames)  # the script's own line
    assert f"the reward of {script} for prompt 'a bad prompt' (label '4') raised KeyError" in capsys.readouterr().err
    assert fine["reward"] == 2.0  # the other sample of the same step is unaffected


def test_a_reward_call_without_rewards_fails(tmp_path, tokenizer):
    script = tmp_path / "reward.py"
    script.write_text("def reward_func(queries, prompts, labels):\n    return {'scores': 1.0}\n")
    loud = SingleTurnAgentExecutor(str(script))
    make_rewards_loud(loud)
    (result,) = execute_prompts(loud, tokenizer, ["what is 2 + 2?"])
    assert isinstance(result, RewardFunctionError) and "returned no 'rewards'" in str(result)


# --- end to end: drop a NaN group at step 1, then the reward raises at step 2 --------------------------

NAN_THEN_RAISE = '''import itertools
import math

_calls = itertools.count(1)


def reward_func(queries, prompts, labels):
    call = next(_calls)  # per process: the CLI's own try-out is call 1 in the driver
    if call > 8:  # step 2 of 4 prompts x 2 samples
        raise ValueError(f"reward server exploded at call {call}")
    return {"rewards": math.nan if call == 2 else float(len(queries[0]) % 7)}
'''


@pytest.mark.e2e
@pytest.mark.extended  # a start of a run: the policy and the raising reward are checked above without one
def test_nan_group_dropped_then_raising_reward_stops_the_run(tiny_model_dir, tmp_path):
    reward = tmp_path / "nan_then_raise.py"
    reward.write_text(NAN_THEN_RAISE)
    write_prompts(tmp_path / "prompts.jsonl", 8)
    argv = [
        sys.executable, "-m", "openrlhf_tis.cli.train_ppo_ray",
        "--actor.model_name_or_path", str(tiny_model_dir), "--reward.remote_url", str(reward),
        "--reward.nonfinite", "drop", "--data.prompt_dataset", str(tmp_path / "prompts.jsonl"),
        "--data.input_key", "input", "--data.label_key", "label", "--vllm.num_engines", "1",
        "--algo.advantage.estimator", "group_norm", "--algo.kl.init_coef", "0", "--rollout.n_samples_per_prompt", "2",
        "--rollout.batch_size", "4", "--rollout.micro_batch_size", "2", "--train.batch_size", "2",
        "--train.micro_batch_size", "2", "--data.max_len", "96", "--rollout.max_new_tokens", "16",
        "--data.max_samples", "8", "--train.num_episodes", "1", "--ds.zero_stage", "2", "--actor.lr_warmup_ratio", "0",
        "--ckpt.path", str(tmp_path / "ckpt"), "--ckpt.output_dir", str(tmp_path / "final"), "--eval.steps", "-1",
        "--train.seed", "42", "--logger.run_dir", str(tmp_path / "run"),
    ]
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "RAY_DEDUP_LOGS": "0"})
    log = proc.stdout + proc.stderr
    (tmp_path / "train.log").write_text(log)
    assert proc.returncode != 0, log[-4000:]
    assert "ValueError: reward server exploded at call" in log, log[-4000:]
    assert f'File "{reward}", line 10, in reward_func' in log  # the reward script's own traceback
    assert "has no attribute 'size'" not in log
    assert not (tmp_path / "final").exists()  # no "final" model from a failed run

    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in lines] == [1], lines
    step = lines[0]
    assert step["reward/nonfinite_samples"] == 1 and step["reward/dropped_samples"] == 2
    assert math.isfinite(step["policy_loss"]) and math.isfinite(step["actor_grad_norm"])
    # step 1 trained on the 6 samples left, renumbered 0..5 (its token dump holds every one of them)
    assert sorted(query_tokens(tmp_path / "run", steps=1)["sample_id"].unique()) == list(range(6))
    assert Path(tmp_path / "run" / "config.json").is_file()
