"""The fork's CLI: every upstream flag unchanged, and bad input refused before Ray starts."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
from _support import refused

from openrlhf_tis.cli import train_ppo_ray
from openrlhf_tis.cli.checks import explicit_dests
from openrlhf_tis.cli.resolve import CPU_DEFAULTS
from openrlhf_tis.patches.upstream_cli import upstream_parser


@pytest.fixture(scope="module")
def parsers():
    return upstream_parser(), train_ppo_ray.build_parser()


def _sample_argv(action: argparse.Action) -> list[str]:
    """A valid, non-default value for one upstream option."""
    flag = action.option_strings[0]
    if action.nargs == 0:
        return [flag]
    if action.choices:
        value = [c for c in action.choices if c != action.default][0]
    elif action.type is int:
        value = 3
    elif action.type is float:
        value = 0.25
    else:
        value = "some_value"
    count = {"+": 2, "*": 2, None: 1, "?": 1}.get(action.nargs, action.nargs)
    return [flag, *[str(value)] * count]


def test_every_upstream_flag_is_accepted_unchanged(parsers):
    upstream, fork = parsers
    options = [a for a in upstream._actions if a.option_strings and a.dest != "help"]
    assert len(options) > 150  # upstream 0.11.2 has ~170: a capture that lost flags must fail here
    for action in options:
        argv = _sample_argv(action)
        expected = vars(upstream.parse_args(argv))
        got = vars(fork.parse_args(argv))
        assert {k: got[k] for k in expected} == expected, argv


def test_explicit_flags_are_told_from_defaults(parsers):
    _, fork = parsers
    argv = ["--ds.attn_implementation", "flash_attention_2", "--vllm.enforce_eager", "--train.seed", "42"]
    assert explicit_dests(fork, argv) == {"ds.attn_implementation", "vllm.enforce_eager", "train.seed"}


@pytest.mark.parametrize(
    ("extra", "flag"),
    [
        (["--ds.param_dtype", "fp16"], "--ds.param_dtype"),
        (["--ds.attn_implementation", "flash_attention_2"], "--ds.attn_implementation"),
        (["--vllm.sync_backend", "nccl"], "--vllm.sync_backend"),
        (["--train.colocate_all"], "--train.colocate_all"),
        (["--vllm.enable_sleep"], "--vllm.enable_sleep"),
        (["--vllm.sync_check_steps", "-1"], "--vllm.sync_check_steps"),
    ],
)
def test_gpu_only_choices_are_refused_on_cpu(valid_argv, extra, flag, capsys):
    assert flag in refused(valid_argv + extra, capsys)


def test_missing_inputs_name_their_flag(valid_argv, tmp_path, capsys):
    def with_value(flag, value):
        argv = list(valid_argv)
        argv[argv.index(flag) + 1] = value
        return argv

    err = refused(with_value("--actor.model_name_or_path", str(tmp_path / "nope")), capsys)
    assert "--actor.model_name_or_path" in err and "does not exist" in err
    err = refused(with_value("--reward.remote_url", str(tmp_path / "missing.py")), capsys)
    assert "--reward.remote_url" in err
    no_func = tmp_path / "no_func.py"
    no_func.write_text("def other():\n    pass\n")
    assert "reward_func" in refused(with_value("--reward.remote_url", str(no_func)), capsys)
    err = refused(with_value("--data.prompt_dataset", str(tmp_path / "missing.jsonl")), capsys)
    assert "--data.prompt_dataset" in err


def test_unsupported_upstream_version_is_refused(valid_argv, monkeypatch, capsys):
    import importlib.metadata

    real_version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "0.10.0" if name == "openrlhf" else real_version(name))
    err = refused(valid_argv, capsys)
    assert "openrlhf==0.11.2" in err and "0.10.0" in err


def test_cpu_defaults_replace_unset_gpu_defaults(parsers):
    from openrlhf_tis.cli.resolve import cpu_replacements

    _, fork = parsers
    args = fork.parse_args(["--ds.attn_implementation", "eager"])
    before = vars(args).copy()
    replaced = cpu_replacements(args, explicit_dests(fork, ["--ds.attn_implementation", "eager"]))
    assert vars(args) == before  # a check: what it decides is the run spec's to apply
    assert "ds.attn_implementation" not in replaced  # the user's choice stays
    for dest, value in CPU_DEFAULTS.items():
        if dest != "ds.attn_implementation":
            assert replaced.get(dest, before[dest]) == value


def test_console_entry_point_refuses_in_a_fresh_process(tmp_path):
    """The real command, as a user runs it: one clear line, exit 2, no Ray."""
    proc = subprocess.run(
        [sys.executable, "-m", "openrlhf_tis.cli.train_ppo_ray", "--actor.model_name_or_path", str(tmp_path / "x")],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2
    assert "error: --actor.model_name_or_path" in proc.stderr
    assert "Started a local Ray instance" not in proc.stderr + proc.stdout


def test_run_dir_is_made_absolute_for_every_process(valid_argv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = list(valid_argv)
    argv[argv.index("--logger.run_dir") + 1] = "relative_run"
    args = train_ppo_ray.parse(argv, cpu=True)
    assert getattr(args, "logger.run_dir") == str(tmp_path / "relative_run")
    assert (tmp_path / "relative_run" / "config.json").is_file()


def test_the_spec_carries_the_reward_limits_and_the_staleness_bound(parsers):
    """What the controller reads of the reward flags and the async lag bound is the run spec's, decided once."""
    from openrlhf_tis.cli.cluster_device import assumed_cluster
    from openrlhf_tis.cli.resolve import resolve
    from openrlhf_tis.run_spec import RewardPlan, StalenessPlan

    _, fork = parsers
    argv = ["--reward.timeout_s", "7.5", "--reward.nonfinite", "drop", "--train.async_enable",
            "--train.async_max_lag", "2"]
    spec = resolve(fork.parse_args(argv), explicit_dests(fork, argv), assumed_cluster(cuda=False))
    assert (spec.reward, spec.staleness) == (RewardPlan(timeout_s=7.5, nonfinite="drop"), StalenessPlan(max_lag=2))
    default = resolve(fork.parse_args([]), set(), assumed_cluster(cuda=False))
    assert (default.reward.nonfinite, default.staleness.max_lag) == ("fail", None)
    assert default.reward.timeout_s == fork.get_default("reward.timeout_s") > 0
