"""Issue 21 for real (tiny model, Ray + DeepSpeed + vLLM, 1-3 steps per run): a second start into a live run's
directory is refused, a stale Ray address file does not capture the run, an overwritten run that crashed is
never resumed from the previous run's checkpoint, a killed run leaves no Ray process behind, and a sweep
stopped by Ctrl-C stops its training before it exits, says so in one line, and finishes the cell on the next run."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from _support import PREFIX, free_port, read_steps, train_argv, wait_for

from openrlhf_tis.cli.run_dir import lock_owner
from openrlhf_tis.demo.task import write_prompts
from openrlhf_tis.pipeline.sweep import STATUS_FILE, load_grid
from openrlhf_tis.runs import read_run_config, summary
from openrlhf_tis.runs.identity import read_checkpoint_identity

pytestmark = pytest.mark.e2e
STEPS = 2
SWEEP_STEPS = 16


@pytest.fixture()
def ray_tmpdir():
    """Ray's temp directory for these runs (short: Ray's socket paths must stay under 108 characters), holding a
    stale address file as `ray start` leaves one: a plain ray.init() would try to join that dead cluster."""
    path = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))
    (path / "ray").mkdir()
    (path / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{free_port()}")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _ray_processes(marker: Path) -> list[str]:
    """Command lines of the live processes that belong to a Ray session under `marker`."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if str(marker) in cmdline and proc.info["cmdline"] and "pytest" not in cmdline:
            found.append(cmdline[:160])
    return found


def _processes_naming(path: Path) -> list[str]:
    """Command lines of live processes that name `path` (a training CLI names its run directory)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if str(path) in cmdline and "pytest" not in cmdline and proc.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(cmdline[:160])
    return found


def _run_id(run: Path) -> str | None:
    return (read_run_config(run) or {}).get("run_id")


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr[-4000:]
    lines = proc.stderr.strip().splitlines()
    assert sum(PREFIX in line for line in lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    return lines[-1][len(PREFIX):]


def test_one_live_run_per_directory_and_no_resume_from_an_overwritten_history(tiny_model_dir, tmp_path, ray_tmpdir):
    work = tmp_path
    run = work / "run"
    write_prompts(work / "prompts.jsonl", 4 * STEPS)
    argv = train_argv(tiny_model_dir, work, STEPS, 0, save_steps=STEPS, load=False)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=str(ray_tmpdir), RAY_DEDUP_LOGS="0")

    with open(work / "first.log", "w") as log:
        first = subprocess.Popen(argv, cwd=work, stdout=log, stderr=subprocess.STDOUT, env=env,
                                 start_new_session=True)
        # The directory is locked from before Ray starts; the second start waits until Ray is up only so
        # that the two do not compete for the CPU while Ray's node starts (it times out on a loaded machine).
        assert wait_for(lambda: "Started a local Ray instance" in (work / "first.log").read_text(), first,
                        timeout=300), (work / "first.log").read_text()[-6000:]
        second = subprocess.run(argv, cwd=work, capture_output=True, text=True, env=env, timeout=300)
        assert first.poll() is None, "the first run ended before the second start was tried"
        line = _one_error_line(second)
        assert line == (f"--logger.run_dir: {run} is in use by another run (pid {first.pid}); wait for it to end, "
                        "stop it, or choose another --logger.run_dir")
        assert first.wait(timeout=900) == 0, (work / "first.log").read_text()[-6000:]
    assert [s["step"] for s in read_steps(run)] == [1, 2]
    first_id = read_run_config(run)["run_id"]
    assert read_checkpoint_identity(work / "ckpt" / "_actor" / f"global_step{STEPS}") == {"run_id": first_id,
                                                                                           "step": STEPS}

    with open(work / "overwrite.log", "w") as log:
        over = subprocess.Popen(argv + ["--logger.run_dir_overwrite"], cwd=work, stdout=log,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
        # The first run's steps stay in metrics.jsonl until the new start erases them: wait for the new identity.
        assert wait_for(lambda: _run_id(run) not in (None, first_id) and len(read_steps(run)) >= 1, over), \
            (work / "overwrite.log").read_text()[-6000:]
        os.killpg(over.pid, signal.SIGKILL)
        over.wait()
    assert [s["step"] for s in read_steps(run)] == [1]
    assert read_run_config(run)["run_id"] != first_id

    resumed = subprocess.run(argv + ["--ckpt.load_enable"], cwd=work, capture_output=True, text=True, env=env,
                             timeout=300)
    line = _one_error_line(resumed)  # the lock died with the killed run: refused for the checkpoint only
    assert line.startswith(f"--ckpt.load_enable: will not resume {run} from {work / 'ckpt' / '_actor'}: its "
                           f"checkpoint global_step{STEPS} was saved by run {first_id}"), line
    info = summary(run)
    assert info["planned_steps"] == STEPS and info["steps"] == 1 and info["missing_steps"] == STEPS - 1

    deadline = time.monotonic() + 30  # Ray's processes of the killed run go with it
    while _ray_processes(ray_tmpdir) and time.monotonic() < deadline:
        time.sleep(1)
    assert _ray_processes(ray_tmpdir) == []


def test_a_sweep_stopped_by_ctrl_c_finishes_its_cell_on_the_next_run(tiny_model_dir, tmp_path):
    grid = tmp_path / "grid.toml"
    # A tiny-model step takes ~0.7 s: enough steps that the Ctrl-C lands before the cell's last one.
    grid.write_text(f'[base]\nmodel = "{tiny_model_dir}"\nsteps = {SWEEP_STEPS}\nrefresh_seconds = 0.5\n'
                    '[grid]\nseed = [1]\n')
    out = tmp_path / "out"
    cell_dir = out / "cells" / load_grid(grid)[0].slug
    command = [sys.executable, "-m", "openrlhf_tis.pipeline.sweep", str(grid), str(out)]
    with open(tmp_path / "interrupted.log", "w") as log:
        sweep = subprocess.Popen(command, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        assert wait_for(lambda: len(read_steps(cell_dir / "run")) >= 1, sweep), \
            (tmp_path / "interrupted.log").read_text()[-6000:]
        os.killpg(sweep.pid, signal.SIGINT)  # what Ctrl-C sends: the terminal's foreground process group
        start = time.monotonic()
        code = sweep.wait(timeout=180)
    stop_seconds = time.monotonic() - start
    console = (tmp_path / "interrupted.log").read_text()
    interrupted_at = len(read_steps(cell_dir / "run"))
    assert 1 <= interrupted_at < SWEEP_STEPS and not (cell_dir / STATUS_FILE).exists()
    # The training stopped with the sweep, not after it: its directory is free, no process names it, no step follows.
    assert lock_owner(cell_dir / "run") is None and _processes_naming(cell_dir) == []
    time.sleep(5)  # several of the tiny model's steps
    assert len(read_steps(cell_dir / "run")) == interrupted_at
    # One line says what was stopped, what was kept and how to go on; no traceback, no DeadKernelError.
    assert code == 130 and "Traceback" not in console and "Task exception" not in console, console[-6000:]
    line = console.strip().splitlines()[-1]
    assert line.startswith("openrlhf-tis-sweep: interrupted in cell seed=1 (1 of 1; 0 done before it): stopped "
                           "openrlhf_tis.cli.train_ppo_ray (pid "), line
    again, metrics = shlex.join(["openrlhf-tis-sweep", str(grid), str(out)]), cell_dir / "run" / "metrics.jsonl"
    logged = "step 1" if interrupted_at == 1 else f"steps 1-{interrupted_at}"
    assert (f"; kept: {logged} of {SWEEP_STEPS} in {metrics}, no checkpoint; "
            f"{again} goes on (done cells are skipped, this one starts afresh, this attempt kept as run.attempt1)"
            ) in line, line
    print(f"Ctrl-C to exit: {stop_seconds:.1f} s")

    rerun = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert rerun.returncode == 0, (rerun.stdout + rerun.stderr)[-6000:]
    assert [s["step"] for s in read_steps(cell_dir / "run")] == list(range(1, SWEEP_STEPS + 1))
    assert len(read_steps(cell_dir / "run.attempt1")) == interrupted_at  # the interrupted attempt is kept
    assert "complete" in rerun.stdout and (out / "report.html").is_file()
