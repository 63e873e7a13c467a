"""The fork's whole delta against upstream behaviour (see README.md in this folder).

Nothing here runs on import. Call `apply_platform_patches()` explicitly; the CLI does so in the
driver and hands the same call to every Ray worker (`ray_worker_setup`, a `worker_process_setup_hook`) and to every
vLLM process (`vllm_plugin`, a `vllm.general_plugins` entry point that acts only when the CLI asked
for it through OPENRLHF_TIS_PATCHES=1). Each patch is idempotent and decides for itself whether it
applies (the cpu_* ones only where CUDA is absent).
"""

from __future__ import annotations

import os

ENV_FLAG = "OPENRLHF_TIS_PATCHES"


def apply_platform_patches() -> list[str]:
    """Apply every platform patch that applies in this process; return the names applied now.

    The fork's own classes are wired in separately, in the driver only (fork_classes.apply()).
    """
    from . import (
        cpu_flash_attn,
        cpu_fp32_head,
        cpu_int8_sync,
        cpu_replay_buffer,
        cpu_torch_cuda,
        cpu_weight_sync,
        fp32_training,
    )

    applied = []
    for patch in (cpu_torch_cuda, cpu_flash_attn, cpu_replay_buffer, cpu_weight_sync, cpu_int8_sync, cpu_fp32_head,
                  fp32_training):
        if patch.apply():
            applied.append(patch.NAME)
    return applied


def ray_worker_setup() -> None:
    """Ray `worker_process_setup_hook`: every Ray worker of a fork run gets the same patches."""
    apply_platform_patches()


def vllm_plugin() -> None:
    """vLLM general plugin: covers vLLM processes spawned outside Ray's hook (multiprocess engines)."""
    if os.environ.get(ENV_FLAG) == "1":
        apply_platform_patches()
