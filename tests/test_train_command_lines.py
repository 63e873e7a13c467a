"""The exact command lines a notebook's parameters become, token by token and in order: the training command and the
held-out evaluation of the kept policy. Written out by hand from the commands pipeline/train.py built before the
parameters became one typed object (params.py), so that change, and any later one, keeps them identical."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from openrlhf_tis.pipeline.train import kept_eval_argv
from openrlhf_tis.pipeline.train_params import DEMO_REWARD, TrainParams

MODEL, PROMPTS, RUN = Path("/m/model"), Path("/r/run.prompts.jsonl"), Path("/r/run")
FIXED = ("--data.input_key input --data.label_key label --data.apply_chat_template --data.max_len {max_len} "
         "--vllm.num_engines 1 --algo.advantage.estimator {estimator} --algo.kl.init_coef 0 --rollout.micro_batch_size "
         "{micro} --train.batch_size {batch} --train.micro_batch_size {micro} --train.num_episodes 1 "
         "--train.max_epochs 1 --ds.zero_stage 2 --actor.lr_warmup_ratio 0 --ckpt.path /r/run/ckpt --ckpt.save_steps "
         "-1 --ckpt.best_metric_key none --ckpt.output_dir /r/run/model --logger.logging_steps 1")

# name -> (parameters over the defaults, the training command after `python -m`, the held-out command or None).
# DEMO stands for the demo reward's path.
CASES = {
    "defaults": ({"train_dtype": "fp32"}, (
        "openrlhf_tis.cli.train_ppo_ray --actor.model_name_or_path /m/model --data.prompt_dataset /r/run.prompts.jsonl "
        "--reward.remote_url DEMO --algo.correction.preset tis --eval.steps -1 --vllm.rollout_precision bf16 "
        "--ds.param_dtype fp32 --rollout.batch_size 4 --rollout.n_samples_per_prompt 2 --rollout.max_new_tokens 24 "
        "--actor.adam.lr 0.001 --train.seed 42 --logger.token_dump_steps 1 --logger.run_dir /r/run "
        + FIXED.format(max_len=152, estimator="group_norm", micro=8, batch=8)), None),
    "eval_async_int8": ({
        "train_dtype": "bf16", "eval_prompts": "/data/eval.jsonl", "eval_samples": 3, "eval_every": 2,
        "async_queue": 2, "rollout_precision": "int8", "int8_weight_bits": "6", "reward": "/data/reward.py",
        "correction": "icepop", "correction_options": {"upper": 3, "lower": 0.5}, "extra_args": ["--vllm.fp32_lm_head"],
    }, (
        "openrlhf_tis.cli.train_ppo_ray --actor.model_name_or_path /m/model --data.prompt_dataset /r/run.prompts.jsonl "
        "--reward.remote_url /data/reward.py --algo.correction.preset icepop --algo.correction.upper 3 "
        "--algo.correction.lower 0.5 --eval.dataset /data/eval.jsonl --eval.n_samples_per_prompt 3 --eval.steps 2 "
        "--vllm.rollout_precision int8 --vllm.int8_weight_bits 6 --ds.param_dtype bf16 --rollout.batch_size 4 "
        "--rollout.n_samples_per_prompt 2 --rollout.max_new_tokens 24 --actor.adam.lr 0.001 --train.seed 42 "
        "--train.async_queue_size 2 --logger.token_dump_steps 1 --logger.run_dir /r/run "
        + FIXED.format(max_len=152, estimator="group_norm", micro=8, batch=8)
        + " --eval.temperature 1.0 --train.async_enable --vllm.fp32_lm_head"), (
        "openrlhf_tis.pipeline.kept_eval --run_dir /r/run --base /m/model --eval_prompts /data/eval.jsonl --reward "
        "/data/reward.py --dtype bf16 --n_samples 3 --seed 42 --temperature 1.0 --max_new_tokens 24 --max_len 152 "
        "--cache_dir /c/heldout")),
    "single_sample_evaluated": ({
        "train_dtype": "fp32", "samples_per_prompt": 1, "prompts_per_step": 6, "steps": 3, "token_dump_every": 0,
        "eval_prompts": "/data/eval.jsonl", "lr": 2.5e-06, "seed": 7, "max_new_tokens": 64, "model": "default",
        "run_dir": "elsewhere",  # the command takes the resolved model and run directory it is handed
    }, (
        "openrlhf_tis.cli.train_ppo_ray --actor.model_name_or_path /m/model --data.prompt_dataset /r/run.prompts.jsonl "
        "--reward.remote_url DEMO --algo.correction.preset tis --eval.dataset /data/eval.jsonl "
        "--eval.n_samples_per_prompt 1 --eval.steps 3 --vllm.rollout_precision bf16 --ds.param_dtype fp32 "
        "--rollout.batch_size 6 --rollout.n_samples_per_prompt 1 --rollout.max_new_tokens 64 --actor.adam.lr 2.5e-06 "
        "--train.seed 7 --logger.token_dump_steps 0 --logger.run_dir /r/run "
        + FIXED.format(max_len=192, estimator="reinforce", micro=6, batch=6) + " --eval.temperature 1.0"), (
        "openrlhf_tis.pipeline.kept_eval --run_dir /r/run --base /m/model --eval_prompts /data/eval.jsonl "
        "--reward DEMO "
        "--dtype fp32 --n_samples 1 --seed 7 --temperature 1.0 --max_new_tokens 64 --max_len 192 "
        "--cache_dir /c/heldout")),
}


def _commands(values: dict) -> tuple[list[str], list[str] | None]:
    """The training and held-out command lines for `values` over the defaults (files not checked: they are
    placeholders here)."""
    params = TrainParams(**values)
    held_out = kept_eval_argv(params, MODEL, RUN) if params.eval_prompts else None
    return params.argv(MODEL, PROMPTS, RUN), held_out


def _expected(text: str) -> list[str]:
    return [sys.executable, "-m", *text.replace("DEMO", str(DEMO_REWARD)).split()]


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_command_lines_are_exactly_the_written_ones(case, monkeypatch):
    monkeypatch.setenv("OPENRLHF_TIS_CACHE", "/c")
    values, train, held_out = CASES[case]
    argv, kept = _commands(values)
    assert argv == _expected(train)
    assert kept == (None if held_out is None else _expected(held_out))


def test_checked_parameters_give_the_same_command(tmp_path):
    """What the helper above builds unchecked is what checked parameters build (papermill's int taken as a float)."""
    checked = TrainParams.checked({"train_dtype": "fp32", "lr": 1, "run_dir": str(tmp_path)})
    assert checked.argv(MODEL, PROMPTS, RUN) == _commands({"train_dtype": "fp32", "lr": 1.0})[0]
