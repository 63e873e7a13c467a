"""Nothing of a local Ray session the CLI started outlives its driver, or a failed start try, on a real Ray.

The CLI starts Ray with `cli/ray_cluster.py` `init_local_ray` and arms `cli/lifetime.py` `reap_when_gone`; a driver
here does the same with a tiny cluster (one CPU, one actor) and no model. The reference for "every process of the
session" is the driver's process tree read while it lived (GCS, raylet, dashboard, monitors, agents, workers, the
watchdog), by pid and start time, not the watchdog's own way of finding them (command line, files written). Without
the watchdog the agents outlived a SIGKILLed driver by about a minute (docs/run_store.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from _support import machine_load, processes_naming

from openrlhf_tis.cli.lifetime import stop_session

pytestmark = pytest.mark.e2e

START_S = 400  # Ray's start on 2 cores busy with other work: its tries end within 30-60 s when the raylet aborts
AGENTS = {"ray::DashboardAgent", "ray::RuntimeEnvAgent"}  # the raylet starts them; ray.init does not wait for them
GONE_S = 30  # the watchdog's grace (3 s), its SIGTERM and SIGKILL (3 s more), and psutil's scans, on 2 busy cores

DRIVER = textwrap.dedent("""
    import os, sys, time
    import ray
    from openrlhf_tis.cli import ray_cluster
    from openrlhf_tis.cli.lifetime import reap_when_gone

    os.environ.update(ray_cluster.RAY_START_ENV)  # as start_ray does
    context = ray_cluster.init_local_ray(address="local", include_dashboard=False, num_cpus=1)
    reap_when_gone(context.address_info["session_dir"])

    @ray.remote(num_cpus=0)
    class Worker:
        def pid(self):
            return os.getpid()

    worker = Worker.remote()
    print(ray.get(worker.pid.remote()), flush=True)  # a worker of the session is up
    time.sleep(600)
""")

FAILING_DRIVER = textwrap.dedent("""
    import contextlib, json, os, time
    import psutil
    from ray._private import services
    from openrlhf_tis.cli import ray_cluster

    os.environ.update(ray_cluster.RAY_START_ENV)
    rays_own = services.get_node
    provoked = []
    stop_session = ray_cluster.stop_session

    def stop_and_say(session_dir):  # init_local_ray stops a failed try's session with this before the next try
        stop_session(session_dir)
        print("stopped", session_dir, flush=True)

    def late_node(gcs_address, node_id):
        # The try's node registered, but the try misses its window once its agents run, and its raylet has given up:
        # as measured at a load of 8.5, the raylet aborted (its dashboard agent's ports not written in 15 s) and its
        # agents lived on, re-parented.
        node = rays_own(gcs_address, node_id)  # RuntimeError until the raylet registered: init_local_ray asks again
        if provoked:
            return node
        provoked.append(node_id)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            tree = psutil.Process().children(recursive=True)
            titles = set()
            for proc in tree:
                with contextlib.suppress(psutil.Error):
                    titles.add(" ".join(proc.cmdline()).strip())
            if {"ray::DashboardAgent", "ray::RuntimeEnvAgent"} <= titles:
                break
            time.sleep(0.5)
        print(json.dumps({proc.pid: proc.create_time() for proc in tree}), flush=True)
        raylet = next(proc for proc in tree if proc.name() == "raylet")
        raylet.kill()
        raylet.wait()
        raise Exception("The current node timed out during startup (provoked by the test)")

    services.get_node = late_node
    ray_cluster.stop_session = stop_and_say
    ray_cluster.init_local_ray(address="local", include_dashboard=False, num_cpus=1)  # the next try's start
    time.sleep(600)
""")


@pytest.fixture()
def ray_tmp():
    """A Ray temp dir of the test's own (short: Ray's socket paths must fit in 107 bytes); whatever of it is left
    at the end is killed."""
    path = tempfile.mkdtemp(prefix="rs", dir="/tmp")
    yield path
    for session in Path(path, "ray").glob("session_2*"):
        stop_session(str(session))
    shutil.rmtree(path, ignore_errors=True)


def _start(code: str, ray_tmp: str, log: Path) -> subprocess.Popen:
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    env["RAY_TMPDIR"] = ray_tmp
    with log.open("w") as err:
        return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=err, text=True, env=env)


def _line(proc: subprocess.Popen, log: Path, timeout: float) -> str:
    """The driver's next stdout line, failing with its log's tail and the machine's load after `timeout` seconds."""
    import select

    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else ""
    ended = "" if proc.poll() is None else f", it ended with exit code {proc.returncode}"
    assert line, f"no line from the driver within {timeout:.0f} s{ended} ({machine_load()}):\n{log.read_text()[-3000:]}"
    return line.strip()


def _tree(root: int) -> dict[int, tuple[float, str]]:
    """pid -> (start time, title) of `root`'s descendants."""
    found = {}
    for proc in psutil.Process(root).children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            found[proc.pid] = (proc.create_time(), " ".join(proc.cmdline()).strip()[:80])
    return found


def _has_agents(tree: dict[int, tuple[float, str]]) -> bool:
    return all(any(title.startswith(agent) for _, title in tree.values()) for agent in AGENTS)


def _alive(tree: dict[int, tuple[float, str]]) -> dict[int, str]:
    """Those of `tree` still running (the same pid and start time, no zombie)."""
    alive = {}
    for pid, (started, title) in tree.items():
        try:
            proc = psutil.Process(pid)
            if proc.create_time() == started and proc.status() != psutil.STATUS_ZOMBIE:
                alive[pid] = title
        except psutil.NoSuchProcess:
            pass
    return alive


def test_a_sigkilled_drivers_ray_session_ends_within_seconds(ray_tmp, tmp_path):
    log = tmp_path / "driver.log"
    driver = _start(DRIVER, ray_tmp, log)
    try:
        worker = int(_line(driver, log, START_S))  # Ray is up, the watchdog armed, a worker answered
        # Ray's default lowers a worker's priority by 15 below the driver's: beside other work a run then stalls.
        assert psutil.Process(worker).nice() == psutil.Process(driver.pid).nice()
        deadline = time.monotonic() + 120
        while not _has_agents(tree := _tree(driver.pid)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _has_agents(tree), "the session's agents did not show up; its processes:\n" + "\n".join(
            f"{pid}: {title}" for pid, (_, title) in tree.items())
        driver.kill()
        driver.wait()
        killed = time.monotonic()
        while (_alive(tree) or processes_naming(ray_tmp)) and time.monotonic() - killed < GONE_S:
            time.sleep(0.5)
        assert _alive(tree) == {} and processes_naming(ray_tmp) == {}, (_alive(tree), machine_load())
        print(f"{len(tree)} processes of the session, all ended {time.monotonic() - killed:.1f} s after the kill "
              f"({machine_load()})")
    finally:
        driver.kill()
        driver.wait()
        driver.stdout.close()


def test_a_failed_start_try_leaves_nothing_of_its_session(ray_tmp, tmp_path):
    """What the try started is stopped before init_local_ray goes on to its next try, agents included, though the
    raylet's end re-parented them. That nothing of another cluster or of the next try is touched is checked with
    fakes (test_loaded_machine.py)."""
    log = tmp_path / "driver.log"
    driver = _start(FAILING_DRIVER, ray_tmp, log)
    try:
        line = _line(driver, log, START_S)
        while line.startswith("stopped "):  # a try whose raylet aborted on its own, before its node registered
            line = _line(driver, log, START_S)
        tree = {int(pid): (started, "") for pid, started in json.loads(line).items()}
        stopped = _line(driver, log, 60)
        assert stopped.startswith("stopped "), stopped
        assert _alive(tree) == {} and processes_naming(stopped.split(" ", 1)[1]) == {}, (_alive(tree), machine_load())
    finally:
        driver.kill()
        driver.wait()
        driver.stdout.close()
