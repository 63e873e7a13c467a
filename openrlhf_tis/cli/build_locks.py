"""Remove the build lock a killed run leaves in torch's extension directory, before the next run waits on it forever.

DeepSpeed loads its CPU Adam and shm-comm ops through torch's JIT extension loader, which takes a lock file
(`<extensions dir>/<op>/lock`, `torch.utils.file_baton.FileBaton`) for every load, built or not, and deletes it
when done. The file records no owner: a process killed while holding it (Ctrl-C, SIGKILL, a test's timeout)
leaves it, and every later run's trainer then waits in `FileBaton.wait` forever, with no message, inside
DeepSpeed's initialization. A lock is left over when it is older than `STALE_AFTER_S` and no process works in
its build directory (ninja runs there while the op compiles; a load of a built op holds the lock ~1 s).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

STALE_AFTER_S = 60.0
LOCK_NAME = "lock"


def _busy_dirs() -> set[Path]:
    """Working directories of the live processes (ninja compiles an op with its build directory as cwd)."""
    import psutil  # a dependency of Ray and DeepSpeed, which a training process has

    found = set()
    for proc in psutil.process_iter():
        try:
            found.add(Path(proc.cwd()))
        except (psutil.Error, OSError):  # gone, or not ours to read
            pass
    return found


def build_lock_files(env: dict[str, str]) -> list[Path]:
    """Every op build lock present: `<TORCH_EXTENSIONS_DIR>/<op>/lock` when `env` sets the directory, else under
    torch's default root, which has one more level (`py311_cpu/<op>/lock`)."""
    directory = env.get("TORCH_EXTENSIONS_DIR")
    if directory:
        return sorted(Path(directory).glob(f"*/{LOCK_NAME}"))
    from torch.utils.cpp_extension import get_default_build_root

    return sorted(Path(get_default_build_root()).glob(f"*/*/{LOCK_NAME}"))


def stale_build_locks(locks: list[Path], now: float | None = None) -> list[Path]:
    """The locks among `locks` that no live build holds."""
    now = time.time() if now is None else now
    old = []
    for lock in locks:
        try:
            if now - lock.stat().st_mtime > STALE_AFTER_S:
                old.append(lock)
        except FileNotFoundError:  # released meanwhile
            pass
    busy = _busy_dirs() if old else set()
    return [lock for lock in old if lock.parent not in busy]


def clear_stale_build_locks(env: dict[str, str]) -> list[Path]:
    """Delete the stale locks of the extension directory `env` gives Ray's workers, one stderr line each."""
    removed = []
    for lock in stale_build_locks(build_lock_files(env)):
        try:
            os.remove(lock)
        except FileNotFoundError:
            continue
        removed.append(lock)
        print(f"[openrlhf_tis] removed {lock}: a build lock left by a killed run (DeepSpeed would wait on it "
              "forever)", file=sys.stderr)
    return removed
