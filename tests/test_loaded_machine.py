"""What the suite starts, on a loaded machine: its own Ray head (tests/_support.ray_head) is started again when it dies
while starting, whatever its last log line, a bounded number of times, and a failure says the machine's load (a fake
`ray`, a shell script, stands in for Ray, so this runs in seconds and starts nothing real); a notebook's kernel gets
a start-up bound a busy machine meets. scripts/cpu_hog.sh makes such a machine: its start and stop are checked here."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _support import DASHBOARD_START_ENV, HEAD_TRIES, SETTLE_S, machine_load, ray_head

from openrlhf_tis.cli import patient_ray
from openrlhf_tis.cli.ray_cluster import RAY_START_ENV

FAKE_RAY = """#!/bin/sh
# one line per start (the start-up windows it was given, then its arguments); the first $FAKE_FAILS starts die as a
# loaded head's dashboard did, the next one comes up
echo "$RAY_agent_register_timeout_ms $RAY_DASHBOARD_STARTUP_TIMEOUT_S $@" >> "$FAKE_STARTS"
if [ "$(/usr/bin/wc -l < "$FAKE_STARTS")" -le "$FAKE_FAILS" ]; then
  echo "loading the dashboard's subprocess modules"
  exit 1
fi
echo "Ray runtime started."
exec /bin/sleep 600
"""


def _fake_ray(tmp_path: Path) -> Path:
    path = tmp_path / "ray"
    path.write_text(FAKE_RAY)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _starts(tmp_path: Path) -> list[str]:
    starts = tmp_path / "starts"
    return starts.read_text().splitlines() if starts.exists() else []


def test_a_head_that_dies_while_starting_is_started_again_whatever_it_said(tmp_path, capsys):
    env = {"FAKE_STARTS": str(tmp_path / "starts"), "FAKE_FAILS": "1"}
    with ray_head([], env, tmp_path / "head.log", lambda: True, timeout=60, ray=[str(_fake_ray(tmp_path))]) as address:
        starts = _starts(tmp_path)
        assert len(starts) == 2  # the first died with a line none of Ray's "late" signs names
        assert starts[1].split()[:2] == [RAY_START_ENV["RAY_agent_register_timeout_ms"],
                                         DASHBOARD_START_ENV["RAY_DASHBOARD_STARTUP_TIMEOUT_S"]]
        port = starts[1].split("--port ")[1].split()[0]
        assert address == f"127.0.0.1:{port}"
    err = capsys.readouterr().err
    assert f"ray start exited with 1 during start-up (try 1 of {HEAD_TRIES}, load average " in err
    assert "starting it again" in err


def test_a_head_that_never_starts_fails_after_the_bounded_tries_saying_the_load(tmp_path):
    env = {"FAKE_STARTS": str(tmp_path / "starts"), "FAKE_FAILS": str(HEAD_TRIES + 5)}
    start = time.monotonic()
    with pytest.raises(AssertionError) as failure:
        with ray_head([], env, tmp_path / "head.log", lambda: True, timeout=60, ray=[str(_fake_ray(tmp_path))]):
            raise AssertionError("the head must not be yielded")
    assert len(_starts(tmp_path)) == HEAD_TRIES
    message = str(failure.value)
    assert message.startswith(f"ray start exited with 1 during start-up on each of {HEAD_TRIES} tries (load average")
    assert f"on {os.cpu_count()} cores)" in message and "subprocess modules" in message
    assert time.monotonic() - start < HEAD_TRIES * (SETTLE_S + 30)


def test_the_load_is_said_as_three_averages_and_the_cores():
    said = machine_load()
    match = re.fullmatch(r"load average ([\d.]+) / ([\d.]+) / ([\d.]+) \(1 / 5 / 15 min\) on (\d+) cores", said)
    assert match is not None, said
    assert all(float(v) >= 0 for v in match.groups()[:3]) and int(match.group(4)) >= 1


def test_a_notebook_kernel_gets_the_long_start_up_and_output_bounds(tmp_path, monkeypatch):
    import papermill

    from openrlhf_tis.pipeline import execute

    seen = {}
    monkeypatch.setattr(papermill, "execute_notebook", lambda *args, **kwargs: seen.update(kwargs))
    execute.execute("train", tmp_path / "out.ipynb", {})
    assert seen["start_timeout"] == execute.KERNEL_START_S >= 300  # papermill's own default: 60 s
    assert seen["iopub_timeout"] == execute.IOPUB_S >= 30  # nbclient's: 4 s, past which outputs are dropped


HOG = Path(__file__).resolve().parents[1] / "scripts" / "cpu_hog.sh"


def _hog(command: str, pids: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(HOG), command, *args], env={**os.environ, "CPU_HOG_PIDS": str(pids)},
                          capture_output=True, text=True, timeout=60)


def test_the_cpu_hog_starts_busy_loops_and_stops_exactly_them(tmp_path):
    import psutil

    pids = tmp_path / "hog.pids"
    assert _hog("start", pids, "2").returncode == 0
    try:
        started = [int(line.split()[0]) for line in pids.read_text().splitlines()]
        assert len(started) == 2
        busy = [psutil.Process(pid) for pid in started]
        before = [sum(proc.cpu_times()[:2]) for proc in busy]
        time.sleep(2.0)
        used = [sum(proc.cpu_times()[:2]) - was for proc, was in zip(busy, before, strict=True)]
        assert all(u > 0.05 for u in used), used  # each one computing, however many others share the cores
        assert _hog("start", pids).returncode == 2  # never a second set over the first
    finally:
        stopped = _hog("stop", pids)
    assert stopped.returncode == 0 and "stopped 2 busy loop(s)" in stopped.stdout
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                   for pid in started)
    assert not pids.exists()


def test_the_cpu_hog_never_signals_a_pid_given_to_another_process(tmp_path):
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        pids = tmp_path / "hog.pids"
        pids.write_text(f"{bystander.pid} 1\n")  # its PID, another start time: a hog's PID the kernel gave away
        assert _hog("stop", pids).returncode == 0
        time.sleep(0.5)
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


def test_the_products_ray_start_tries_again_and_ends_in_one_line_with_the_load(monkeypatch):
    """init_local_ray (the CLI's own Ray start): a node that misses Ray's registration window is started again, up
    to STARTUP_TRIES; then one line that says the machine's load, not Ray's traceback; other errors at once."""
    from openrlhf_tis.cli import ray_cluster

    calls = []

    def init(outcomes):
        def fake(**kwargs):
            calls.append(kwargs)
            outcome = outcomes[min(len(calls), len(outcomes)) - 1]
            if isinstance(outcome, Exception):
                raise outcome
            return outcome
        return fake

    late = Exception("The current node timed out during startup. This could happen because ...")
    from ray._private import services

    ray_own = services.get_node
    patient_during_init = []
    monkeypatch.setattr(ray_cluster, "patient_get_node",
                        lambda get_node, wait_s, raylet_ended: ("patient", get_node, wait_s, raylet_ended.func))
    monkeypatch.setattr(ray_cluster.ray, "init", lambda **kwargs: patient_during_init.append(services.get_node))
    ray_cluster.init_local_ray(address="local")
    assert patient_during_init == [("patient", ray_own, ray_cluster.REGISTRATION_WAIT_S, ray_cluster.raylet_ended)]
    assert services.get_node is ray_own  # restored after the start
    monkeypatch.setattr(ray_cluster.ray, "shutdown", lambda: None)
    monkeypatch.setattr(ray_cluster.ray, "init", init([late, ray_cluster.RayletEnded("ended"), "context"]))
    assert ray_cluster.init_local_ray(address="local") == "context" and len(calls) == 3
    calls.clear()
    monkeypatch.setattr(ray_cluster.ray, "init", init([late]))
    with pytest.raises(ray_cluster.RayStartError) as failed:
        ray_cluster.init_local_ray(address="local")
    assert len(calls) == ray_cluster.STARTUP_TRIES
    assert "\n" not in str(failed.value) and "load average" in str(failed.value)
    assert f"on {ray_cluster.STARTUP_TRIES} tries" in str(failed.value)
    calls.clear()
    monkeypatch.setattr(ray_cluster.ray, "init", init([ValueError("bad resources")]))
    with pytest.raises(ValueError, match="bad resources"):
        ray_cluster.init_local_ray(address="local")
    assert len(calls) == 1


# A process of a Ray session: it opens the log named by LOG for writing, says so, and sleeps; its
# command line names the session only when asked to (the GCS, the raylet), as Ray's retitled agents' do not.
SESSION_PROCESS = ("import os, time; f = open(os.environ['LOG'], 'a'); print('open', flush=True); "
                   "time.sleep(600)")


def test_a_failed_start_try_is_stopped_by_its_session_directory_and_nothing_else(monkeypatch, tmp_path):
    """What a try whose node missed its window started is stopped before the next try, found by the session directory
    Ray named after this process: the processes naming it and those only writing its logs (the agents, retitled, and
    re-parented when the raylet gave up). Another cluster's session, and one this process started before the try,
    keep theirs; the next try's session does not exist yet."""
    from openrlhf_tis.cli import ray_cluster

    temp = tmp_path / "ray"
    earlier = temp / f"session_2026-01-01_00-00-00_000001_{os.getpid()}"
    other = temp / "session_2026-01-01_00-00-00_000002_1"  # another cluster on the machine
    tried = temp / f"session_2026-01-01_00-00-01_000003_{os.getpid()}"
    started: dict[str, list[subprocess.Popen]] = {}

    def start_session(session: Path) -> None:
        (session / "logs").mkdir(parents=True)
        env = {**os.environ, "LOG": str(session / "logs" / "agent.log")}
        writer = subprocess.Popen([sys.executable, "-c", SESSION_PROCESS], stdout=subprocess.PIPE, text=True, env=env)
        naming = subprocess.Popen([sys.executable, "-c", SESSION_PROCESS, str(session)], stdout=subprocess.PIPE,
                                  text=True, env={**env, "LOG": str(session / "logs" / "gcs_server.out")})
        assert writer.stdout.readline() == naming.stdout.readline() == "open\n"
        started[session.name] = [writer, naming]

    def ray_init(**kwargs):
        assert kwargs["_temp_dir"] == str(temp)
        if tried.name in started:
            return "context"
        start_session(tried)
        raise Exception("The current node timed out during startup. This could happen because ...")

    monkeypatch.setattr(ray_cluster.ray, "init", ray_init)
    monkeypatch.setattr(ray_cluster.ray, "shutdown", lambda: None)
    start_session(earlier)
    start_session(other)
    try:
        assert ray_cluster.init_local_ray(address="local", _temp_dir=str(temp)) == "context"
        assert [proc.poll() is not None for proc in started[tried.name]] == [True, True]
        assert [proc.poll() for name in (earlier.name, other.name) for proc in started[name]] == [None] * 4
    finally:
        for proc in (proc for procs in started.values() for proc in procs):
            proc.kill()
            proc.wait()
            proc.stdout.close()


def test_a_patient_get_node_asks_again_until_its_window_closes():
    """Ray's node start gives up 30 s after a failed `get_node`: the patient one keeps asking (1 s apart) while the
    node is not in the GCS yet, for its whole window, then raises Ray's own error; other errors at once."""
    from openrlhf_tis.cli.ray_cluster import RayletEnded, patient_get_node

    now = [0.0]
    asked = []

    def get_node(outcomes):
        def fake(address, node_id):
            asked.append((address, node_id, now[0]))
            outcome = outcomes[min(len(asked), len(outcomes)) - 1]
            if isinstance(outcome, Exception):
                raise outcome
            return outcome
        return fake

    def sleep(seconds):
        now[0] += seconds

    absent = RuntimeError("RPC error: Deadline Exceeded")
    patient = patient_get_node(get_node([absent] * 4 + ["node"]), 100.0, clock=lambda: now[0], sleep=sleep)
    assert patient("gcs:1", "n1") == "node"
    assert [t for _, _, t in asked] == [0.0, 1.0, 2.0, 3.0, 4.0] and {a[:2] for a in asked} == {("gcs:1", "n1")}
    asked.clear()
    now[0] = 0.0
    with pytest.raises(RuntimeError, match="Deadline Exceeded"):
        patient_get_node(get_node([absent]), 10.0, clock=lambda: now[0], sleep=sleep)("gcs:1", "n1")
    assert len(asked) == 11 and now[0] == 10.0  # asked at 0, 1, ..., 10 s: the whole window, no more
    asked.clear()
    with pytest.raises(ValueError, match="bad node id"):
        patient_get_node(get_node([ValueError("bad node id")]), 10.0, clock=lambda: now[0], sleep=sleep)("g", "n")
    assert len(asked) == 1
    asked.clear()
    now[0] = 0.0
    checks = []
    ended_after_two = patient_get_node(get_node([absent]), 100.0, raylet_ended=lambda: checks.append(now[0]) or
                                       len(checks) > 2, clock=lambda: now[0], sleep=sleep)
    with pytest.raises(RayletEnded):  # a raylet that ended cannot register: no waiting out the window
        ended_after_two("g", "n")
    assert len(asked) == 3 and checks == [0.0, 1.0, 2.0]


def test_a_try_whose_raylet_ended_is_one_whose_session_has_no_raylet_running(tmp_path):
    """raylet_ended reads the sessions this process started since the try began: a raylet running in one of them
    (found by its session, cli/lifetime.py session_processes) means the node may still register; one in another
    session, this process's earlier one included, does not count."""
    from openrlhf_tis.cli.ray_cluster import raylet_ended

    temp = tmp_path / "ray"
    earlier = temp / f"session_2026-01-01_00-00-00_000001_{os.getpid()}"
    tried = temp / f"session_2026-01-01_00-00-01_000002_{os.getpid()}"
    earlier.mkdir(parents=True)
    before = {str(earlier)}
    raylet = tmp_path / "raylet"  # a process named raylet (its executable's name), as Ray's is
    raylet.symlink_to(sys.executable)
    in_earlier = subprocess.Popen([raylet, "-c", "import time; time.sleep(600)", str(earlier)])
    try:
        assert raylet_ended(str(temp), before)  # the try's session is not even made yet
        tried.mkdir()
        assert raylet_ended(str(temp), before)  # made, but its raylet is not started (or ended)
        in_tried = subprocess.Popen([raylet, "-c", "import time; time.sleep(600)", str(tried)])
        try:
            deadline = time.monotonic() + 30  # the process table, read by psutil, may lag under load
            while raylet_ended(str(temp), before) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert not raylet_ended(str(temp), before)
        finally:
            in_tried.kill()
            in_tried.wait()
        assert raylet_ended(str(temp), before)
    finally:
        in_earlier.kill()
        in_earlier.wait()


def test_patient_ray_is_rays_command_line_with_the_nodes_wait(monkeypatch):
    """`python -m openrlhf_tis.cli.patient_ray ARGS` runs Ray's own command line on ARGS while `get_node` asks again
    for a node not yet in the GCS (Ray's raises RuntimeError), and restores Ray's after."""
    import ray.scripts.scripts as ray_scripts
    from ray._private import services

    calls = []

    def not_yet_twice(gcs_address, node_id):
        calls.append(node_id)
        if len(calls) < 3:
            raise RuntimeError("node not found")
        return {"node_id": node_id}

    seen = {}

    def ray_main():
        seen["argv"] = list(sys.argv)
        seen["node"] = services.get_node("127.0.0.1:1", "abc")
        seen["client"] = ray_scripts.get_ray_client_dependency_error() is None

    monkeypatch.setattr(services, "get_node", not_yet_twice)
    monkeypatch.setattr(ray_scripts, "main", ray_main)
    monkeypatch.setattr(sys, "argv", ["patient_ray"])
    patient_ray.main(["start", "--head", "--block"])
    assert seen == {"argv": ["ray", "start", "--head", "--block"], "node": {"node_id": "abc"}, "client": True}
    assert calls == ["abc"] * 3 and services.get_node is not_yet_twice
    patient_ray.main(["--no-ray-client", "start", "--head"])  # `ray start` then starts no Ray Client server
    assert seen["argv"] == ["ray", "start", "--head"] and seen["client"] is False
    assert ray_scripts.get_ray_client_dependency_error() is None  # restored (grpc is installed with Ray)
    with pytest.raises(SystemExit, match="--no-ray-client and --ray-client-server-port contradict"):
        patient_ray.main(["--no-ray-client", "start", "--head", "--ray-client-server-port=10002"])


def test_the_leftover_check_finds_a_retitled_writer_and_a_process_naming_the_folder_but_not_a_reader(tmp_path):
    """The e2e tests' "nothing left" check (`processes_naming`) must see a process whose command line names nothing
    (as Ray's retitled agents) but which writes a log under the folder, and one naming the folder even where its
    path says "pytest" (as pytest's temp dirs do); a reader of a log is not left over."""
    from _support import processes_naming

    log = tmp_path / "session" / "logs" / "agent.out"
    log.parent.mkdir(parents=True)
    log.write_text("")
    hold = "import os, sys, time; f = open(os.environ['F'], sys.argv[1]); print('open', flush=True); time.sleep(60)"
    env = {**os.environ, "F": str(log)}
    writer = subprocess.Popen([sys.executable, "-c", hold, "a"], env=env, stdout=subprocess.PIPE, text=True)
    reader = subprocess.Popen([sys.executable, "-c", hold, "r"], env=env, stdout=subprocess.PIPE, text=True)
    naming = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", str(tmp_path / "run")])
    try:
        assert writer.stdout.readline() == reader.stdout.readline() == "open\n"
        found = processes_naming(tmp_path)
        assert "pytest" in str(tmp_path) and set(found) == {writer.pid, naming.pid}, found
    finally:
        for proc in (writer, reader, naming):
            proc.kill()
            proc.wait()
    assert processes_naming(tmp_path) == {}
