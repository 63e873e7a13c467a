"""A new Ray node's agent ports chosen before its raylet starts (cli/agent_ports.py): the parameters filled, the
raylet's command line given its agent's listen port, and — on a real Ray — a start that survives a stalled agent."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
from _support import machine_load

from openrlhf_tis.cli import agent_ports
from openrlhf_tis.cli.lifetime import stop_session


def test_open_ports_and_the_shared_default_listen_port_are_chosen_given_ones_kept():
    picks = iter(range(40001, 40010))
    params = SimpleNamespace(metrics_agent_port=None, metrics_export_port=0, dashboard_agent_listen_port=52365,
                             runtime_env_agent_port=51234)
    agent_ports.fill_agent_ports(params, default_listen_port=52365, pick=lambda: next(picks))
    assert vars(params) == {"metrics_agent_port": 40001, "metrics_export_port": 40002,
                            "dashboard_agent_listen_port": 40003, "runtime_env_agent_port": 51234}
    given = SimpleNamespace(metrics_agent_port=1, metrics_export_port=2, dashboard_agent_listen_port=3,
                            runtime_env_agent_port=4)
    agent_ports.fill_agent_ports(given, default_listen_port=52365, pick=lambda: pytest.fail("a given port replaced"))
    assert vars(given) == {"metrics_agent_port": 1, "metrics_export_port": 2, "dashboard_agent_listen_port": 3,
                           "runtime_env_agent_port": 4}


def test_a_free_port_can_be_bound():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", agent_ports.free_port()))


def test_the_raylet_is_given_the_listen_port_of_its_agents_command():
    agent = "/x/python -u /x/ray/dashboard/agent.py --node-ip-address=1.2.3.4 --grpc-port=0 --listen-port=40003 --head"
    raylet = ["/x/raylet", "--node_manager_port=0", f"--dashboard_agent_command={agent}", "--metrics-agent-port=1"]
    assert agent_ports.with_listen_port(raylet) == [*raylet, "--dashboard_agent_listen_port=40003"]
    given = [*raylet, "--dashboard_agent_listen_port=7"]
    assert agent_ports.with_listen_port(given) == given  # a raylet told its port already keeps it
    bare = ["/x/raylet", "--node_manager_port=0"]
    assert agent_ports.with_listen_port(bare) == bare


def test_ray_is_restored_after_the_block_even_on_error():
    from ray._private import node, services

    init, start = node.Node.__init__, services.start_ray_process
    with pytest.raises(RuntimeError), agent_ports.agent_ports_given():
        assert node.Node.__init__ is not init and services.start_ray_process is not start
        raise RuntimeError
    assert node.Node.__init__ is init and services.start_ray_process is start


STALLED_AGENT = textwrap.dedent("""
    import sys, threading, time
    import psutil, ray
    from openrlhf_tis.cli import ray_cluster

    def stall_the_agent():  # the raylet's dashboard agent, stopped for STALL_S as soon as it exists
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            for proc in psutil.Process().children(recursive=True):
                try:
                    if "dashboard/agent.py" in " ".join(proc.cmdline()):
                        proc.suspend()
                        print("stalled", flush=True)
                        time.sleep(float(sys.argv[2]))
                        proc.resume()
                        return
                except psutil.Error:
                    pass
            time.sleep(0.05)

    threading.Thread(target=stall_the_agent, daemon=True).start()
    start = time.monotonic()
    ray_cluster.init_local_ray(address="local", include_dashboard=False, num_cpus=1, _temp_dir=sys.argv[1])
    print(f"started {time.monotonic() - start:.1f}", flush=True)
    print("answered", ray.get(ray.remote(lambda: 41 + 1).remote(), timeout=300), flush=True)
    ray.shutdown()
""")


@pytest.mark.e2e
def test_a_start_whose_dashboard_agent_stalls_past_the_raylets_15_s_comes_up():
    """Without the ports given, an agent stopped for 25 s aborted the raylet at 15 s on every try (3 of 3, this
    machine); Ray's `RAY_agent_register_timeout_ms` did not change that. The try must come up in one go."""
    temp_dir = Path(tempfile.mkdtemp(prefix="rap", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    try:
        driver = subprocess.run([sys.executable, "-c", STALLED_AGENT, str(temp_dir), "25"], capture_output=True,
                                text=True, timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        sessions = sorted(temp_dir.glob("session_2*"))
        for session in sessions:
            stop_session(str(session))
        aborted = [line for s in sessions for log in s.glob("logs/raylet.err")
                   for line in log.read_text(errors="replace").splitlines() if "Timed out waiting for file" in line]
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
    out = driver.stdout
    assert driver.returncode == 0, f"{machine_load()}\n{out}\n{driver.stderr[-3000:]}"
    assert "stalled" in out and "answered 42" in out
    assert not aborted, aborted
    assert len(sessions) == 1  # no second try
