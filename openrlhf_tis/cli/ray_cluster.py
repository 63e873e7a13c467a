"""Start Ray for a fork run so every worker gets the fork's patches and, on CPU, can be scheduled."""

from __future__ import annotations

import argparse
import os
import sys

import ray

from openrlhf_tis.patches import ENV_FLAG

# Upstream's own ray.init env defaults (openrlhf/cli/train_ppo_ray.py train()), kept when the fork
# starts Ray first, plus what a CPU run needs (docs/design.md §5): a small vLLM KV cache, an in-process
# vLLM engine (starts in ~4 s instead of ~27 s), and no hub access.
UPSTREAM_ENV = {"TOKENIZERS_PARALLELISM": "true", "NCCL_DEBUG": "WARN", "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1"}


def worker_env(cpu: bool) -> dict[str, str]:
    """Environment for the driver and every Ray worker; values the user already set win."""
    defaults = {**UPSTREAM_ENV, **(CPU_ENV if cpu else {}), ENV_FLAG: "1"}
    prebuilt_ops = os.path.join(sys.prefix, "torch_extensions")  # scripts/setup_env.sh builds DeepSpeed's here
    if os.path.isdir(prebuilt_ops):
        defaults["TORCH_EXTENSIONS_DIR"] = prebuilt_ops
    return {key: os.environ.get(key, value) for key, value in defaults.items()}


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


def start_ray(args: argparse.Namespace, cpu: bool) -> None:
    """ray.init with the patch hook; on CPU, declare GPU slots so upstream's placement groups schedule."""
    env = worker_env(cpu)
    os.environ.update(env)
    runtime_env = {"env_vars": env, "worker_process_setup_hook": "openrlhf_tis.patches.ray_worker_setup"}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(runtime_env=runtime_env)
        return
    kwargs = {}
    if cpu:
        # Logical resources only: a "GPU" here is a scheduling slot for one CPU process.
        gpus = declared_gpus(args)
        kwargs = {"num_gpus": gpus, "num_cpus": max(os.cpu_count() or 1, gpus + 4)}
    init_local_ray(include_dashboard=False, runtime_env=runtime_env, **kwargs)


STARTUP_TRIES = 3


def init_local_ray(**kwargs) -> None:
    """ray.init for a new local cluster, tried again when its raylet misses Ray's fixed 30 s registration window.

    On a loaded 2-core machine (a test suite, another run) the raylet can take longer than Ray allows
    (ray/_private/node.py, not configurable) and ray.init raises "node timed out during startup"; the
    half-started cluster (its GCS and raylet, children of this process that Ray no longer tracks) is
    killed before the next try. Any other error is raised at once.
    """
    for attempt in range(1, STARTUP_TRIES + 1):
        try:
            ray.init(**kwargs)
            return
        except Exception as err:  # Ray raises a bare Exception here
            if "timed out during startup" not in str(err) or attempt == STARTUP_TRIES:
                raise
            print(f"[openrlhf_tis] Ray's node did not register in time (try {attempt} of {STARTUP_TRIES}); "
                  "starting it again", file=sys.stderr)
            ray.shutdown()
            _kill_ray_children()


def _kill_ray_children() -> None:
    import psutil

    ours = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if "ray" in " ".join(proc.cmdline()).lower():
                proc.kill()
                ours.append(proc)
        except psutil.Error:  # already gone
            pass
    psutil.wait_procs(ours, timeout=10)
