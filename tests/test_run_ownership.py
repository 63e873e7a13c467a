"""No run trains on the wrong weights, no two runs share a directory, checked without Ray: the run
directory's lock against a second live process, checkpoint identity, planned steps, output locations, the
sweep's interrupted cells, RAY_ADDRESS, and the smaller one-line refusals."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from concurrent import futures
from pathlib import Path
from types import SimpleNamespace

import pytest
from _support import error_line, finished_run, free_port, refused, run_dir, with_value, write_calibration

from openrlhf_tis.cli import train_ppo_ray
from openrlhf_tis.cli.run_dir import lock_owner
from openrlhf_tis.pipeline import sweep
from openrlhf_tis.runs import RunWriter, read_run_config, summary
from openrlhf_tis.runs.identity import CHECKPOINT_ID_FILE, foreign_checkpoint, write_checkpoint_identity
from openrlhf_tis.runs.layout import file_mode

# --- one live run per directory -------------------------------------------------------------------------

HOLDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from openrlhf_tis.cli.run_dir import lock_run_dir
    lock_run_dir(Path(sys.argv[1]))
    print("locked", flush=True)
    time.sleep(600)
""")


@pytest.mark.parametrize("code", ["ENOLCK", "EOPNOTSUPP"])
def test_a_filesystem_without_locks_is_refused_at_once_naming_the_directory(valid_argv, capsys, monkeypatch, code):
    """A run directory on shared storage that cannot flock (NFSv3 without lockd, Lustre without -o flock): one line
    that says what the filesystem needs, never a wait."""
    import errno
    import fcntl

    def no_locks(fd, operation):
        raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    start = time.monotonic()
    line = error_line(refused(valid_argv, capsys))
    assert time.monotonic() - start < 60
    path = run_dir(valid_argv)
    assert line.startswith(f"--logger.run_dir: cannot lock {path / '.lock'}: ")
    assert f"the filesystem of {path} offers no flock" in line and "Lustre -o flock" in line


def test_a_directory_held_by_a_live_process_is_refused_naming_its_pid_and_freed_by_kill_9(valid_argv, capsys):
    path = run_dir(valid_argv)
    path.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        line = error_line(refused(valid_argv, capsys))
        assert line == (f"--logger.run_dir: {path} is in use by another run (pid {holder.pid}); wait for it to end, "
                        "stop it, or choose another --logger.run_dir")
        assert lock_owner(path) == str(holder.pid)
        assert not (path / "config.json").exists()  # the refused start wrote nothing
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        holder.stdout.close()
    assert lock_owner(path) is None
    train_ppo_ray.parse(valid_argv, cpu=True)  # the kernel released the dead holder's lock
    assert (path / ".lock").read_text().strip() == str(os.getpid())


def test_a_notebook_start_into_a_live_run_leaves_its_log_alone(tmp_path):
    from openrlhf_tis.pipeline.train import TrainingFailed, run_training
    from openrlhf_tis.pipeline.train_params import TrainParams

    run = tmp_path / "run"
    run.mkdir()
    (run / "train.log").write_text("the live run's log")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(TrainingFailed, match=f"in use by another run \\(pid {holder.pid}\\)"):
            run_training(TrainParams.checked({"run_dir": str(run)}, where="test"))
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    assert (run / "train.log").read_text() == "the live run's log"


def test_a_notebook_start_into_a_model_directory_writes_nothing_there(tiny_model_dir, tmp_path):
    from openrlhf_tis.pipeline.train import TrainingFailed, run_training
    from openrlhf_tis.pipeline.train_params import TrainParams

    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model)
    before = {p.name: p.read_bytes() for p in model.iterdir()}
    with pytest.raises(TrainingFailed, match="holds a config.json that no run of this fork wrote"):
        run_training(TrainParams.checked({"run_dir": str(model)}, where="test"))
    assert {p.name: p.read_bytes() for p in model.iterdir()} == before


# --- checkpoints belong to one history ------------------------------------------------------------------

def _checkpoint(ckpt, step: int, run_id: str | None) -> None:
    """A checkpoint as DeepSpeed leaves it (`latest` naming the tag), stamped as the fork's actor stamps it."""
    tag = ckpt / "_actor" / f"global_step{step}"
    tag.mkdir(parents=True)
    (ckpt / "_actor" / "latest").write_text(f"global_step{step}")
    if run_id is not None:
        write_checkpoint_identity(tag, run_id, step)


def test_checkpoint_of_this_history_is_resumed_and_an_overwritten_runs_is_refused(valid_argv, tmp_path, capsys):
    path = finished_run(valid_argv)  # two logged steps
    run_id = read_run_config(path)["run_id"]
    ckpt = tmp_path / "ckpt"
    _checkpoint(ckpt, 2, run_id)
    resume = valid_argv + ["--ckpt.load_enable", "--ckpt.path", str(ckpt)]
    train_ppo_ray.parse(resume, cpu=True)
    assert read_run_config(path)["run_id"] == run_id  # a resume keeps the identity

    train_ppo_ray.parse(valid_argv + ["--logger.run_dir_overwrite"], cpu=True)
    assert read_run_config(path)["run_id"] != run_id  # starting over is a new history
    RunWriter(path).append_metrics(1, {"loss": 1.0})  # ... that died after its first step
    line = error_line(refused(resume, capsys))
    assert line.startswith(f"--ckpt.load_enable: will not resume {path} from {ckpt / '_actor'}: its checkpoint "
                           f"global_step2 was saved by run {run_id}, not by this directory's run "), line
    assert line.endswith("pass --logger.run_dir_overwrite to start over, or the --ckpt.path this run saved to")
    assert json.loads((ckpt / "_actor" / "global_step2" / CHECKPOINT_ID_FILE).read_text())["step"] == 2


class _Started(Exception):
    pass


def test_resuming_a_finished_run_says_there_is_nothing_to_do_and_exits_0_before_ray(valid_argv, tmp_path, capsys,
                                                                                    monkeypatch):
    """Regression: it went through the whole start-up (143 s) and a held-out pass to train nothing."""
    final = tmp_path / "final"
    argv = valid_argv + ["--ckpt.output_dir", str(final), "--ckpt.path", str(tmp_path / "ckpt")]
    path = finished_run(argv)  # two logged steps; one prompt in a rollout batch: one planned step
    assert read_run_config(path)["planned_steps"] == 1
    _checkpoint(tmp_path / "ckpt", 2, read_run_config(path)["run_id"])
    for name in ("start_ray", "prepare_rollout_engines"):
        monkeypatch.setattr(train_ppo_ray, name, lambda *_: (_ for _ in ()).throw(_Started()))
    monkeypatch.setattr(train_ppo_ray.fork_classes, "apply", lambda: None)
    resume = argv + ["--ckpt.load_enable"]
    config = (path / "config.json").read_text()

    final.mkdir()
    os.utime(path / "metrics.jsonl", (time.time() + 10, time.time() + 10))  # a model left by an earlier history
    (final / "model.safetensors").write_bytes(b"old")
    with pytest.raises(_Started):  # no final model saved after the last step: resuming still has work to do
        train_ppo_ray.main(resume)
    os.utime(path / "metrics.jsonl", (time.time() - 10, time.time() - 10))  # the final save came after it
    with pytest.raises(SystemExit) as exit_info:
        train_ppo_ray.main(resume)
    assert exit_info.value.code == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"openrlhf_tis.cli.train_ppo_ray: nothing to do: {path} already holds all 1 planned step(s) "
                       f"and its final model in {final}; to train further add prompts or raise "
                       "--train.num_episodes, or pass --logger.run_dir_overwrite to start over"), err
    assert (path / "config.json").read_text() != config  # the first resume (stopped at Ray) recorded itself ...
    config = (path / "config.json").read_text()
    with pytest.raises(SystemExit):
        train_ppo_ray.main(resume)
    assert (path / "config.json").read_text() == config  # ... the one with nothing to do did not
    with pytest.raises(_Started):  # more episodes: more planned steps, so the resume goes on
        train_ppo_ray.main(resume + ["--train.num_episodes", "3", "--logger.run_dir_override"])


def test_an_empty_latest_left_by_a_kill_is_pointed_at_the_newest_checkpoint(valid_argv, tmp_path, capsys):
    path = finished_run(valid_argv)  # two logged steps
    run_id = read_run_config(path)["run_id"]
    ckpt = tmp_path / "ckpt"
    _checkpoint(ckpt, 1, run_id)
    shutil.rmtree(ckpt / "_actor" / "global_step1")  # gone, as max_num prunes; step 10 sorts before 2 as text
    for step in (2, 10, 1):
        (ckpt / "_actor" / f"global_step{step}").mkdir(exist_ok=True)
        write_checkpoint_identity(ckpt / "_actor" / f"global_step{step}", run_id, step)
    (ckpt / "_actor" / "latest").write_text("")  # SIGKILL while DeepSpeed rewrote it in place
    line = error_line(refused(valid_argv + ["--ckpt.load_enable", "--ckpt.path", str(ckpt)], capsys))
    # repaired to the newest tag, which is then judged like any checkpoint: step 10 is past the 2 logged steps
    assert (ckpt / "_actor" / "latest").read_text() == "global_step10"
    assert "its checkpoint global_step10 is past the directory's last logged step (2)" in line
    (ckpt / "_actor" / "latest").write_text("")
    shutil.rmtree(ckpt / "_actor" / "global_step10")
    train_ppo_ray.parse(valid_argv + ["--ckpt.load_enable", "--ckpt.path", str(ckpt)], cpu=True)
    assert (ckpt / "_actor" / "latest").read_text() == "global_step2"
    assert "was empty" in capsys.readouterr().err


@pytest.mark.parametrize(("logged", "saved_by", "step", "expected"), [
    (3, "mine", 3, None),
    (3, "mine", 2, None),
    (3, "mine", 4, "global_step4 is past the directory's last logged step (3)"),
    (3, "other", 2, "saved by run other"),
    (3, None, 2, "saved by a run without a recorded identity"),
    (0, "mine", 1, "past the directory's last logged step (0)"),
])
def test_foreign_checkpoint_rules(tmp_path, logged, saved_by, step, expected):
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"run_id": "mine", "config": {}}))
    writer = RunWriter(run)
    for s in range(1, logged + 1):
        writer.append_metrics(s, {"x": s})
    _checkpoint(ckpt, step, saved_by)
    found = foreign_checkpoint(run, ckpt / "_actor")
    assert found is None if expected is None else expected in found, found


def test_a_run_dir_written_before_run_ids_is_judged_by_step(tmp_path):
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"config": {}}))
    RunWriter(run).append_metrics(1, {"x": 1})
    _checkpoint(ckpt, 1, None)
    assert foreign_checkpoint(run, ckpt / "_actor") is None


def test_summary_counts_missing_steps_against_the_planned_total(valid_argv, tmp_path):
    prompts = tmp_path / "ten.jsonl"
    prompts.write_text("".join(json.dumps({"input": f"{i} + 1?", "label": str(i + 1)}) + "\n" for i in range(10)))
    argv = with_value(valid_argv, "--data.prompt_dataset", str(prompts))
    argv += ["--rollout.batch_size", "4", "--train.batch_size", "4", "--train.micro_batch_size", "4",
             "--train.num_episodes", "2"]
    train_ppo_ray.parse(argv, cpu=True)
    path = run_dir(argv)
    assert read_run_config(path)["planned_steps"] == 6  # ceil(10 / 4) batches x 2 episodes
    writer = RunWriter(path)
    for step in (1, 2, 4):
        writer.append_metrics(step, {"loss": 1.0})
    info = summary(path)
    assert info["planned_steps"] == 6 and info["missing_steps"] == 3  # 3, 5 and 6
    train_ppo_ray.parse(argv + ["--logger.run_dir_overwrite", "--data.max_samples", "3"], cpu=True)
    assert read_run_config(path)["planned_steps"] == 2  # ceil(3 / 4) x 2


# --- every output location is writable before Ray starts ------------------------------------------------

UNWRITABLE = "/sys/fs/openrlhf_tis_out"  # sysfs refuses new files to every user, root included


@pytest.mark.parametrize("extra", [
    ["--ckpt.output_dir", UNWRITABLE],
    ["--ckpt.path", UNWRITABLE, "--ckpt.save_steps", "2"],
    ["--logger.tensorboard_dir", UNWRITABLE],
])
def test_an_unwritable_output_location_is_refused_before_ray(valid_argv, capsys, extra):
    line = error_line(refused(valid_argv + extra, capsys))
    assert line.startswith(f"{extra[0]}: cannot write under /sys/fs: "), line


def test_a_checkpoint_path_never_written_is_not_checked(valid_argv):
    train_ppo_ray.parse(valid_argv + ["--ckpt.path", UNWRITABLE], cpu=True)  # --ckpt.save_steps -1: no saves


# --- an interrupted sweep cell is retried --------------------------------------------------------------

def _interrupted_cell(out, cell, run_id: str | None, checkpoint_by: str | None):
    """A cell's directory as a Ctrl-C leaves it: its run holds steps, there is no status.json."""
    run = out / "cells" / cell.slug / "run"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"run_id": run_id, "config": {}}))
    RunWriter(run).append_metrics(1, {"x": 1})
    RunWriter(run).append_metrics(2, {"x": 2})
    if checkpoint_by is not None:
        _checkpoint(run / "ckpt", 2, checkpoint_by)
    return run


@pytest.mark.parametrize(("checkpoint_by", "resumes"), [(None, False), ("r1", True), ("r0", False)])
def test_an_interrupted_cell_restarts_or_resumes_on_the_next_sweep(tmp_path, monkeypatch, checkpoint_by, resumes):
    calls = []
    monkeypatch.setattr(sweep, "execute_stoppable", lambda name, notebook, params, cwd: calls.append(params))
    cell = sweep.Cell("seed=1", {"seed": 1, "extra_args": []})
    run = _interrupted_cell(tmp_path, cell, "r1", checkpoint_by)
    result = sweep.run_cell(cell, tmp_path)
    assert result.status == "complete" and len(calls) == 1
    assert ("--ckpt.load_enable" in calls[0]["extra_args"]) == resumes
    assert (run / "metrics.jsonl").exists() == resumes  # a restart keeps the attempt aside, never deletes it
    assert resumes or (run.with_name("run.attempt1") / "metrics.jsonl").exists()


def test_a_cell_whose_run_is_still_alive_is_failed_and_left_in_place(tmp_path, monkeypatch):
    monkeypatch.setattr(sweep, "execute_stoppable", lambda *args, **kwargs: pytest.fail("a cell ran over a live run"))
    cell = sweep.Cell("seed=1", {"seed": 1, "extra_args": []})
    run = _interrupted_cell(tmp_path, cell, "r1", None)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        result = sweep.run_cell(cell, tmp_path)
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    assert result.status == "failed" and f"still in use by a training process (pid {holder.pid})" in result.error
    assert (run / "metrics.jsonl").exists() and not run.with_name("run.attempt1").exists()


# --- Ray: a local cluster unless RAY_ADDRESS names one that answers ------------------------------------

def test_a_ray_address_that_answers_nothing_fails_in_one_line_quickly(valid_argv, capsys, monkeypatch):
    address = f"127.0.0.1:{free_port()}"
    monkeypatch.setenv("RAY_ADDRESS", address)
    start = time.monotonic()
    line = error_line(refused(valid_argv, capsys))
    assert time.monotonic() - start < 30
    assert line.startswith(f"RAY_ADDRESS: no Ray cluster answers at {address} (") and "unset RAY_ADDRESS" in line


@pytest.fixture()
def not_ray():
    """A real TCP server on 127.0.0.1 that accepts connections and never answers (no Ray there); yields its port."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def serve() -> None:
        with contextlib.suppress(OSError):  # the server closed at teardown
            while True:
                held.append(server.accept()[0])

    threading.Thread(target=serve, daemon=True).start()
    yield server.getsockname()[1]
    server.close()
    for conn in held:
        conn.close()


@pytest.fixture()
def no_ray_init(monkeypatch):
    """ray.init fails the test: a refusal must come before it (joining no Ray retries for minutes)."""
    from openrlhf_tis.cli import ray_cluster

    def reached(**kwargs):
        raise AssertionError(f"ray.init reached with RAY_ADDRESS={os.environ.get('RAY_ADDRESS')}")

    monkeypatch.setattr(ray_cluster.ray, "init", reached)


def test_a_ray_address_where_something_else_listens_is_refused_in_seconds(valid_argv, capsys, monkeypatch,
                                                                           not_ray, no_ray_init):
    address = f"127.0.0.1:{not_ray}"
    monkeypatch.setenv("RAY_ADDRESS", address)
    start = time.monotonic()
    line = error_line(refused(valid_argv, capsys))
    assert time.monotonic() - start < 15
    assert line.startswith(f"RAY_ADDRESS: something listens at {address} but it is not a Ray cluster ("), line


@pytest.mark.parametrize("target", ["closed", "not_ray", "no_file"])
def test_ray_address_auto_with_a_stale_address_file_is_refused_naming_the_address_and_file(
        target, valid_argv, capsys, monkeypatch, tmp_path, not_ray, no_ray_init):
    from ray._private import services

    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))  # Ray's address file: $RAY_TMPDIR/ray/ray_current_cluster
    monkeypatch.setattr(services, "find_gcs_addresses", frozenset)  # no live cluster of another test or user
    address_file = tmp_path / "ray" / "ray_current_cluster"
    address = f"127.0.0.1:{free_port() if target == 'closed' else not_ray}"
    if target != "no_file":  # what `ray start` left behind, its cluster since gone
        address_file.parent.mkdir()
        address_file.write_text(address + "\n")
    monkeypatch.setenv("RAY_ADDRESS", "auto")
    start = time.monotonic()
    line = error_line(refused(valid_argv, capsys))
    assert time.monotonic() - start < 15
    if target == "no_file":
        assert line.startswith(f"RAY_ADDRESS: auto finds no Ray cluster on this machine (no running Ray, no "
                               f"{address_file})"), line
        return
    opening = "no Ray cluster answers at" if target == "closed" else "something listens at"
    assert line.startswith(f"RAY_ADDRESS: {opening} {address} "), line
    assert f"; RAY_ADDRESS=auto took it from {address_file})" in line


def test_a_ray_gcs_passes_the_address_check():
    """A real gRPC server answering GetClusterId as Ray's GCS does: the check lets ray.init have it."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    from openrlhf_tis.cli.ray_address import check_ray_address

    class Gcs(gcs_service_pb2_grpc.NodeInfoGcsServiceServicer):
        def GetClusterId(self, request, context):
            return gcs_service_pb2.GetClusterIdReply(cluster_id=bytes(28))

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    gcs_service_pb2_grpc.add_NodeInfoGcsServiceServicer_to_server(Gcs(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        check_ray_address(f"127.0.0.1:{port}")
    finally:
        server.stop(grace=None)


def test_without_ray_address_the_cli_starts_its_own_ray(valid_argv, monkeypatch):
    from openrlhf_tis.cli import ray_cluster

    seen, reaped = {}, []
    for key in ray_cluster.worker_env("cpu"):  # start_ray exports them; restored after the test
        monkeypatch.delenv(key, raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray_cluster.ray, "init", lambda **kwargs: seen.update(kwargs) or SimpleNamespace(
        address_info={"session_dir": "/tmp/ray/session_x"}))
    monkeypatch.setattr(ray_cluster, "reap_when_gone", reaped.append)
    ray_cluster.start_ray(train_ppo_ray.parse(valid_argv, cpu=True), "cpu")
    assert seen["address"] == "local"  # never the cluster of an address file
    assert reaped == ["/tmp/ray/session_x"]  # its leftovers are stopped once the driver is gone


# --- the smaller items ----------------------------------------------------------------------------------

def test_nonfinite_drop_that_could_never_train_is_refused(valid_argv, capsys):
    batch = ["--rollout.batch_size", "4", "--rollout.n_samples_per_prompt", "2", "--train.batch_size", "8",
             "--rollout.micro_batch_size", "8"]
    line = error_line(refused(valid_argv + batch + ["--train.micro_batch_size", "8", "--reward.nonfinite", "drop"],
                              capsys))
    assert line == ("--reward.nonfinite: drop could never train a step that loses a prompt group: the 6 samples "
                    "left of 8 are fewer than --train.micro_batch_size (8) x 1 data-parallel actor process(es); "
                    "lower --train.micro_batch_size to 4")
    train_ppo_ray.parse(valid_argv + batch + ["--train.micro_batch_size", "4", "--reward.nonfinite", "drop"],
                        cpu=True)


def test_a_corrupt_model_config_is_refused_in_one_line(valid_argv, tiny_model_dir, tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama",')
    line = error_line(refused(with_value(valid_argv, "--actor.model_name_or_path", str(model)), capsys))
    assert line.startswith(f"--actor.model_name_or_path: {model / 'config.json'} is not a readable JSON model config")


def test_a_hub_id_is_refused_at_once_when_offline_or_unreachable(valid_argv, capsys, monkeypatch):
    from openrlhf_tis import model_files

    argv = with_value(valid_argv, "--actor.model_name_or_path", "no-such-org/no-such-model")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert "not in the local cache (HF_HUB_OFFLINE is set)" in error_line(refused(argv, capsys))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(model_files, "hub_reachable", lambda: False)
    assert "the hub cannot be reached" in error_line(refused(argv, capsys))


def test_an_explicit_lower_bound_that_tis_ignores_is_refused(valid_argv, capsys):
    argv = valid_argv + ["--vllm.num_engines", "1", "--algo.correction.preset", "tis"]
    line = error_line(refused(argv + ["--algo.correction.lower", "0.5"], capsys))
    assert line == ("--algo.correction.lower: has no effect here: it is read by mode clip or mask only, and the mode "
                    "is 'truncate'"), line
    train_ppo_ray.parse(argv + ["--algo.correction.mode", "clip", "--algo.correction.lower", "0.5"], cpu=True)


@pytest.mark.parametrize("flags, fault", [
    (["--train.no_such_flag", "3"], "unrecognized arguments: --train.no_such_flag 3"),
    # regression: refused only after the notebook had started (52 s), by the training CLI
    (["--train.async_max_lag", "1"], "--train.async_max_lag: applies to async training only; add --train.async_enable"),
])
def test_a_bad_training_flag_through_the_main_job_fails_at_once_in_one_line(tmp_path, flags, fault):
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "openrlhf_tis.pipeline.main_job", "--out", str(tmp_path),
                           "--model", "tiny", *flags],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert errors == [errors[-1]] and errors[-1].startswith("main_job: error: training CLI flags: "), proc.stderr
    assert fault in errors[-1] and "usage:" not in proc.stderr
    assert not (tmp_path / "runs").exists()  # nothing was started
    # DeepSpeed, imported with upstream's parser, says nothing on the console
    assert "Setting accelerator" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    print(f"refused after {time.monotonic() - start:.1f} s")


def test_the_calibration_file_gets_the_mode_open_would_give(tiny_model_dir, tmp_path):
    path = write_calibration(tiny_model_dir, tmp_path / "cal.safetensors")
    assert (os.stat(path).st_mode & 0o777) == file_mode() == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# --- nothing outlives a killed run ----------------------------------------------------------------------

# A process of a Ray session whose command line names nothing (a retitled agent, `ray::DashboardAgent`): it writes
# the session's log named by LOG, says so, and sleeps; with READ_ONLY it reads the log instead (a `tail -f`).
LOG_HOLDER = ("import os, time; f = open(os.environ['LOG'], 'r' if os.environ.get('READ_ONLY') else 'a'); "
          "print('open', flush=True); time.sleep(600)")

DRIVER = textwrap.dedent("""
    import os, subprocess, sys, time
    from openrlhf_tis.cli.lifetime import reap_when_gone
    session = os.environ["SESSION"]  # not in this driver's own command line, as a Ray session dir is not
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", session], start_new_session=True)
    agent = subprocess.Popen([sys.executable, "-c", os.environ["LOG_HOLDER"]], stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    agent.stdout.readline()  # its log is open
    print("started" if reap_when_gone(session) else "not armed", flush=True)
    time.sleep(600)
""")


def test_what_a_killed_driver_started_is_stopped_by_its_watchdog(tmp_path):
    """The watchdog stops the session's processes whether their command line names the session (the GCS, the raylet)
    or they only write its logs (the agents retitle themselves); a process that only reads a log is not the session's.
    """
    import psutil

    from openrlhf_tis.cli.lifetime import GRACE_S, session_processes

    session = tmp_path / "session_x"  # as a Ray session directory holds its processes' logs
    (session / "logs").mkdir(parents=True)
    log = session / "logs" / "dashboard_agent.log"
    log.touch()
    env = {**os.environ, "SESSION": str(session), "LOG": str(log), "LOG_HOLDER": LOG_HOLDER}
    reader = subprocess.Popen([sys.executable, "-c", LOG_HOLDER], stdout=subprocess.PIPE, text=True,
                              env={**env, "READ_ONLY": "1"})
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert reader.stdout.readline() == "open\n"
        assert driver.stdout.readline().strip() == "started"  # reap_when_gone returned once its watchdog was armed
        deadline = time.monotonic() + 30  # all are started (Popen returned after their exec); the process table,
        while len(session_processes(str(session))) < 3 and time.monotonic() < deadline:  # read by psutil, may lag
            time.sleep(0.2)
        found = session_processes(str(session))
        assert len(found) == 3  # the straggler naming the session, the agent writing its log, and the watchdog
        assert reader.pid not in {proc.pid for proc in found}
        driver.kill()  # kill -9: no atexit, no ray.shutdown
        driver.wait()
        deadline = time.monotonic() + 3 * GRACE_S + 10
        while session_processes(str(session)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert session_processes(str(session)) == []
        assert all(not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE for proc in found)
        assert reader.poll() is None  # a reader of the session's logs is left alone
    finally:
        for proc in (driver, reader):
            proc.kill()
            proc.wait()
            proc.stdout.close()


def test_stopping_a_session_spares_the_process_that_asked_and_its_ancestors(tmp_path):
    """A command whose own command line names the session (`timeout 60 python -c "stop_session(...)" SESSION`) must
    not be stopped by the stop it started: seen by hand, `timeout` got the SIGTERM and took the stopper with it."""
    session = tmp_path / "session_y"
    (session / "logs").mkdir(parents=True)
    stopper = "import sys; from openrlhf_tis.cli.lifetime import stop_session; stop_session(sys.argv[1], grace=1)"
    parent = ("import subprocess, sys; done = subprocess.run([sys.executable, '-c', sys.argv[1], sys.argv[2]]); "
              "print('parent alive', done.returncode, flush=True)")
    done = subprocess.run([sys.executable, "-c", parent, stopper, str(session)], capture_output=True, text=True,
                          timeout=120)
    assert (done.returncode, done.stdout) == (0, "parent alive 0\n"), done.stderr[-2000:]


def test_a_child_of_a_notebook_dies_with_it(tmp_path):
    from openrlhf_tis.cli.lifetime import PARENT_ENV

    child_code = "from openrlhf_tis.cli.lifetime import die_with_parent; import time; die_with_parent(); " \
                 "print('armed', flush=True); time.sleep(600)"
    parent_code = textwrap.dedent(f"""
        import os, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", {child_code!r}], start_new_session=True,
                                 env={{**os.environ, {PARENT_ENV!r}: str(os.getpid())}})
        print(child.pid, flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True)
    child_pid = int(parent.stdout.readline())
    time.sleep(5)  # the child arms itself (imports) before its parent is killed
    parent.kill()
    parent.wait()
    parent.stdout.close()
    deadline = time.monotonic() + 20
    while _alive(child_pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(child_pid)


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# --- Ctrl-C on the bare training CLI -------------------------------------------------------------------------

def _interrupted_main(argv: list[str], monkeypatch, capsys, during) -> tuple[int, str]:
    """main() whose upstream training is stopped by Ctrl-C after `during(args)` ran (what the run kept)."""
    monkeypatch.setattr(train_ppo_ray, "start_ray", lambda args, device: None)

    def training(args):
        during(args)
        raise KeyboardInterrupt

    monkeypatch.setattr(train_ppo_ray, "run_upstream_main", training)
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # the handler's SIGINT guard: not this test process's
    with pytest.raises(SystemExit) as exit_info:
        train_ppo_ray.main(argv)
    return exit_info.value.code, capsys.readouterr().err.strip().splitlines()[-1]


def test_ctrl_c_on_the_training_cli_says_what_was_kept_and_exits_130(valid_argv, tmp_path, monkeypatch, capsys):
    ckpt = tmp_path / "ckpt"

    def two_steps_and_a_checkpoint(args):
        writer = RunWriter(Path(getattr(args, "logger.run_dir")))
        writer.append_metrics(1, {"loss": 1.0})
        writer.append_metrics(2, {"loss": 0.5})
        (ckpt / "_actor" / "global_step2").mkdir(parents=True)
        (ckpt / "_actor" / "latest").write_text("global_step2")

    code, line = _interrupted_main(valid_argv + ["--ckpt.path", str(ckpt), "--ckpt.save_steps", "1"], monkeypatch,
                                   capsys, two_steps_and_a_checkpoint)
    path = run_dir(valid_argv)
    assert code == 130
    assert line == (f"openrlhf_tis.cli.train_ppo_ray: interrupted: kept steps 1-2 in {path / 'metrics.jsonl'} and the "
                    f"checkpoint global_step2 in {ckpt.resolve() / '_actor'}; resume with the same command and "
                    "--ckpt.load_enable")


def test_ctrl_c_before_the_first_step_says_nothing_was_kept(valid_argv, monkeypatch, capsys):
    code, line = _interrupted_main(valid_argv, monkeypatch, capsys, lambda args: None)
    assert code == 130 and line == ("openrlhf_tis.cli.train_ppo_ray: interrupted: kept no step and no checkpoint; "
                                    "start again with the same command")
