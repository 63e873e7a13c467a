"""Where things live in a run directory, and the one way files get there: temp file, fsync, rename.

A run directory (docs/design.md §6):

    <run_dir>/
      config.json               resolved configuration, fingerprint, package versions, git revision
      metrics.jsonl             one JSON object per training step, appended and flushed every step
      tokens/step_000012.parquet  per-token dump of a sampled step (schema: runs/schema.py); a step
                                  written by several processes has one part each:
                                  step_000012.part001.parquet
      rollout_model/            what the vLLM engines start from, when the rollout precision is not the
                                default (rollout/checkpoint.py: plan, INT8 weights, calibration)

Every whole-file write goes through `atomic_write`: the bytes land in a hidden temp file beside the
target and are renamed over it, so a reader (or a run killed at any instant) sees the old file or the
new one, never half of one. Temp names start with "." and do not match the patterns readers glob.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
TOKENS_DIR = "tokens"
TOKEN_FILE_PATTERN = "step_*.parquet"
ROLLOUT_MODEL_DIR = "rollout_model"
_TOKEN_FILE_RE = re.compile(r"^step_(\d+)(?:\.part(\d+))?\.parquet$")
_TEMP_PREFIX = ".tmp-"


_UNSAFE_NAME_CHARS = re.compile(r"[^A-Za-z0-9_.=-]+")
_DIGEST_SUFFIX = re.compile(r"-[0-9a-f]{8}$")


def unique_dir_name(name: str, max_chars: int = 80) -> str:
    """A directory name for `name` (a sweep cell's): readable, filesystem-safe, unique (a short hash of the
    whole name guards truncation and names that differ only in unsafe characters)."""
    digest = hashlib.sha1(name.encode()).hexdigest()[:8]
    return f"{_UNSAFE_NAME_CHARS.sub('_', name)[:max_chars]}-{digest}"


def readable_dir_name(dir_name: str) -> str:
    """A `unique_dir_name` less its hash: what a legend shows."""
    return _DIGEST_SUFFIX.sub("", dir_name)


class RunStoreWarning(UserWarning):
    """Something in a run directory is damaged; the message names the file (and line). Reading goes on."""


def token_file(run_dir: str | os.PathLike, step: int, part: int | None = None) -> Path:
    """Path of one step's token dump (or of one part of it); zero-padded so a plain sort is step order."""
    suffix = "" if part is None else f".part{part:03d}"
    return Path(run_dir) / TOKENS_DIR / f"step_{step:06d}{suffix}.parquet"


def token_files(run_dir: str | os.PathLike) -> dict[int, list[Path]]:
    """Every complete token dump file of a run, by step (temp files of an interrupted write are not listed)."""
    tokens = Path(run_dir) / TOKENS_DIR
    if not tokens.is_dir():
        return {}
    found: dict[int, list[Path]] = {}
    for entry in os.scandir(tokens):
        match = _TOKEN_FILE_RE.match(entry.name)
        if match and entry.is_file():
            found.setdefault(int(match.group(1)), []).append(Path(entry.path))
    return {step: sorted(found[step]) for step in sorted(found)}


def existing_dir(path: str | os.PathLike, what: str = "run directory") -> Path:
    """`path` as a Path; FileNotFoundError / NotADirectoryError naming it when it is no directory.

    Readers call it first so that a mistyped path is an error, not an empty result.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{what} {path} does not exist")
    if not path.is_dir():
        raise NotADirectoryError(f"{what} {path} is not a directory")
    return path


def is_run_dir(path: str | os.PathLike) -> bool:
    """A directory is a run once it holds a config, a metrics file or token dumps."""
    path = Path(path)
    return (path / CONFIG_FILE).is_file() or (path / METRICS_FILE).is_file() or (path / TOKENS_DIR).is_dir()


def _fsync_dir(path: Path) -> None:
    # The rename is durable only once the directory entry is; best effort where O_DIRECTORY is missing.
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@functools.cache
def file_mode() -> int:
    """The mode open() gives a new file (0666 minus the umask): mkstemp's 0600 would hide run files from
    others on a shared cluster. The umask can only be read by setting it."""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], None] | bytes) -> Path:
    """Create or replace `path` all at once: `write` fills a temp file in the same directory, then rename.

    `write` is either the bytes themselves or a callable given the open binary file (e.g. a Parquet
    writer). On any error the temp file is removed and the old `path`, if any, is left untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f"{_TEMP_PREFIX}{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, file_mode())
        with os.fdopen(fd, "wb") as f:
            if isinstance(write, (bytes, bytearray)):
                f.write(write)
            else:
                write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def remove_stale_temp_files(directory: str | os.PathLike) -> list[Path]:
    """Delete temp files left by a write that was killed before its rename; returns what was removed.

    Only the run's own writer calls this (when it opens a run), since a temp file may belong to a
    write still in progress in another process of the same run.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    removed = []
    for entry in directory.iterdir():
        if entry.name.startswith(_TEMP_PREFIX) and entry.is_file():
            entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed
