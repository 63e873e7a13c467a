"""Ctrl-C in the main job and in a sweep (pipeline/interrupt.py), by a real SIGINT to a real command: the training
under it ends before the command does, and the command ends in one line saying what was stopped, what was kept and
how to go on. The notebook's kernel and its training are stand-ins with the real process layout (kernel and
training each in a session of their own, a worker under the training that writes metrics.jsonl and goes when the
training goes, as Ray's actors go with their driver), so the test runs in seconds instead of a training's minutes;
the real training under a real sweep is tests/test_notebooks_e2e.py's."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from _support import sigint_as_in_a_shell, wait_for

from openrlhf_tis.cli.lifetime import stop_process_tree
from openrlhf_tis.cli.run_dir import lock_owner
from openrlhf_tis.pipeline.sweep import load_grid
from openrlhf_tis.runs import RunWriter
from openrlhf_tis.runs.identity import write_checkpoint_identity

STEPS = 50
REPO = Path(__file__).resolve().parent.parent

# `python -m fake ROLE RUN_DIR`: each role writes its pid to RUN_DIR/../pids/ROLE.
FAKE = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    from pathlib import Path

    role, run_dir = sys.argv[1], Path(sys.argv[2])
    pids = run_dir.parent / "pids"
    pids.mkdir(parents=True, exist_ok=True)
    (pids / role).write_text(str(os.getpid()))

    def start(child_role, **kwargs):
        return subprocess.Popen([sys.executable, "-m", "fake", child_role, str(run_dir)], **kwargs)

    if role == "kernel":  # papermill's kernel running train.ipynb's training cell (pipeline/train.py)
        training = start("training", start_new_session=True)
        sys.exit(1 if training.wait() else 0)  # the cell fails when its training does
    if role == "training":  # the training CLI: owns the run directory; SIGTERM ends it as Ray's driver handler does
        from openrlhf_tis.cli.lifetime import PARENT_ENV
        from openrlhf_tis.cli.run_dir import lock_run_dir

        run_dir.mkdir(parents=True, exist_ok=True)
        lock_run_dir(run_dir)
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))
        start("worker", env={**os.environ, PARENT_ENV: str(os.getpid())}).wait()
    if role == "worker":  # the controller actor that logs the steps; it goes with its driver
        from openrlhf_tis.cli.lifetime import die_with_parent
        from openrlhf_tis.runs import RunWriter

        die_with_parent()
        writer = RunWriter(run_dir)
        for step in range(1, 1000):
            writer.append_metrics(step, {"reward": 0.0})
            time.sleep(0.3)
""")

# The command itself, with papermill's execution replaced by the stand-in kernel (and the main job's check of the
# training flags, which imports upstream, skipped).
COMMAND = textwrap.dedent("""
    import subprocess, sys
    from openrlhf_tis.pipeline import interrupt, main_job, sweep

    def execute(name, output, parameters, cwd):
        kernel = subprocess.Popen([sys.executable, "-m", "fake", "kernel", parameters["run_dir"]],
                                  start_new_session=True)
        if kernel.wait():
            raise RuntimeError("the training cell failed")
        return output

    interrupt.execute = execute
    main_job.check_training_command = lambda params, cluster=None: None
    (main_job if sys.argv[1] == "main_job" else sweep).main(sys.argv[2:])
""")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


@pytest.mark.parametrize("command", ["main_job", "sweep"])
def test_ctrl_c_stops_the_training_and_says_in_one_line_what_was_kept(command, tmp_path):
    (tmp_path / "fake.py").write_text(FAKE)
    out = tmp_path / "out"
    if command == "main_job":
        run_dir = out / "runs" / "r"
        argv = ["--out", str(out), "--model", "tiny", "--set", f"run_dir={run_dir}", "--set", f"steps={STEPS}"]
    else:
        grid = tmp_path / "grid.toml"
        grid.write_text(f'[base]\nmodel = "tiny"\nsteps = {STEPS}\n[grid]\nseed = [1]\n')
        run_dir = out / "cells" / load_grid(grid)[0].slug / "run"
        argv = [str(grid), str(out)]
    # the stand-ins, and this checkout (the command runs in tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", COMMAND, command, *argv], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=sigint_as_in_a_shell)
    try:
        assert wait_for(lambda: _steps(run_dir) >= 2, proc, timeout=120), proc.communicate()
        pids = {role: int((run_dir.parent / "pids" / role).read_text()) for role in ("kernel", "training", "worker")}
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C sends: the terminal's foreground process group
        start = time.monotonic()
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    seconds = time.monotonic() - start
    logged = _steps(run_dir)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and "Task exception" not in stderr, stderr
    assert [role for role, pid in pids.items() if _alive(pid)] == []  # the training ended before the command
    assert lock_owner(run_dir) is None
    time.sleep(1.0)  # three of the worker's steps: none comes after the command said it stopped
    assert _steps(run_dir) == logged and seconds < 30
    line = stderr.strip().splitlines()[-1]
    kept = (f"stopped fake (pid {pids['training']}); kept: steps 1-{logged} of {STEPS} in {run_dir / 'metrics.jsonl'}, "
            "no checkpoint; ")
    if command == "main_job":
        assert stderr.strip().splitlines()[0].startswith("[main job] ") and len(stderr.strip().splitlines()) == 2
        assert line == (f"main_job: interrupted: {kept}it cannot be resumed (the main job saves checkpoints only "
                        "when given --ckpt.save_steps N); start it again with: "
                        f"{shlex.join([sys.executable, '-m', 'openrlhf_tis.pipeline.main_job', *argv])}"), line
    else:
        again = shlex.join(["openrlhf-tis-sweep", str(grid), str(out)])
        assert line == (f"openrlhf-tis-sweep: interrupted in cell seed=1 (1 of 1; 0 done before it): {kept}{again} "
                        "goes on (done cells are skipped, this one starts afresh, this attempt kept as run.attempt1)")
        assert not (run_dir.parent / "status.json").exists()  # interrupted, not failed: the next sweep retries it


def test_the_main_jobs_account_gives_the_resume_command_when_a_checkpoint_of_the_run_exists(tmp_path):
    from openrlhf_tis.pipeline.interrupt import Stopped, kept
    from openrlhf_tis.pipeline.main_job import interrupted
    from openrlhf_tis.pipeline.train_params import TrainParams

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps({"run_id": "r1", "config": {}}))
    for step in (1, 2, 3):
        RunWriter(run_dir).append_metrics(step, {"reward": 0.0})
    tag = run_dir / "ckpt" / "_actor" / "global_step2"
    tag.mkdir(parents=True)
    (tag.parent / "latest").write_text("global_step2")
    write_checkpoint_identity(tag, "r1", 2)
    line = interrupted(TrainParams(run_dir=str(run_dir), steps=6), Stopped([(7, "openrlhf_tis.cli.train_ppo_ray")]),
                       ["--out", "w", "--ckpt.save_steps", "2"])
    assert line == (f"interrupted: stopped openrlhf_tis.cli.train_ppo_ray (pid 7); kept: steps 1-3 of 6 in "
                    f"{run_dir / 'metrics.jsonl'} and the checkpoint global_step2 in {tag.parent}; resume it with: "
                    f"{sys.executable} -m openrlhf_tis.pipeline.main_job --out w --ckpt.save_steps 2 "
                    f"--set run_dir={run_dir} --ckpt.load_enable")
    assert interrupted(None, KeyboardInterrupt(), ["--out", "w"]).startswith("interrupted before the training started")
    one = tmp_path / "one"
    RunWriter(one).append_metrics(1, {"reward": 0.0})
    assert kept(one, 6) == f"step 1 of 6 in {one / 'metrics.jsonl'}, no checkpoint"
    assert kept(tmp_path / "none", 6) == "no step, no checkpoint"


def test_a_process_tree_that_ignores_sigterm_is_killed_after_the_timeout(tmp_path):
    code = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
            "print(child.pid, flush=True); time.sleep(600)")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    start = time.monotonic()
    stop_process_tree([parent.pid], timeout=1.0)
    assert 1.0 <= time.monotonic() - start < 10
    assert parent.wait(timeout=5) == -signal.SIGKILL and not _alive(child)
    parent.stdout.close()


def _commands() -> list[str]:
    """The module of every console script setup.py installs (a command added later is checked too)."""
    setup = (Path(__file__).resolve().parent.parent / "setup.py").read_text()
    return re.findall(r'"openrlhf-tis-[\w-]+=([\w.]+):main"', setup)


def test_every_command_is_found():
    assert {"openrlhf_tis.cli.train_ppo_ray", "openrlhf_tis.rollout.calibration"} <= set(_commands())


@pytest.mark.parametrize("module", _commands())
def test_a_command_started_with_sigint_ignored_takes_it_back(module):
    """A shell script starts its background jobs with SIGINT ignored, and Python then installs no handler: `kill -INT`
    of a training or a sweep started that way did nothing. Each command's main takes SIGINT back first thing."""
    probe = textwrap.dedent(f"""
        import signal, sys
        from {module} import main
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # inherited, as from `cmd &` in a script
        try:
            main(["--help"])
        except SystemExit:
            pass
        sys.stderr.write(f"handler: {{signal.getsignal(signal.SIGINT) is signal.default_int_handler}}\\n")
    """)
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert "handler: True" in proc.stderr, proc.stderr[-3000:]


def test_the_run_readers_ctrl_c_ends_in_one_line(monkeypatch, tmp_path, capsys):
    from openrlhf_tis.runs import cli as runs_cli

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(runs_cli, "cmd_list", interrupted)
    assert runs_cli.main(["list", str(tmp_path)]) == 130
    assert capsys.readouterr().err == "openrlhf-tis-runs: interrupted\n"


def test_the_calibrations_ctrl_c_ends_in_one_line(monkeypatch, tmp_path, capsys):
    from openrlhf_tis.rollout import calibration

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(calibration, "_check_main_args", lambda args: ["a prompt"])
    monkeypatch.setattr(calibration, "calibrate_to_file", interrupted)
    with pytest.raises(SystemExit) as ended:
        calibration.main(["--model", str(tmp_path), "--prompts", "p.jsonl", "--out", str(tmp_path / "cal")])
    assert ended.value.code == 130
    assert capsys.readouterr().err.endswith(": interrupted\n")
