"""A run whose engine hangs or is killed ends in one line, keeps what it wrote, and resumes from it.

One real run (Ray, DeepSpeed, one vLLM engine, the tiny model) of three steps, stopped twice:
- its engine's actor process is SIGSTOPped after step 1: the controller's stage (generate samples) makes no progress,
  and the driver ends after `--train.stall_timeout_s` (cli/stall.py) naming the stage and the stopped engine, exit 4;
- the same command resumes from step 1's checkpoint; after step 2 its engine is `ray.kill`ed (the GCS's own kill
  request, as `ray.kill` sends it; the engine is unnamed, so no second driver could get a handle), which the death
  watch leaves alone as a death on purpose: upstream's `ray.get` raised it, and the driver ends naming the engine and
  how it died, exit 3 (cli/actor_watch.py death_in_error). Upstream ended both with a traceback, or not at all.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from _support import processes_naming, read_steps, train_argv, wait_for

from openrlhf_tis.cli.train_ppo_ray import ACTOR_DIED_EXIT, STALLED_EXIT
from openrlhf_tis.demo.task import write_prompts

pytestmark = pytest.mark.e2e

STALL_S = 30  # the bound under test: a tiny model's stage takes a few seconds on 2 busy cores
STOP_BOUND_S = STALL_S + 60  # the bound, the watch's poll, then Ray's shutdown on 2 busy cores
START_S = 600  # Ray's, the engine's and DeepSpeed's start, then one step, on 2 cores busy with other runs
ENGINE = "ray::PrecisionRolloutRayActor"
KEPT = r"kept step{steps} in {run}/metrics\.jsonl and the checkpoint global_step{step} in {ckpt}/_actor; resume with " \
       r"the same command and --ckpt\.load_enable"


def _engine_pid(ray_tmp: str) -> int:
    """The pid of this run's engine actor: a worker under the raylet of the run's own Ray temp dir."""
    raylets = [pid for pid, cmd in processes_naming(ray_tmp).items() if "raylet" in cmd.split()[0]]
    assert len(raylets) == 1, processes_naming(ray_tmp)
    engines = [child.pid for child in psutil.Process(raylets[0]).children(recursive=True)
               if " ".join(child.cmdline()).startswith(ENGINE)]
    assert len(engines) == 1, engines
    return engines[0]


def _ray_kill(ray_tmp: str, pid: int) -> None:
    """What `ray.kill(engine)` does: ask the run's GCS to kill the actor (force, no restart)."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    raylet = next(pid for pid, cmd in processes_naming(ray_tmp).items() if "raylet" in cmd.split()[0])
    address = re.search(r"--gcs-address=(\S+)", " ".join(psutil.Process(raylet).cmdline()))[1]
    with grpc.insecure_channel(address) as channel:
        actors = gcs_service_pb2_grpc.ActorInfoGcsServiceStub(channel)
        table = actors.GetAllActorInfo(gcs_service_pb2.GetAllActorInfoRequest(), timeout=30).actor_table_data
        engine = next(actor for actor in table if actor.pid == pid)
        actors.KillActorViaGcs(gcs_service_pb2.KillActorViaGcsRequest(actor_id=engine.actor_id, force_kill=True,
                                                                     no_restart=True), timeout=30)


def _run_until(argv, work: Path, env, log: Path, steps: int, stop) -> tuple[int, str, float]:
    """Start the CLI, call `stop()` once `steps` steps are logged; its exit code, console and seconds after `stop`."""
    with log.open("w") as out:
        proc = subprocess.Popen(argv, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        assert wait_for(lambda: len(read_steps(work / "run")) >= steps, proc, timeout=START_S), log.read_text()[-6000:]
        stop()
        stopped = time.monotonic()
        try:
            proc.wait(timeout=STOP_BOUND_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the driver was still running {STOP_BOUND_S} s after the stop:\n{log.read_text()[-6000:]}")
        return proc.returncode, log.read_text(), time.monotonic() - stopped
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _left(ray_tmp: str, engine: int) -> dict[int, str]:
    """The processes of the run's Ray session still running 30 s after its end, the engine's among them."""

    def left():
        found = processes_naming(ray_tmp)
        if psutil.pid_exists(engine) and psutil.Process(engine).status() != psutil.STATUS_ZOMBIE:
            found[engine] = "the engine"
        return found

    deadline = time.monotonic() + 30  # the session's watchdog sweeps what Ray's shutdown left (cli/lifetime.py)
    while left() and time.monotonic() < deadline:
        time.sleep(1)
    return left()


def test_a_stopped_engine_ends_the_run_as_stalled_and_a_killed_one_as_dead_each_in_one_line(tiny_model_dir,
                                                                                              tmp_path):
    write_prompts(tmp_path / "prompts.jsonl", 12)
    argv = [*train_argv(tiny_model_dir, tmp_path, 3, 10), "--train.stall_timeout_s", str(STALL_S)]
    ray_tmp = tempfile.mkdtemp(prefix="rs", dir="/tmp")  # short (Ray's socket paths), and ours to search
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=ray_tmp, RAY_DEDUP_LOGS="0")
    run, ckpt = re.escape(str(tmp_path / "run")), re.escape(str(tmp_path / "ckpt"))
    stopped = []

    def sigstop_engine():
        stopped.append(_engine_pid(ray_tmp))
        os.kill(stopped[0], signal.SIGSTOP)

    try:
        code, log, seconds = _run_until(argv, tmp_path, env, tmp_path / "stalled.log", 1, sigstop_engine)
        last = log.strip().splitlines()[-1]
        assert code == STALLED_EXIT, log[-6000:]
        assert re.fullmatch(
            rf"openrlhf_tis\.cli\.train_ppo_ray: error: stalled: generate samples made no progress for \d+ s, waiting "
            rf"on PrecisionRolloutRayActor \(pid {stopped[0]}\); raise --train\.stall_timeout_s or set it to 0 to "
            rf"disable the bound; {KEPT.format(steps=' 1', run=run, step=1, ckpt=ckpt)}", last), log[-6000:]
        assert STALL_S <= seconds <= STOP_BOUND_S
        assert [step["step"] for step in read_steps(tmp_path / "run")] == [1]
        assert _left(ray_tmp, stopped[0]) == {}  # the stopped engine too
        print(f"stalled: ended {seconds:.1f} s after the SIGSTOP")

        def ray_kill_engine():
            stopped.append(_engine_pid(ray_tmp))
            _ray_kill(ray_tmp, stopped[1])

        code, log, seconds = _run_until(argv, tmp_path, env, tmp_path / "killed.log", 2, ray_kill_engine)
        last = log.strip().splitlines()[-1]
        assert code == ACTOR_DIED_EXIT, log[-6000:]
        assert re.fullmatch(
            rf"openrlhf_tis\.cli\.train_ppo_ray: error: the Ray actor PrecisionRolloutRayActor \(pid {stopped[1]}\) "
            rf"died: The actor is dead because it was killed by `ray\.kill`\.; "
            rf"{KEPT.format(steps='s 1-2', run=run, step=2, ckpt=ckpt)}", last), log[-6000:]
        assert not any(line.startswith("Traceback") for line in log.splitlines()
                       if not line.startswith("(")), log[-6000:]  # Ray's copies of actors' logs start "(Actor pid=...)"
        assert [step["step"] for step in read_steps(tmp_path / "run")] == [1, 2]  # resumed at step 2, none lost
        assert _left(ray_tmp, stopped[1]) == {}
        print(f"ray.kill: ended {seconds:.1f} s after the kill")
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(ray_tmp, ignore_errors=True)
