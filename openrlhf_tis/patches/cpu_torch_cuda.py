"""CPU patch: make upstream's unconditional torch.cuda calls harmless in a CPU run.

OpenRLHF 0.11.2 calls torch.cuda in ~30 places on the PPO path (DeepSpeed strategy, PPO actor,
launcher, replay buffer, critic): `set_device(local_rank)`, `synchronize()` in every barrier,
`current_device()` used as a tensor device, and `current_stream()` passed to the weight-sync
broadcast. On a CPU-only torch each raises "Torch not compiled with CUDA enabled". Here they become
no-ops and `current_device()` answers the CPU device, so every `.to(current_device())` stays on CPU.
Applied only in a CPU run (DEVICES, the driver's decision): a CUDA run is never touched.
"""

from __future__ import annotations

import torch

from openrlhf_tis.upstream_guards import replace, require_version

NAME = "cpu_torch_cuda"
DEVICES = ("cpu",)  # the run's device, decided by its driver (patches/__init__.py)


def _noop(name: str):
    """A distinct no-op per attribute: torch._dynamo maps each torch.cuda function to its own rule."""

    def noop(*_args, **_kwargs) -> None:
        return None

    noop.__name__ = noop.__qualname__ = name
    return noop


def _cpu_device() -> torch.device:
    return torch.device("cpu")


def apply() -> bool:
    require_version("openrlhf", "==0.11.2", patch=NAME)  # the calls it makes harmless
    require_version("torch", ">=2.13,<2.14", patch=NAME)  # the attributes it replaces
    for attr, stand_in in (
        ("set_device", _noop("set_device")),
        ("synchronize", _noop("synchronize")),
        ("empty_cache", _noop("empty_cache")),
        ("current_stream", _noop("current_stream")),
        ("current_device", _cpu_device),
    ):
        replace(torch.cuda, attr, stand_in, patch=NAME)
    return True
