"""The fork's runtime patches. README.md in this folder holds the table of every substitution of upstream behaviour,
these patches and the few that live in the fork's own classes: that table is the whole delta.

Nothing here runs on import. Call `apply_platform_patches(device)` explicitly with the run's device, which the
driver decides once (cli/cluster_device.py): the CLI does so in the driver and hands the same call to every Ray
worker (`ray_worker_setup`, a `worker_process_setup_hook`) and to every vLLM process (`vllm_plugin`, a
`vllm.general_plugins` entry point that acts only in a fork run), both reading the decision from the run's
environment (openrlhf_tis.run_device). No patch asks `torch.cuda` whether it applies: a worker that touched
CUDA before Ray assigned it its GPU would see every GPU of its node. Each patch says on which devices it
applies (`DEVICES`) and is idempotent.
"""

from __future__ import annotations

import os

from openrlhf_tis.run_device import DEVICE_ENV, check_run_device, run_device


def platform_patches() -> tuple:
    """Every platform patch module, in the order they apply (each has NAME, DEVICES and apply())."""
    from . import (
        cpu_flash_attn,
        cpu_fp32_head,
        cpu_int8_sync,
        cpu_replay_buffer,
        cpu_torch_cuda,
        cpu_weight_sync,
        fp32_training,
    )

    return (cpu_torch_cuda, cpu_flash_attn, cpu_replay_buffer, cpu_weight_sync, cpu_int8_sync, cpu_fp32_head,
            fp32_training)


_APPLIED: set[str] = set()  # the patches this process has, each applied once whoever asks again


def apply_platform_patches(device: str) -> list[str]:
    """Apply every platform patch that applies on a `device` run (cpu or cuda) and that this process does not have
    yet; return the names applied now.

    Once per process and patch: a Ray worker that hosts a vLLM engine is reached by both the Ray hook and the vLLM
    plugin, and a process may start several in-process engines (each loads vLLM's plugins). The fork's own classes
    are wired in separately, in the driver only (fork_classes.apply()).
    """
    check_run_device(device)
    applied = []
    for patch in platform_patches():
        if device in patch.DEVICES and patch.NAME not in _APPLIED:
            if patch.apply():  # a patch that raises (an upstream out of range) is not recorded: it raises again
                applied.append(patch.NAME)
            _APPLIED.add(patch.NAME)
    return applied


def ray_worker_setup() -> None:
    """Ray `worker_process_setup_hook`: every Ray worker of a fork run gets the run's patches.

    Only the CLI registers this hook, with the run's device in the same runtime environment; a worker without it
    fails here, naming the variable, rather than guessing from its own hardware."""
    apply_platform_patches(run_device())


def vllm_plugin() -> None:
    """vLLM general plugin: covers vLLM processes spawned outside Ray's hook (multiprocess engines).

    Installed for every vLLM user of this environment, so it acts only in a fork run (its device set)."""
    if os.environ.get(DEVICE_ENV):
        apply_platform_patches(run_device())
