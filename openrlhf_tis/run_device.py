"""The device a run computes on, decided once by the driver and read by every process of the run.

A process of a run never asks its own `torch.cuda` what the run is: a driver on a CPU-only head of a GPU
cluster would call a CUDA run a CPU one, and a Ray worker that touches CUDA before Ray hands it its GPU
(`CUDA_VISIBLE_DEVICES` is set when the actor's task runs, after the worker process started) initialises
CUDA on every GPU of its node, so each rank lands on GPU 0. The driver decides (cli/cluster_device.py) and
writes the decision to `OPENRLHF_TIS_RUN_DEVICE`, which travels with the run: the Ray runtime environment of
every worker, and the environment of every vLLM process those workers spawn.
"""

from __future__ import annotations

import os

DEVICE_ENV = "OPENRLHF_TIS_RUN_DEVICE"
RUN_DEVICES = ("cpu", "cuda")


def check_run_device(device: str) -> str:
    """`device` if it is a run's device (cpu or cuda); ValueError otherwise."""
    if device not in RUN_DEVICES:
        raise ValueError(f"a run's device is one of {', '.join(RUN_DEVICES)}, got {device!r}")
    return device


def run_device() -> str:
    """The device of the run this process belongs to, as its driver decided; RuntimeError outside a fork run."""
    device = os.environ.get(DEVICE_ENV)
    if device not in RUN_DEVICES:
        raise RuntimeError(
            f"{DEVICE_ENV} is {device!r}: this process is not part of an openrlhf_tis run, whose driver sets it to "
            f"{' or '.join(RUN_DEVICES)} for every process (start runs with openrlhf_tis.cli.train_ppo_ray)")
    return device


def is_cuda_run() -> bool:
    """Whether this process's run computes on CUDA (run_device)."""
    return run_device() == "cuda"
