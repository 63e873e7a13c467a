"""scripts/setup_env.sh on a machine with an NVIDIA GPU: it stops at once with the GPU stack's install commands
instead of building the CPU venv.

Each case runs a copy of the script in a temporary repository (its inputs copied beside it), with a PATH of a few
tools and, where a GPU is faked, an `nvidia-smi` that lists one: no apt-get is reachable, and a venv that is
already current (its stamp written by the test) makes the CPU path end at the stamp check in well under a second.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INPUTS = ("setup.py", "requirements/constraints-cpu.txt", "scripts/setup_env.sh")  # what the stamp hashes
TOOLS = ("dirname", "cat", "sha256sum", "cut", "id", "grep")
H100 = "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-00000000-0000-0000-0000-000000000000)"


def _repo(tmp_path: Path, nvidia_smi: str | None, venv_current: bool) -> tuple[Path, dict[str, str]]:
    repo, bin_dir = tmp_path / "repo", tmp_path / "bin"
    for name in INPUTS:
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, repo / name)
    bin_dir.mkdir()
    for tool in TOOLS:
        (bin_dir / tool).symlink_to(shutil.which(tool))
    if nvidia_smi is not None:
        (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\n{nvidia_smi}\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    if venv_current:
        digest = hashlib.sha256(b"".join((repo / name).read_bytes() for name in INPUTS)).hexdigest()
        (repo / ".venv").mkdir()
        (repo / ".venv" / ".setup-stamp").write_text(digest + "\n")
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path)}
    return repo, env


def _run(repo: Path, env: dict[str, str], device: str | None = None) -> subprocess.CompletedProcess:
    if device is not None:
        env = {**env, "OPENRLHF_TIS_DEVICE": device}
    return subprocess.run(["/bin/bash", str(repo / "scripts" / "setup_env.sh")], env=env, capture_output=True,
                          text=True, timeout=60)


def _install_commands(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if re.match(r"\s+(python3\.11 -m venv|\S*\s*pip install)", line)]


@pytest.mark.parametrize(("nvidia_smi", "device"), [(f"echo '{H100}'", None), (f"echo '{H100}'", "auto"),
                                                    (None, "cuda")])
def test_a_gpu_machine_stops_at_once_with_the_gpu_install_commands(tmp_path, nvidia_smi, device):
    repo, env = _repo(tmp_path, nvidia_smi, venv_current=False)
    proc = _run(repo, env, device)
    assert proc.returncode == 1, proc.stderr
    assert _install_commands(proc.stderr) == [
        "python3.11 -m venv .venv-gpu && source .venv-gpu/bin/activate",
        "pip install torch==2.13.0 packaging ninja psutil",
        "MAX_JOBS=8 pip install flash-attn==2.8.3 --no-build-isolation",
        'pip install -e ".[gpu,notebooks,dev]"',
    ], proc.stderr
    assert "OPENRLHF_TIS_DEVICE=cpu" in proc.stderr and "nvcc" in proc.stderr
    assert not (repo / ".venv").exists()  # nothing built, nothing installed


@pytest.mark.parametrize(("nvidia_smi", "device"), [(f"echo '{H100}'", "cpu"), ("exit 9", None),
                                                    ("echo 'No devices were found'", None), (None, None)])
def test_without_a_gpu_or_with_the_cpu_override_the_cpu_venv_is_kept(tmp_path, nvidia_smi, device):
    """A current CPU venv: the script reaches its stamp check and exits 0 (a failing or GPU-less nvidia-smi, none at
    all, or OPENRLHF_TIS_DEVICE=cpu on a GPU machine)."""
    repo, env = _repo(tmp_path, nvidia_smi, venv_current=True)
    proc = _run(repo, env, device)
    assert proc.returncode == 0 and "pip install" not in proc.stderr, proc.stderr


def test_an_unknown_device_override_is_refused(tmp_path):
    repo, env = _repo(tmp_path, None, venv_current=False)
    proc = _run(repo, env, "rocm")
    assert proc.returncode == 2 and "OPENRLHF_TIS_DEVICE must be auto, cpu or cuda, not 'rocm'" in proc.stderr


def test_the_gpu_commands_are_the_ones_docs_gpu_md_gives():
    script = (ROOT / "scripts" / "setup_env.sh").read_text()
    docs = (ROOT / "docs" / "gpu.md").read_text()
    commands = _install_commands(script)
    assert len(commands) == 4 and all(command in docs for command in commands)


def test_the_venvs_ray_imports_no_iri_grammar():
    """The set-up removes rfc3987-syntax: with it, jsonschema (imported by `import ray`) builds an Earley grammar in
    every Ray process of a run, 3.6 s each on a 2-core machine."""
    probe = "import sys, ray, jsonschema; print('rfc3987_syntax' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.split()[-1] == "False", proc.stderr


def test_the_venvs_packages_are_compiled_once():
    """The set-up compiles the venv: uv writes no .pyc and PYTHONDONTWRITEBYTECODE (set on this machine kind) keeps
    Python from caching one, so without it every process compiled transformers and vLLM at each import (a start of a
    run took 2.17x as long: docs/measurements.md)."""
    import importlib.util

    for name in ("transformers", "vllm", "deepspeed"):
        source = importlib.util.find_spec(name).origin
        assert Path(importlib.util.cache_from_source(source)).is_file(), f"{name}: no .pyc beside {source}"
