"""No run is wasted: every input that can be checked without Ray is refused before it starts,
in one line naming the flag or file; run directories are never overwritten by accident; the calibration
command and the run-store readers turn bad input into clear errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
from _support import error_line, finished_run, refused, run_dir, with_value

from openrlhf_tis.cli import train_ppo_ray
from openrlhf_tis.cli.batch_checks import check_batches
from openrlhf_tis.errors import UsageError
from openrlhf_tis.runs import cli as runs_cli
from openrlhf_tis.runs import list_runs, load_metrics, query_tokens, read_run_config, summary, token_steps
from openrlhf_tis.runs.identity import write_checkpoint_identity
from openrlhf_tis.runs.layout import token_file

# --- prompt files --------------------------------------------------------------------------------------

@pytest.mark.parametrize(("content", "flag", "expected"), [
    ("", "--data.prompt_dataset", "holds no prompts"),
    ("\n  \n\n", "--data.prompt_dataset", "holds no prompts"),
    ('{"input": "a"}\n{"input": "b",}\n', "--data.prompt_dataset", "p.jsonl:2: not valid JSON"),
    ('{"input": "a"}\n["b"]\n', "--data.prompt_dataset", "p.jsonl:2: a JSON list, not an object"),
    ('{"input": "a"}\n\n{"question": "b"}\n', "--data.input_key", "p.jsonl:3 has no key 'input' (its keys: 'que"),
    ('{"input": null}\n', "--data.input_key", "p.jsonl:1 has null for key 'input'"),
])
def test_bad_prompt_file_is_refused_naming_file_line_and_flag(valid_argv, tmp_path, capsys, content, flag, expected):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(content)
    line = error_line(refused(with_value(valid_argv, "--data.prompt_dataset", str(prompts)), capsys))
    assert line.startswith(flag + ": ") and expected in line, line
    assert not run_dir(valid_argv).exists()  # a refused start leaves nothing behind


def test_label_key_and_eval_dataset_are_checked_too(valid_argv, tmp_path, capsys):
    line = error_line(refused(valid_argv + ["--data.label_key", "answer"], capsys))
    assert line.startswith("--data.label_key: ") and "has no key 'answer'" in line
    bad_eval = tmp_path / "eval.jsonl"
    bad_eval.write_bytes(b'{"input": "caf\xe9"}\n')  # latin-1, not UTF-8
    line = error_line(refused(valid_argv + ["--eval.dataset", str(bad_eval)], capsys))
    assert line.startswith("--eval.dataset: ") and "not UTF-8" in line


def test_json_csv_and_parquet_files_are_read_whole(valid_argv, tmp_path, capsys):
    as_array = tmp_path / "p.json"
    as_array.write_text(json.dumps([{"input": "1 + 1?", "label": "2"}, {"input": "2 + 2?", "label": "4"}]))
    args = train_ppo_ray.parse(with_value(valid_argv, "--data.prompt_dataset", str(as_array)), cpu=True)
    assert getattr(args, "data.prompt_dataset") == str(as_array)
    csv_file = tmp_path / "p.csv"
    csv_file.write_text("question,label\n1 + 1?,2\n")
    line = error_line(refused(with_value(valid_argv, "--data.prompt_dataset", str(csv_file)), capsys))
    assert line.startswith("--data.input_key: ") and "'question'" in line
    parquet = tmp_path / "p.parquet"
    pq.write_table(pa.table({"input": ["1 + 1?", "3 + 4?"], "answer": ["2", "7"]}), parquet)
    argv = with_value(valid_argv, "--data.prompt_dataset", str(parquet))
    line = error_line(refused(argv + ["--data.label_key", "label"], capsys))
    assert line.startswith("--data.label_key: ") and f"{parquet} record 1 has no key 'label'" in line
    train_ppo_ray.parse(argv + ["--data.label_key", "answer", "--logger.run_dir_overwrite"], cpu=True)


@pytest.mark.parametrize("name, body", [
    ("p.jsonl", '{"input": "1 + 1?", "label": "2"}\n{"input": "2 + 2?", "label": "4"}\n'),
    ("p.json", '[{"input": "1 + 1?", "label": "2"}]'),
    ("p.csv", "input,label\none,two\n"),
])
def test_a_file_with_a_utf8_bom_is_read_as_upstreams_loader_reads_it(valid_argv, tmp_path, name, body):
    """Windows editors write a BOM; `datasets` (upstream's loader, the reference here) reads past it."""
    from datasets import load_dataset

    from openrlhf_tis.prompt_files import prompt_records

    path = tmp_path / name
    path.write_bytes(b"\xef\xbb\xbf" + body.encode())
    upstream = load_dataset("csv" if name.endswith(".csv") else "json", data_files=str(path), split="train",
                            cache_dir=str(tmp_path / "cache"))
    assert [record for _, record in prompt_records(str(path))] == upstream.to_list()
    train_ppo_ray.parse(with_value(valid_argv, "--data.prompt_dataset", str(path)), cpu=True)


# --- batch arithmetic and sampling choices -------------------------------------------------------------

@pytest.mark.parametrize(("extra", "flag", "expected"), [
    (["--train.batch_size", "6", "--train.micro_batch_size", "4"], "--train.batch_size", "multiple of"),
    # two actor processes: 4 is not a multiple of micro 4 x 2 data-parallel
    (["--actor.num_gpus_per_node", "2", "--train.batch_size", "4", "--train.micro_batch_size", "4"],
     "--train.batch_size", "= 8"),
    (["--actor.num_gpus_per_node", "2", "--rollout.batch_size", "1", "--train.batch_size", "2"],
     "--rollout.micro_batch_size", "1 samples for 2 process(es)"),
    (["--train.micro_batch_size", "0"], "--train.micro_batch_size", "must be >= 1"),
    (["--algo.advantage.estimator", "group_norm"], "--rollout.n_samples_per_prompt", "at least 2"),
    (["--algo.dynamic_filtering_enable", "--rollout.n_samples_per_prompt", "2", "--algo.dynamic_filtering_range",
      "1", "0"], "--algo.dynamic_filtering_range", "LOW < HIGH"),
    (["--rollout.vllm_generate_batch_size", "2048"], "--rollout.vllm_generate_batch_size", "--train.async_enable"),
    (["--data.max_samples", "0"], "--data.max_samples", "must be >= 1, got 0"),  # regression: Ray started
    (["--data.max_samples", "-5"], "--data.max_samples", "must be >= 1, got -5"),
])
def test_batch_arithmetic_is_refused_before_ray(valid_argv, capsys, extra, flag, expected):
    line = error_line(refused(valid_argv + extra, capsys))
    assert line.startswith(flag + ": ") and expected in line, line


class _UpstreamAccepted(Exception):
    pass


def _upstream_refuses(argv: list[str], monkeypatch) -> bool:
    """Reference: run upstream's own __main__ checks; its train() starts with ray.init, stopped here."""
    from openrlhf_tis.patches.upstream_cli import run_upstream_main

    def stop(*_args, **_kwargs):
        raise _UpstreamAccepted

    monkeypatch.setattr(ray, "init", stop)
    try:
        run_upstream_main(train_ppo_ray.build_parser().parse_args(argv))
    except AssertionError:
        return True
    except _UpstreamAccepted:
        return False
    raise AssertionError("upstream neither refused nor started")


@pytest.mark.parametrize("flag, value, never", [("--ckpt.save_steps", "0", True), ("--ckpt.save_steps", "-3", True),
                                               ("--eval.steps", "0", True), ("--logger.logging_steps", "0", False),
                                               ("--logger.logging_steps", "-1", False)])
def test_a_step_cadence_upstream_would_divide_by_zero_with_is_refused(valid_argv, capsys, flag, value, never):
    """`--ckpt.save_steps 0` passed and the run died after step 1 with ZeroDivisionError (upstream: step % N)."""
    line = error_line(refused(valid_argv + [flag, value], capsys))
    assert line == f"{flag}: must be >= 1 (every N steps){' or -1 (never)' if never else ''}, got {value}"


def test_step_cadences_upstream_takes_pass(valid_argv):
    train_ppo_ray.parse(valid_argv + ["--ckpt.save_steps", "-1", "--eval.steps", "3", "--logger.logging_steps", "2"],
                        cpu=True)


@pytest.mark.parametrize("estimator", ["group_norm", "rloo", "reinforce_baseline", "dr_grpo", "reinforce", "gae"])
@pytest.mark.parametrize(("samples", "rollout_batch", "rollout_micro", "gpus"),
                         [(1, 4, 1, 1), (2, 4, 1, 1), (2, 1, 4, 2), (1, 2, 1, 2), (2, 3, 2, 2)])
def test_fork_refuses_exactly_what_upstream_asserts(estimator, samples, rollout_batch, rollout_micro, gpus,
                                                    monkeypatch):
    argv = ["--algo.advantage.estimator", estimator, "--rollout.n_samples_per_prompt", str(samples),
            "--rollout.batch_size", str(rollout_batch), "--rollout.micro_batch_size", str(rollout_micro),
            "--actor.num_gpus_per_node", str(gpus), "--train.batch_size", "8", "--reward.remote_url", "r.py",
            "--actor.model_name_or_path", "m", "--data.prompt_dataset", "p.jsonl"]
    try:
        check_batches(train_ppo_ray.build_parser().parse_args(argv))
        fork_refuses = False
    except UsageError:
        fork_refuses = True
    assert fork_refuses == _upstream_refuses(argv, monkeypatch)


# --- the reward script, tried on the first real prompt -------------------------------------------------

def _reward(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "reward.py"
    path.write_text("import math\n\n\ndef reward_func(queries, prompts, labels):\n" + body + "\n")
    return path


@pytest.mark.parametrize(("body", "expected"), [
    ("    return 1 / 0", "raised ZeroDivisionError: division by zero at reward.py:5"),
    ("    return {}", "returned no 'rewards'"),
    ("    return [1.0]", "returned a list, not a dict"),
    ("    return {'rewards': [1.0, 2.0]}", "returned 2 rewards for 1 query"),
    ("    return {'rewards': 'high'}", "not numbers"),
])
def test_broken_reward_script_is_refused_before_ray(valid_argv, tmp_path, capsys, body, expected):
    argv = with_value(valid_argv, "--reward.remote_url", str(_reward(tmp_path, body)))
    line = error_line(refused(argv, capsys))
    assert line.startswith("--reward.remote_url: ") and expected in line, line


def test_reward_script_that_fails_to_import_is_refused(valid_argv, tmp_path, capsys):
    path = tmp_path / "reward.py"
    path.write_text("import no_such_module_here\n\n\ndef reward_func(queries, prompts, labels):\n    return {}\n")
    line = error_line(refused(with_value(valid_argv, "--reward.remote_url", str(path)), capsys))
    assert "fails to import: ModuleNotFoundError" in line and "reward.py:1" in line


def test_the_start_says_it_imports_the_reward_script_before_it_does(valid_argv, tmp_path, capsys):
    """A script that takes a minute to import must not leave the console silent (a regression)."""
    path = tmp_path / "slow_reward.py"
    path.write_text("import sys\nprint('IMPORTING', file=sys.stderr)\n\n\n"
                    "def reward_func(queries, prompts, labels):\n    return {'rewards': [0.0]}\n")
    train_ppo_ray.parse(with_value(valid_argv, "--reward.remote_url", str(path)), cpu=True)
    err = capsys.readouterr().err.splitlines()
    said = [i for i, line in enumerate(err) if line.startswith("[openrlhf_tis] --reward.remote_url: importing ")]
    assert len(said) == 1 and str(path) in err[said[0]] and said[0] < err.index("IMPORTING"), err


def test_reward_script_is_called_as_upstream_calls_it(valid_argv, tmp_path, capsys):
    seen = tmp_path / "seen.json"
    body = f"    open({str(seen)!r}, 'w').write(__import__('json').dumps([queries, prompts, labels]))\n" \
           "    return {'rewards': math.nan}"
    argv = with_value(valid_argv, "--reward.remote_url", str(_reward(tmp_path, body)))
    train_ppo_ray.parse(argv + ["--data.label_key", "label", "--data.input_template", "Q: {} A:"], cpu=True)
    # conftest's prompt file: {"input": "1 + 1?", "label": "2"}, formatted by the template
    assert json.loads(seen.read_text()) == [["Q: 1 + 1? A:"], ["Q: 1 + 1? A:"], ["2"]]
    assert "returned nan for the first prompt" in capsys.readouterr().err  # warned, not refused


# --- run directories -----------------------------------------------------------------------------------

def test_run_with_steps_is_never_overwritten_by_accident(valid_argv, tmp_path, capsys):
    path = finished_run(valid_argv)
    before = (path / "metrics.jsonl").read_bytes()
    line = error_line(refused(valid_argv, capsys))
    assert line.startswith("--logger.run_dir: ") and "already holds 2 step(s)" in line
    assert "--ckpt.load_enable" in line and "--logger.run_dir_overwrite" in line
    ckpt = tmp_path / "ckpt"
    resume = valid_argv + ["--ckpt.load_enable", "--ckpt.path", str(ckpt)]
    line = error_line(refused(resume, capsys))  # no checkpoint: upstream would restart at step 0
    assert line.startswith("--ckpt.load_enable: ") and "no checkpoint" in line and "--ckpt.path" in line
    assert (path / "metrics.jsonl").read_bytes() == before and token_file(path, 2).exists()

    (ckpt / "_actor").mkdir(parents=True)
    (ckpt / "_actor" / "latest").write_text("global_step2")
    write_checkpoint_identity(ckpt / "_actor" / "global_step2", read_run_config(path)["run_id"], 2)  # as saved
    train_ppo_ray.parse(resume, cpu=True)  # a real resume goes on
    assert (path / "metrics.jsonl").read_bytes() == before and len(read_run_config(path)["resumes"]) == 1
    line = error_line(refused(resume + ["--logger.run_dir_overwrite"], capsys))
    assert line.startswith("--logger.run_dir_overwrite: ") and "pass one of them" in line


def test_overwrite_erases_only_the_run_store(valid_argv, capsys):
    path = finished_run(valid_argv)
    old_time = read_run_config(path)["time"]
    train_ppo_ray.parse(valid_argv + ["--logger.run_dir_overwrite", "--train.seed", "7"], cpu=True)
    assert "erased 2 step(s)" in capsys.readouterr().err
    assert not (path / "metrics.jsonl").exists() and not (path / "tokens").exists()
    config = read_run_config(path)
    assert config["config"]["train.seed"] == 7 and config["resumes"] == [] and config["time"] >= old_time
    assert (path / "train.log").read_text() == "log"


def test_a_start_that_never_trained_blocks_nothing(valid_argv):
    train_ppo_ray.parse(valid_argv, cpu=True)  # config.json written, then the start failed (no step)
    path = run_dir(valid_argv)
    assert (path / "config.json").is_file()
    train_ppo_ray.parse(valid_argv + ["--train.seed", "7"], cpu=True)  # the corrected command
    assert read_run_config(path)["config"]["train.seed"] == 7


def test_a_model_directory_as_run_dir_is_refused_and_left_byte_identical(valid_argv, tiny_model_dir, tmp_path,
                                                                         capsys):
    """A copied HF model (its config.json, no metrics.jsonl) was taken for a start that never trained and its
    config.json replaced by the run's before Ray started."""
    from transformers import AutoConfig

    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model)
    before = {p.name: p.read_bytes() for p in model.iterdir()}
    line = error_line(refused(with_value(valid_argv, "--logger.run_dir", str(model)), capsys))
    assert line == (f"--logger.run_dir: {model} holds a config.json that no run of this fork wrote (a model's or a "
                    "project's directory?); it is left untouched: choose a new or empty --logger.run_dir")
    assert {p.name: p.read_bytes() for p in model.iterdir()} == before  # not one file added, changed or removed
    assert AutoConfig.from_pretrained(model).vocab_size == AutoConfig.from_pretrained(tiny_model_dir).vocab_size
    overwrite = with_value(valid_argv, "--logger.run_dir", str(model)) + ["--logger.run_dir_overwrite"]
    assert "no run of this fork wrote" in error_line(refused(overwrite, capsys))
    assert {p.name: p.read_bytes() for p in model.iterdir()} == before


@pytest.mark.parametrize("strays", [{"metrics.jsonl": '{"step": 1}\n'}, {"config.json": "not json"},
                                    {"config.json": '{"fingerprint": "x", "config": {}}'}])
def test_run_store_files_the_fork_cannot_vouch_for_are_refused_and_kept(valid_argv, capsys, strays):
    path = run_dir(valid_argv)
    path.mkdir()
    for name, text in strays.items():
        (path / name).write_text(text)
    line = error_line(refused(valid_argv + ["--logger.run_dir_overwrite"], capsys))
    assert line.startswith(f"--logger.run_dir: {path} holds ") and line.endswith("choose a new or empty "
                                                                                 "--logger.run_dir")
    assert {p.name: p.read_text() for p in path.iterdir()} == strays


def test_a_directory_with_unrelated_files_only_is_a_new_run_and_they_stay(valid_argv):
    path = run_dir(valid_argv)
    path.mkdir()
    (path / "notes.txt").write_text("mine")
    train_ppo_ray.parse(valid_argv, cpu=True)
    assert (path / "notes.txt").read_text() == "mine" and read_run_config(path)["resumes"] == []


def test_run_dir_that_cannot_be_a_directory_is_refused(valid_argv, tmp_path, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    line = error_line(refused(with_value(valid_argv, "--logger.run_dir", str(a_file)), capsys))
    assert line == f"--logger.run_dir: {a_file} exists and is not a directory"
    line = error_line(refused(with_value(valid_argv, "--logger.run_dir", str(a_file / "run")), capsys))
    assert line.startswith(f"--logger.run_dir: cannot create {a_file / 'run'}")


@pytest.mark.parametrize("flag, extra", [
    ("--ckpt.output_dir", []),
    ("--ckpt.path", ["--ckpt.save_steps", "1"]),  # checked only when the run saves checkpoints
    ("--logger.tensorboard_dir", []),
])
def test_an_output_directory_under_a_regular_file_is_refused(valid_argv, tmp_path, capsys, flag, extra):
    """FILE/model: no directory can ever be made there, however writable the directory above FILE is."""
    a_file = tmp_path / "file"
    a_file.write_text("x")
    line = error_line(refused([*valid_argv, *extra, flag, str(a_file / "model")], capsys))
    assert line == f"{flag}: {a_file / 'model'} cannot be created: {a_file} is a file, not a directory"


# --- the calibration command ---------------------------------------------------------------------------

def _calibrate(argv: list[str], capsys) -> str:
    from openrlhf_tis.rollout.calibration import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_calibration_refuses_bad_inputs_in_one_line(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "cal.safetensors"
    prompts = tmp_path / "p.jsonl"

    def argv(**changes):
        values = {"--model": str(tiny_model_dir), "--prompts": str(prompts), "--out": str(out), **changes}
        return [item for pair in values.items() for item in pair]

    cases = [
        ("", {}, "--prompts: ", "holds no prompts"),
        ('{"input": "a"}\n{oops\n', {}, "--prompts: ", "p.jsonl:2: not valid JSON"),
        ('{"question": "a"}\n', {}, "--input_key: ", "has no key 'input'"),
        ('{"input": [{"role": "user"}]}\n', {}, "--input_key: ", "holds a list, not a prompt text"),
        ('{"input": "a"}\n', {"--model": str(tmp_path / "none")}, "--model: ", "does not exist"),
        ('{"input": "a"}\n', {"--alpha": "2"}, "--alpha: ", "[0, 1]"),
        ('{"input": "a"}\n', {"--max_prompts": "0"}, "--max_prompts: ", ">= 1"),
        ('{"input": "a"}\n', {"--out": str(tmp_path / "no" / "cal.safetensors")}, "--out: ", "does not exist"),
        ('{"input": "a"}\n', {"--model": str(tmp_path)}, "--model: ", "without config.json"),
    ]
    for content, changes, flag, expected in cases:
        prompts.write_text(content)
        err = _calibrate(argv(**changes), capsys)
        assert f"error: {flag}" in err and expected in err, (content, changes, err)
        assert not out.exists()


def test_calibration_command_refuses_an_empty_prompt_file_in_a_fresh_process(tiny_model_dir, tmp_path):
    (tmp_path / "p.jsonl").write_text("\n")
    proc = subprocess.run([sys.executable, "-m", "openrlhf_tis.rollout.calibration", "--model", str(tiny_model_dir),
                           "--prompts", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "cal.safetensors")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "error: --prompts: " in proc.stderr and "holds no prompts" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "cal.safetensors").exists()


def test_training_refuses_a_calibration_made_on_no_prompts(valid_argv, tiny_model_dir, tmp_path, capsys):
    from openrlhf_tis.rollout.calibration_file import Calibration, save_calibration
    from openrlhf_tis.rollout.checkpoint import read_config

    cal = save_calibration(tmp_path / "cal.safetensors", Calibration({}), read_config(tiny_model_dir), 0.5, 0)
    line = error_line(refused(valid_argv + ["--vllm.rollout_precision", "int8", "--vllm.int8_calibration", str(cal)],
                              capsys))
    assert line.startswith("--vllm.int8_calibration: ") and "calibrated on no prompts" in line


# --- the run-store readers -----------------------------------------------------------------------------

def test_readers_name_a_missing_path(tmp_path, capsys):
    missing = tmp_path / "no_such_run"
    for read in (load_metrics, query_tokens, summary, list_runs):
        with pytest.raises(FileNotFoundError, match=str(missing)):
            read(missing)
    with pytest.raises(FileNotFoundError, match=str(missing)):
        query_tokens([tmp_path, missing])
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(NotADirectoryError, match=str(a_file)):
        load_metrics(a_file)
    assert load_metrics(tmp_path).empty and token_steps(tmp_path) == []  # a run before its first step
    assert runs_cli.main(["list", str(missing)]) == 2
    assert "does not exist" in capsys.readouterr().out
