"""Start Ray for a fork run so every worker gets the fork's patches and, on CPU, can be scheduled.

A fork run starts its own Ray (`address="local"`) unless `RAY_ADDRESS` names a cluster: a plain
`ray.init()` would join whatever cluster Ray's address file (`ray_current_cluster`, left by `ray start`,
even a dead one) points at, and then reject the CPU run's `num_cpus`/`num_gpus`. A `RAY_ADDRESS` is
checked first (cli/ray_address.py), so one where no Ray answers fails in one line instead of retrying for
minutes. What a local cluster leaves after its driver is killed is stopped by cli/lifetime.py.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import glob
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import ray

from openrlhf_tis.cli.agent_ports import agent_ports_given
from openrlhf_tis.cli.build_locks import clear_stale_build_locks
from openrlhf_tis.cli.lifetime import reap_when_gone, session_processes, stop_session
from openrlhf_tis.cli.ray_address import ADDRESS_VAR, check_ray_address
from openrlhf_tis.errors import UsageError
from openrlhf_tis.run_device import DEVICE_ENV, check_run_device
from openrlhf_tis.upstream_guards import require_version, swapped

# Upstream's own ray.init env defaults (openrlhf/cli/train_ppo_ray.py train()), kept when the fork
# starts Ray first, plus what a CPU run needs (docs/design.md §5): a small vLLM KV cache, in-process engine cores where
# vLLM offers them (its synchronous LLM engine; the rollout actor's AsyncLLMEngine always starts an EngineCore
# process), and no hub access.
UPSTREAM_ENV = {"TOKENIZERS_PARALLELISM": "true", "NCCL_DEBUG": "WARN", "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}
# The raylet aborts when its agents (Python processes) are not up within this time (30 s by default): on a
# loaded 2-core machine they can take longer, and the node then never registers (see init_local_ray).
# Ray's workers lower their own priority by 15 (RAY_worker_niceness, default 15), and every actor of a run (trainer,
# engines) is a worker: beside any program at the default priority they get ~3% of a core each (CFS weights 36 vs
# 1024) and a run stalls. Measured with a busy loop on each of 2 cores: the e2e runs made no step in 900 s at 15; at 0
# they share the cores like the rest (docs/measurements.md, 2026-12-06). 0 keeps them at the driver's priority.
# Ray also starts a default worker per CPU when the first driver connects; every actor of a run needs the run's
# runtime_env (its env_vars and setup hook), which a default worker lacks, so those workers only import Ray and idle:
# 2 x 7 s of CPU in the start of a run on 2 cores (docs/measurements.md, thirteenth sitting).
RAY_START_ENV = {"RAY_agent_register_timeout_ms": "120000", "RAY_worker_niceness": "0",
                 "RAY_prestart_worker_first_driver": "0"}
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1"}


def worker_env(device: str) -> dict[str, str]:
    """Environment for the driver and every Ray worker of a `device` run (cpu or cuda); values the user already set
    win, except the run's device itself.

    A CUDA run carries only the run's device and upstream's defaults: its workers run on GPU nodes with their own
    PATH and their own CUDA builds. A CPU run (this machine, or a cluster of CPU nodes set up the same way) also
    gets the CPU settings, the set-up's prebuilt DeepSpeed ops and the venv's own tools first on PATH (see
    `path_with_venv_first`)."""
    cpu = check_run_device(device) == "cpu"
    defaults = {**UPSTREAM_ENV, **RAY_START_ENV, **(CPU_ENV if cpu else {})}
    prebuilt_ops = os.path.join(sys.prefix, "torch_extensions")  # scripts/setup_env.sh builds DeepSpeed's here
    if cpu and os.path.isdir(prebuilt_ops):
        defaults["TORCH_EXTENSIONS_DIR"] = prebuilt_ops
    env = {key: os.environ.get(key, value) for key, value in defaults.items()}
    env[DEVICE_ENV] = device
    if cpu:
        env["PATH"] = path_with_venv_first(os.environ.get("PATH", ""))
    return env


def path_with_venv_first(path: str) -> str:
    """`path` with this interpreter's bin directory first.

    torch builds DeepSpeed's ops with the first `ninja` on PATH, and ninja 1.11 (Debian's) and 1.13 (the venv's, a
    dependency of deepspeed and vllm) hash a build command differently: a run that finds the other one rebuilds
    every op (~90 s each on 2 cores) and holds their build locks meanwhile. The set-up builds with the venv's.
    """
    venv_bin = os.path.dirname(sys.executable)
    rest = [entry for entry in path.split(os.pathsep) if entry and entry != venv_bin]
    return os.pathsep.join([venv_bin, *rest])


def declared_gpus(args: argparse.Namespace) -> int:
    """How many GPU slots upstream's placement groups and actors will ask for (flat, dotted args)."""

    def slots(role: str) -> int:
        return getattr(args, f"{role}.num_nodes") * getattr(args, f"{role}.num_gpus_per_node")

    total = slots("actor")
    if getattr(args, "algo.kl.init_coef") > 0:
        total += slots("ref")
    if getattr(args, "algo.advantage.estimator") == "gae":
        total += slots("critic")
    if not getattr(args, "reward.remote_url"):
        total += slots("reward")
    total += (getattr(args, "vllm.num_engines") or 0) * getattr(args, "vllm.tensor_parallel_size")
    return total


def start_ray(args: argparse.Namespace, device: str) -> None:
    """ray.init for a `device` run with the patch hook; on CPU, declare GPU slots so upstream's placement groups
    schedule.

    Raises UsageError naming RAY_ADDRESS when the cluster it names cannot be reached.
    """
    env = worker_env(device)
    cpu = device == "cpu"
    os.environ.update(env)
    clear_stale_build_locks(env)  # before any worker could wait on one
    runtime_env = {"env_vars": env, "worker_process_setup_hook": "openrlhf_tis.patches.ray_worker_setup"}
    address = os.environ.get(ADDRESS_VAR)
    if address:
        check_ray_address(address)
        # Under `ray job submit --runtime-env-json '{"env_vars": ...}'` Ray refuses to merge the job's env_vars
        # with these when a key repeats; the values here already are the job's where it set them (see worker_env).
        os.environ.setdefault("RAY_OVERRIDE_JOB_RUNTIME_ENV", "1")
        try:
            ray.init(runtime_env=runtime_env)
        except ConnectionError as err:
            raise UsageError(ADDRESS_VAR, f"cannot join the Ray cluster at {address}: {err}") from None
        return
    kwargs = {}
    if cpu:
        # Logical resources only: a "GPU" here is a scheduling slot for one CPU process.
        gpus = declared_gpus(args)
        kwargs = {"num_gpus": gpus, "num_cpus": max(os.cpu_count() or 1, gpus + 4)}
    context = init_local_ray(address="local", include_dashboard=False, runtime_env=runtime_env, **kwargs)
    reap_when_gone(context.address_info["session_dir"])  # its agents must not outlive a killed run


STARTUP_TRIES = 3
REGISTRATION_WAIT_S = 180.0
"""How long one try waits for its raylet to register: Ray 2.55's node start allows 30 s and cannot be told more
(ray/_private/node.py); on a loaded 2-core machine the raylet takes longer (measured: 5 tries of 30 s all missed at a
load average of 8.5-14.5 while a study and test runs shared the cores)."""
_THIS_FILE = "openrlhf_tis/cli/ray_cluster.py"


class RayStartError(RuntimeError):
    """A new local Ray cluster whose node missed the registration window on every try (a busy machine)."""


class RayletEnded(Exception):
    """A try's raylet ended before its node registered: waiting longer cannot help (measured at a load of 8.5 on 2
    cores: the raylet aborted 16 s after its start, its dashboard agent's ports not written within Ray's fixed 15 s)."""


def machine_load() -> str:
    """The load averages and the cores, as a failure on a busy machine should say them."""
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.1f} / {five:.1f} / {fifteen:.1f} (1 / 5 / 15 min) on {os.cpu_count()} cores"


def patient_get_node(get_node: Callable[[str, str], Any], wait_s: float, *,
                     raylet_ended: Callable[[], bool] = lambda: False,
                     clock: Callable[[], float] = time.monotonic,
                     sleep: Callable[[float], None] = time.sleep) -> Callable[[str, str], Any]:
    """Ray's `services.get_node`, asked again for `wait_s` while the node is not yet in the GCS (RuntimeError):
    Ray's start loop checks its 30 s only after a call returns, so one patient call is the window Ray lacks a
    setting for. Any other error, and the last RuntimeError after `wait_s`, is raised as Ray raised it; RayletEnded
    as soon as `raylet_ended()` says the node can no longer register."""
    def patient(gcs_address: str, node_id: str) -> Any:
        deadline = clock() + wait_s
        while True:
            try:
                return get_node(gcs_address, node_id)
            except RuntimeError:
                if raylet_ended():
                    raise RayletEnded("the raylet ended before its node registered") from None
                if clock() >= deadline:
                    raise
                sleep(1.0)
    return patient


def init_local_ray(**kwargs):
    """ray.init for a new local cluster whose raylet gets `REGISTRATION_WAIT_S` to register, tried again if missed.

    While ray.init starts the node, Ray's `services.get_node` is the patient one (`patient_get_node`; restored
    after), and the node's agent ports are chosen before its raylet starts (cli/agent_ports.py). A try whose node
    still missed the window raises "node timed out during startup", or RayletEnded at once when its raylet ended
    (aborted) before registering; what the try started is stopped before the next one, found by the try's session
    directory (`started_sessions`, then cli/lifetime.py `stop_session`): its GCS and raylet
    (children of this process that Ray no longer tracks), and its agents, re-parented when the raylet gave up. Any
    other error is raised at once; the last try's failure raises RayStartError, one line with the machine's load
    (the CLI prints it as it is).
    """
    from ray._common.utils import get_default_ray_temp_dir
    from ray._private import services

    require_version("ray", "==2.55.0", patch=_THIS_FILE)
    temp_dir = kwargs.get("_temp_dir") or get_default_ray_temp_dir()
    for attempt in range(1, STARTUP_TRIES + 1):
        before = started_sessions(temp_dir)
        ended = functools.partial(raylet_ended, temp_dir, before)
        try:
            with swapped(services, "get_node", patient_get_node(services.get_node, REGISTRATION_WAIT_S,
                                                                raylet_ended=ended), patch=_THIS_FILE), \
                    agent_ports_given():
                return ray.init(**kwargs)
        except Exception as err:  # Ray raises a bare Exception here
            if not isinstance(err, RayletEnded) and "timed out during startup" not in str(err):
                raise
            ray.shutdown()
            for session_dir in sorted(started_sessions(temp_dir) - before):
                stop_session(session_dir)
            if attempt == STARTUP_TRIES:
                raise RayStartError(f"Ray's node did not register on {STARTUP_TRIES} tries of up to "
                                    f"{REGISTRATION_WAIT_S:.0f} s ({machine_load()}): the machine is too busy to "
                                    "start Ray; run again when it is quieter") from None
            print(f"[openrlhf_tis] Ray's node did not register ({err if isinstance(err, RayletEnded) else 'in time'}; "
                  f"try {attempt} of {STARTUP_TRIES}, {machine_load()}); starting it again", file=sys.stderr)


def started_sessions(temp_dir: str) -> set[str]:
    """The session directories under Ray's `temp_dir` of the clusters this process started: Ray 2.55 names a new
    head's session `session_<date>_<pid of the process that started it>` (ray/_private/node.py). Those that appear
    during a try are the try's; another cluster on the machine, or the next try, is never among them."""
    return set(glob.glob(os.path.join(glob.escape(temp_dir), f"session_*_{os.getpid()}")))


def raylet_ended(temp_dir: str, before: set[str]) -> bool:
    """Whether no raylet runs in the sessions this process started under `temp_dir` since `before` (a try's)."""
    import psutil

    def is_raylet(proc) -> bool:
        with contextlib.suppress(psutil.Error):
            return proc.name() == "raylet"
        return False

    return not any(is_raylet(proc) for session_dir in started_sessions(temp_dir) - before
                   for proc in session_processes(session_dir))
