"""The cluster launch OpenRLHF users know: `ray job submit --address … -- python -m openrlhf_tis.cli.train_ppo_ray …`
against a Ray cluster that was already running (`ray start --head` on 127.0.0.1, with the dashboard `ray job
submit` talks to), training the tiny model to completion with its run directory written.

The cluster is this test's own (_support.ray_head: its own temp dir and ports, stopped by PID, never `ray stop`).
It declares logical GPU slots for CPU processes, so the run says `--cluster.device cpu` (auto would read a GPU
cluster there).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from _support import RAY, free_port, ray_head, train_argv

from openrlhf_tis.demo.task import write_prompts

pytestmark = [
    pytest.mark.e2e,
]
STEPS = 2
# Logical slots the tiny run's placement asks for (cli/ray_cluster.declared_gpus: 1 actor + 1 vLLM engine; no
# reference model with KL 0, a local reward); a CPU cluster declares them as "GPUs" (docs/design.md §5).
GPU_SLOTS = 2
START_S = 300


@contextlib.contextmanager
def ray_cluster(env: dict[str, str], log: Path) -> Iterator[str]:
    """A head node on 127.0.0.1 with its dashboard; yields the dashboard's address."""
    dashboard, agent = free_port(), free_port()
    options = ["--num-cpus", "8", "--num-gpus", str(GPU_SLOTS), "--include-dashboard", "true",
               "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard),
               "--dashboard-agent-listen-port", str(agent), "--ray-client-server-port", str(free_port())]
    address = f"http://127.0.0.1:{dashboard}"
    # a job goes through the node's agent
    with ray_head(options, env, log, lambda: _answers(f"{address}/api/jobs/") and _listening(agent), START_S):
        yield address


def _answers(url: str) -> bool:
    with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=5) as reply:
        return reply.status == 200
    return False


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_ray_job_submit_trains_on_an_existing_cluster(tiny_model_dir, tmp_path):
    work = tmp_path
    write_prompts(work / "prompts.jsonl", 4 * STEPS)
    # The cluster's processes, hence the job's driver, run `python` from this venv and import this checkout.
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    # Each dashboard module gets 30 s to start by default; on a loaded 2-core machine some took longer.
    env["RAY_DASHBOARD_SUBPROCESS_MODULE_WAIT_READY_TIMEOUT"] = str(START_S)
    with ray_cluster(env, work / "ray_head.log") as address:
        train = [*train_argv(tiny_model_dir, work, STEPS, 0, save_steps=STEPS, load=False), "--cluster.device", "cpu"]
        # env_vars the job sets that the fork sets too (upstream's README passes a runtime env the same way)
        job_env = json.dumps({"env_vars": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}})
        submit = [str(RAY), "job", "submit", "--address", address, "--runtime-env-json", job_env, "--", *train]
        proc = subprocess.run(submit, env=env, cwd=work, capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    logs = work / "ray_logs"
    server_logs = "".join(f"\n--- {name}\n" + (logs / name).read_text()[-2000:]
                          for name in ("dashboard.log", "dashboard_agent.log") if (logs / name).is_file())
    assert proc.returncode == 0, log[-6000:] + server_logs
    assert "succeeded" in log, log[-3000:]
    steps = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1)), log[-3000:]
