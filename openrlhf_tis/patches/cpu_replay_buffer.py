"""CPU patch: the replay buffer's target device.

openrlhf/trainer/ppo_utils/replay_buffer.py:40 builds `torch.device(f"cuda:{current_device()}")`,
which is "cuda:cpu" on a CPU machine (an invalid device string). The buffer is built with
current_device() answering 0 and its target device is then set to the CPU.
Applied only in a CPU run (DEVICES).
"""

from __future__ import annotations

import torch

from openrlhf_tis.import_hooks import after_import
from openrlhf_tis.upstream_guards import PatchTargetMissingError, replace, require_version

NAME = "cpu_replay_buffer"
DEVICES = ("cpu",)  # the run's device, decided by its driver (patches/__init__.py)


def _patch(module) -> None:
    buffer_cls = getattr(module, "NaiveReplayBuffer", None)
    if buffer_cls is None:
        raise PatchTargetMissingError(f"patch {NAME!r}: {module.__name__}.NaiveReplayBuffer no longer exists upstream")

    def __init__(self, *args, **kwargs):
        current_device = torch.cuda.current_device
        torch.cuda.current_device = lambda: 0
        try:
            upstream_init(self, *args, **kwargs)
        finally:
            torch.cuda.current_device = current_device
        self.target_device = torch.device("cpu")

    upstream_init = replace(buffer_cls, "__init__", __init__, patch=NAME)


def apply() -> bool:
    require_version("openrlhf", "==0.11.2", patch=NAME)
    after_import("openrlhf.trainer.ppo_utils.replay_buffer", _patch)
    return True
