"""DeepSpeed's JIT ops neither hang nor rebuild: a killed run's build lock is removed before the next run starts (a live
build's lock is kept), and every run builds with the ninja the set-up used."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from torch.utils.file_baton import FileBaton

from openrlhf_tis.cli.build_locks import STALE_AFTER_S, build_lock_files, clear_stale_build_locks
from openrlhf_tis.cli.prebuild_ops import prebuild
from openrlhf_tis.cli.ray_cluster import worker_env


def _lock(root, op: str, age_s: float):
    path = root / op / "lock"
    path.parent.mkdir(parents=True)
    path.touch()
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def test_a_killed_runs_lock_is_removed_and_torch_can_take_it_again(tmp_path, capsys):
    stale = _lock(tmp_path, "fused_adam", STALE_AFTER_S + 5)
    # torch's own baton: while the file exists no process can take it, and a waiter waits forever
    assert not FileBaton(str(stale)).try_acquire()
    assert clear_stale_build_locks({"TORCH_EXTENSIONS_DIR": str(tmp_path)}) == [stale]
    baton = FileBaton(str(stale))
    assert baton.try_acquire()
    baton.release()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(stale) in err and "killed run" in err


def test_a_fresh_lock_and_a_compiling_ops_lock_are_kept(tmp_path):
    fresh = _lock(tmp_path, "cpu_adam", 1)
    compiling = _lock(tmp_path, "fused_adam", 10 * STALE_AFTER_S)
    stale = _lock(tmp_path, "deepspeed_shm_comm", 10 * STALE_AFTER_S)
    # ninja compiles an op with its build directory as working directory
    ninja = subprocess.Popen(["sleep", "60"], cwd=compiling.parent)
    try:
        assert clear_stale_build_locks({"TORCH_EXTENSIONS_DIR": str(tmp_path)}) == [stale]
    finally:
        ninja.kill()
        ninja.wait()
    assert fresh.exists() and compiling.exists() and not stale.exists()


def test_without_the_variable_torchs_default_root_is_searched(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # torch's default root follows the user cache dir
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    stale = _lock(tmp_path / "torch_extensions" / "py311_cpu", "fused_adam", STALE_AFTER_S + 5)
    assert build_lock_files({}) == [stale]
    assert build_lock_files({"TORCH_EXTENSIONS_DIR": str(tmp_path / "elsewhere")}) == []


def test_every_run_builds_with_the_venvs_ninja(monkeypatch):
    venv_bin = str(Path(sys.executable).parent)
    monkeypatch.setenv("PATH", os.pathsep.join(["/usr/bin", venv_bin, "/bin"]))
    path = worker_env("cpu")["PATH"]
    assert path.split(os.pathsep) == [venv_bin, "/usr/bin", "/bin"]  # first, once, the rest in order
    assert shutil.which("ninja", path=path) == str(Path(venv_bin) / "ninja")  # the one the set-up built with


def test_set_up_clears_a_killed_set_ups_lock_before_building_and_keeps_a_live_builds(tmp_path):
    """scripts/setup_env.sh's prebuild: a lock left by a set-up killed a moment ago is waited out once and cleared
    before any op loads; a lock in a directory where ninja works is kept."""
    young = _lock(tmp_path, "deepspeed_shm_comm", 1)
    compiling = _lock(tmp_path, "fused_adam", 10 * STALE_AFTER_S)
    waited, seen = [], []

    def sleep(seconds):  # time passes for the young lock
        waited.append(seconds)
        os.utime(young, (time.time() - seconds - 1,) * 2)

    class Builder:
        def load(self, verbose):
            seen.append((young.exists(), compiling.exists()))

    ninja = subprocess.Popen(["sleep", "60"], cwd=compiling.parent)
    try:
        prebuild({"TORCH_EXTENSIONS_DIR": str(tmp_path)}, builders=lambda: [Builder(), Builder()], sleep=sleep)
    finally:
        ninja.kill()
        ninja.wait()
    assert waited and waited[0] > STALE_AFTER_S
    assert seen == [(False, True)] * 2


def test_set_up_without_locks_builds_at_once(tmp_path):
    loaded = []
    builder = SimpleNamespace(load=lambda verbose: loaded.append(verbose))
    prebuild({"TORCH_EXTENSIONS_DIR": str(tmp_path)}, builders=lambda: [builder],
             sleep=lambda s: pytest.fail("waited with no lock"))
    assert loaded == [False]
