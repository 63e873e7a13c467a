"""The training command a notebook builds is derived from TrainParams' flags, and the real parser reads it.

No Ray, no kernel: the fork's own parser (upstream's plus the fork's flags) parses what TrainParams.argv derives.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from openrlhf_tis.cli import train_ppo_ray
from openrlhf_tis.correction.config import FLAG_PREFIX, CorrectionConfig
from openrlhf_tis.cpu_features import default_train_dtype
from openrlhf_tis.params import ParameterError
from openrlhf_tis.pipeline.train_params import DEMO_REWARD, TrainParams

MODEL, PROMPTS, RUN = Path("/m/model"), Path("/r/run.prompts.jsonl"), Path("/r/run")
SPEC = TrainParams.spec()

# The commands pipeline/train.py built with its ~30 hand-written flags (commit 20902a2), for three parameter sets;
# DEMO stands for the demo reward's path.
BEFORE = {
    "defaults": ({"train_dtype": "fp32"}, (
        "--actor.model_name_or_path /m/model --reward.remote_url DEMO --data.prompt_dataset /r/run.prompts.jsonl "
        "--data.input_key input --data.label_key label --data.apply_chat_template --data.max_len 152 "
        "--vllm.num_engines 1 --vllm.rollout_precision bf16 --algo.advantage.estimator group_norm "
        "--algo.kl.init_coef 0 --rollout.n_samples_per_prompt 2 --rollout.batch_size 4 --rollout.micro_batch_size 8 "
        "--rollout.max_new_tokens 24 --train.batch_size 8 --train.micro_batch_size 8 --train.num_episodes 1 "
        "--train.max_epochs 1 --train.seed 42 --ds.zero_stage 2 --actor.adam.lr 0.001 --actor.lr_warmup_ratio 0 "
        "--algo.correction.preset tis --ckpt.path /r/run/ckpt --ckpt.save_steps -1 --ckpt.output_dir /r/run/model "
        "--ds.param_dtype fp32 --logger.logging_steps 1 --logger.run_dir /r/run --eval.steps -1 "
        "--logger.token_dump_steps 1")),
    "eval_async_int8": ({
        "train_dtype": "bf16", "eval_prompts": "/data/eval.jsonl", "eval_samples": 3, "eval_every": 2,
        "async_queue": 2, "rollout_precision": "int8", "int8_weight_bits": "6", "reward": "/data/reward.py",
        "correction": "icepop", "correction_options": {"upper": 3, "lower": 0.5}, "extra_args": ["--vllm.fp32_lm_head"],
    }, (
        "--actor.model_name_or_path /m/model --reward.remote_url /data/reward.py --data.prompt_dataset "
        "/r/run.prompts.jsonl --data.input_key input --data.label_key label --data.apply_chat_template "
        "--data.max_len 152 --vllm.num_engines 1 --vllm.rollout_precision int8 --algo.advantage.estimator group_norm "
        "--algo.kl.init_coef 0 --rollout.n_samples_per_prompt 2 --rollout.batch_size 4 --rollout.micro_batch_size 8 "
        "--rollout.max_new_tokens 24 --train.batch_size 8 --train.micro_batch_size 8 --train.num_episodes 1 "
        "--train.max_epochs 1 --train.seed 42 --ds.zero_stage 2 --actor.adam.lr 0.001 --actor.lr_warmup_ratio 0 "
        "--algo.correction.preset icepop --ckpt.path /r/run/ckpt --ckpt.save_steps -1 --ckpt.output_dir "
        "/r/run/model --ds.param_dtype bf16 --logger.logging_steps 1 --logger.run_dir /r/run --eval.dataset "
        "/data/eval.jsonl --eval.steps 2 --eval.temperature 1.0 --eval.n_samples_per_prompt 3 --train.async_enable "
        "--train.async_queue_size 2 --logger.token_dump_steps 1 --vllm.int8_weight_bits 6 --algo.correction.upper 3 "
        "--algo.correction.lower 0.5 --vllm.fp32_lm_head")),
    "single_sample_no_dumps": ({
        "train_dtype": "fp32", "samples_per_prompt": 1, "prompts_per_step": 6, "steps": 3, "token_dump_every": 0,
        "eval_prompts": "/data/eval.jsonl", "lr": 2.5e-06, "seed": 7, "max_new_tokens": 64,
    }, (
        "--actor.model_name_or_path /m/model --reward.remote_url DEMO --data.prompt_dataset /r/run.prompts.jsonl "
        "--data.input_key input --data.label_key label --data.apply_chat_template --data.max_len 192 "
        "--vllm.num_engines 1 --vllm.rollout_precision bf16 --algo.advantage.estimator reinforce "
        "--algo.kl.init_coef 0 --rollout.n_samples_per_prompt 1 --rollout.batch_size 6 --rollout.micro_batch_size 6 "
        "--rollout.max_new_tokens 64 --train.batch_size 6 --train.micro_batch_size 6 --train.num_episodes 1 "
        "--train.max_epochs 1 --train.seed 7 --ds.zero_stage 2 --actor.adam.lr 2.5e-06 --actor.lr_warmup_ratio 0 "
        "--algo.correction.preset tis --ckpt.path /r/run/ckpt --ckpt.save_steps -1 --ckpt.output_dir /r/run/model "
        "--ds.param_dtype fp32 --logger.logging_steps 1 --logger.run_dir /r/run --eval.dataset /data/eval.jsonl "
        "--eval.steps 3 --eval.temperature 1.0 --eval.n_samples_per_prompt 1 --logger.token_dump_steps 0")),
}


@pytest.fixture(scope="module")
def parser():
    return train_ppo_ray.build_parser()


def _options(argv: list[str]) -> list[list[str]]:
    """argv as its options, each flag with the values that follow it."""
    groups: list[list[str]] = []
    for token in argv:
        if token.startswith("--"):
            groups.append([])
        groups[-1].append(token)
    return groups


def _argv(values: dict) -> list[str]:
    argv = TrainParams(**values).argv(MODEL, PROMPTS, RUN)
    assert argv[:3] == [sys.executable, "-m", "openrlhf_tis.cli.train_ppo_ray"]
    return argv[3:]


# Changed on purpose since: no "best" DeepSpeed checkpoint (2.1 GB a SmolLM2 run) when checkpoints are off.
ADDED = [["--ckpt.best_metric_key", "none"]]


@pytest.mark.parametrize("case", sorted(BEFORE))
def test_the_derived_command_is_the_one_the_hand_written_flags_built(case, parser):
    values, text = BEFORE[case]
    before = text.replace("DEMO", str(DEMO_REWARD)).split()
    now = _argv(values)
    extra = len(values.get("extra_args", []))
    # the same options, each with the same values, plus the deliberate additions
    assert sorted(_options(now)) == sorted(_options(before) + ADDED)
    assert now[len(now) - extra:] == before[len(before) - extra:]  # extra_args still last, so they still win
    added = [token for option in ADDED for token in option]
    assert vars(parser.parse_args(now)) == vars(parser.parse_args(added + before))


OTHER_DTYPE = {"bf16": "fp32", "fp32": "bf16"}[default_train_dtype("cpu")]  # not what train_dtype "auto" gives here
RESOLVED = {"model", "prompts", "run_dir"}  # argv() is handed these resolved, whatever the parameter says
# For every parameter with a flag: a value other than its default, and what the parser must read from it.
NON_DEFAULT = {
    "model": ("tiny", str(MODEL)),  # the resolved directory, whatever the name
    "prompts": ("", str(PROMPTS)),  # the run's own prompt file
    "reward": ("/x/reward.py", "/x/reward.py"),
    "correction": ("icepop", "icepop"),
    "correction_options": ({"upper": 3, "level": "sequence"}, {"upper": 3.0, "level": "sequence"}),
    "eval_prompts": ("/x/eval.jsonl", "/x/eval.jsonl"),
    "eval_samples": (4, 4),
    "eval_every": (5, 5),
    "rollout_precision": ("int8", "int8"),
    "int8_weight_bits": ("6", "6"),
    "train_dtype": (OTHER_DTYPE, OTHER_DTYPE),
    "prompts_per_step": (3, 3),
    "samples_per_prompt": (4, 4),
    "max_new_tokens": (17, 17),
    "lr": (2.5e-6, 2.5e-6),
    "seed": (9, 9),
    "async_queue": (3, 3),
    "sync_every": (4, 4),
    "routing_replay": ("r3", "r3"),
    "token_dump_every": (0, 0),
    "untrained_cache": ("/x/untrained", "/x/untrained"),
    "run_dir": ("elsewhere", str(RUN)),  # the resolved directory run_training hands over
}


def test_every_flagged_parameter_is_covered_here():
    assert set(NON_DEFAULT) == {name for name, p in SPEC.items() if p.flag is not None}
    assert {name for name, p in SPEC.items() if p.flag is None} == {
        "steps", "eval_kept", "extra_args", "refresh_seconds"}


@pytest.mark.parametrize("name", sorted(NON_DEFAULT))
def test_every_parameter_reaches_its_flag_through_the_real_parser(name, parser):
    value, expected = NON_DEFAULT[name]
    flag = SPEC[name].flag
    with_eval = {"eval_prompts": "/x/eval.jsonl"} if name in ("eval_samples", "eval_every") else {}
    args = vars(parser.parse_args(_argv({name: value, **with_eval})))
    dests = {option: a.dest for a in parser._actions for option in a.option_strings}
    if isinstance(value, dict):
        assert {key: args[dests[flag + key]] for key in value} == expected
    else:
        assert args[dests[flag]] == expected
        if name not in RESOLVED:  # the value took effect: the defaults give another
            assert vars(parser.parse_args(_argv(with_eval)))[dests[flag]] != expected


def test_every_correction_field_is_a_flag_of_the_parser(parser):
    options = {option for a in parser._actions for option in a.option_strings}
    fields = [f.name for f in dataclasses.fields(CorrectionConfig)]
    assert fields and all(FLAG_PREFIX + field in options for field in fields)


def test_correction_options_of_every_kind_reach_the_parser_as_given(parser):
    """A switch, a list and a number in correction_options become the flags the CLI parses back to the same values."""
    options = {"batch_normalize": True, "compile": False, "rejection": ["k3:mean:0.05", "ratio:mean:0.9:1.1"],
               "upper": 3, "denominator": "kept"}
    args = vars(parser.parse_args(_argv({"correction_options": options})))
    assert args["algo.correction.batch_normalize"] is True
    assert args["algo.correction.compile"] is None  # a switch left off: as the preset says
    assert args["algo.correction.rejection"] == options["rejection"] and args["algo.correction.upper"] == 3.0
    assert args["algo.correction.denominator"] == "kept"


@pytest.mark.parametrize(("values", "flag", "bad"), [
    ({"int8_weight_bits": "3", "rollout_precision": "int8"}, "--vllm.int8_weight_bits", "3"),
    ({"rollout_precision": "int4"}, "--vllm.rollout_precision", "int4"),
    ({"correction_options": {"mode": "cap"}}, "--algo.correction.mode", "cap"),
])
def test_a_notebook_value_is_refused_in_the_clis_own_words(parser, capsys, values, flag, bad):
    """The notebook's refusal and argparse's come from one declaration: the same sentence, before any command."""
    with pytest.raises(ParameterError) as notebook:
        TrainParams.checked(values)
    given = [flag, bad, *(["--vllm.rollout_precision", "int8"] if flag == "--vllm.int8_weight_bits" else [])]
    with pytest.raises(SystemExit):
        parser.parse_args(given)
    cli = capsys.readouterr().err.strip().splitlines()[-1]  # "...: error: argument FLAG: invalid choice: ..."
    assert cli.split(": error: argument ", 1)[1] in str(notebook.value)


def test_an_unknown_correction_option_is_refused_naming_it():
    with pytest.raises(ParameterError) as err:
        TrainParams.checked({"correction_options": {"upper": 3, "uper": 2}}, where="train")
    first = str(err.value).splitlines()[0]
    assert first.startswith("train: correction_options = ") and "'uper' is not a CorrectionConfig field" in first
    assert TrainParams.checked({"correction_options": {"upper": 3}}).correction_options == {"upper": 3}


def test_eval_every_minus_one_scores_only_the_kept_policy(parser):
    """-1: upstream never evaluates in the run (its --eval.steps -1), the held-out file still goes to the kept
    policy's scoring; below -1 is refused by the parameter's own check."""
    values = {"eval_prompts": "/x/eval.jsonl", "eval_every": -1}
    args = vars(parser.parse_args(_argv(values)))
    assert args["eval.steps"] == -1 and args["eval.dataset"] == "/x/eval.jsonl"
    assert TrainParams(**values).eval_file() is not None
    with pytest.raises(ParameterError, match="eval_every.*-1 \\(no in-run evaluation\\)"):
        TrainParams.checked({"eval_every": -2})
