"""Reading runs back: which runs exist under a root, and a run's per-step metrics as a DataFrame.

Readers never fail a whole run for one damaged file or line: a torn last line (the run was killed
while writing it) or a corrupt line is reported by file and line number as a RunStoreWarning and the
rest is returned.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import pandas as pd

from openrlhf_tis.runs.config import read_run_config
from openrlhf_tis.runs.layout import (
    CONFIG_FILE,
    METRICS_FILE,
    TOKENS_DIR,
    RunStoreWarning,
    existing_dir,
    is_run_dir,
    token_files,
)

_SKIP_DIRS = {TOKENS_DIR, "ckpt", "checkpoints", "wandb", "tensorboard", "__pycache__"}


def find_runs(root: str | os.PathLike, max_depth: int = 3) -> list[Path]:
    """Run directories at or below `root` (not descending into a run, nor deeper than `max_depth`), each once: a
    directory reached again through a symlink (a loop, or a link to a run) is not listed or walked again."""
    root = Path(root)
    if is_run_dir(root):
        return [root]
    found: list[Path] = []
    seen = {os.path.realpath(root)}

    def walk(directory: Path, depth: int) -> None:
        if depth > max_depth:
            return
        try:
            entries = sorted((e for e in os.scandir(directory) if e.is_dir() and not e.name.startswith(".")),
                             key=lambda e: e.name)
        except OSError:
            return
        for entry in entries:
            path = Path(entry.path)
            if (real := os.path.realpath(path)) in seen:
                continue
            seen.add(real)
            if is_run_dir(path):
                found.append(path)
            elif entry.name not in _SKIP_DIRS:
                walk(path, depth + 1)

    walk(root, 1)
    return sorted(found)


def read_metrics_records(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Every readable line of metrics.jsonl; damaged lines are warned about by name and line number.

    A run directory without metrics.jsonl (a run before its first step) gives []; a missing directory raises.
    """
    path = existing_dir(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    torn = lines.pop()  # after the last newline: empty unless the writer was killed mid-line
    records, seen = [], set()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            step = int(record["step"])
        except (ValueError, KeyError, TypeError) as err:
            warnings.warn(f"{path}:{number}: corrupt metrics line skipped ({err})", RunStoreWarning, stacklevel=2)
            continue
        if step in seen:
            warnings.warn(f"{path}:{number}: duplicate step {step} skipped (the first one is kept)",
                          RunStoreWarning, stacklevel=2)
            continue
        seen.add(step)
        records.append(record)
    if torn.strip():
        warnings.warn(f"{path}:{len(lines) + 1}: torn last line ignored (the run was stopped while writing it)",
                      RunStoreWarning, stacklevel=2)
    return records


def load_metrics(run_dir: str | os.PathLike) -> pd.DataFrame:
    """One row per logged step, sorted by step; a column per metric key (NaN where a step lacks it)."""
    records = read_metrics_records(run_dir)
    if not records:
        return pd.DataFrame({"step": pd.Series([], dtype="int64")})
    frame = pd.DataFrame.from_records(records)
    frame["step"] = frame["step"].astype("int64")
    return frame.sort_values("step", kind="stable").reset_index(drop=True)


def _count_lines(path: Path) -> int:
    if not path.is_file():
        return 0
    with open(path, "rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))


def _last_step(path: Path) -> int | None:
    """The step of the last whole line, read from the file's tail only (list_runs must stay cheap)."""
    if not path.is_file():
        return None
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - (1 << 16)))
        tail = f.read()
    for line in reversed(tail.split(b"\n")):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return None


def last_logged_step(run_dir: str | os.PathLike) -> int | None:
    """The step of metrics.jsonl's last whole line (None when there is none), read from the file's tail."""
    return _last_step(Path(run_dir) / METRICS_FILE)


def run_info(run_dir: str | os.PathLike) -> dict[str, Any]:
    """A run's identity and size without reading its history: the row `list_runs` shows."""
    run_dir = existing_dir(run_dir)
    try:
        config = read_run_config(run_dir) or {}
        config_error = None
    except ValueError as err:
        warnings.warn(str(err), RunStoreWarning, stacklevel=2)
        config, config_error = {}, str(err)
    dumps = token_files(run_dir)
    token_bytes = sum(p.stat().st_size for paths in dumps.values() for p in paths)
    git = config.get("git") or {}
    metrics = run_dir / METRICS_FILE
    return {
        "run": run_dir.name,
        "path": str(run_dir),
        "created": config.get("time"),
        "steps": _count_lines(metrics),
        "last_step": _last_step(metrics),
        "token_steps": len(dumps),
        "token_bytes": token_bytes,
        "revision": (git.get("revision") or "")[:12] or None,
        "fingerprint": config.get("fingerprint"),
        "resumes": len(config.get("resumes", [])),
        "has_config": (run_dir / CONFIG_FILE).is_file() and config_error is None,
    }


def list_runs(root: str | os.PathLike = "runs") -> pd.DataFrame:
    """One row per run directory under `root` (see `run_info` for the columns), sorted by path.

    A root that holds no runs gives an empty frame; a missing root raises FileNotFoundError naming it.
    """
    rows = [run_info(path) for path in find_runs(existing_dir(root, "runs root"))]
    columns = ["run", "path", "created", "steps", "last_step", "token_steps", "token_bytes", "revision",
               "fingerprint", "resumes", "has_config"]
    return pd.DataFrame(rows, columns=columns)
