"""A model directory published atomically: built in a temporary directory beside its destination, renamed into
place only when complete, so an interrupted build never leaves a destination that looks finished.

The temporary directory's name carries the building process's pid; a later build removes those whose process is
gone (a killed build cannot clean up after itself).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def remove_stale_temps(parent: Path, prefix: str) -> None:
    """Delete the `prefix<pid>-*` directories under parent whose process is gone."""
    for path in parent.glob(f"{prefix}*"):
        try:
            pid = int(path.name[len(prefix):].split("-")[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except (ValueError, PermissionError):
            continue


def publish_atomically(dest: Path, prefix: str, build: Callable[[Path], Path],
                       is_complete: Callable[[Path], bool]) -> Path:
    """`build(work)` writes a finished directory somewhere under the fresh temporary directory `work` and returns
    it; that directory is renamed to dest. When another process published dest first, its copy wins."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(dest.parent, prefix)
    work = Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=dest.parent))
    try:
        built = build(work)
        try:
            os.replace(built, dest)
        except OSError:
            if not is_complete(dest):
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dest
