"""The run store's writer: one directory per run, every step's metrics as one JSON line.

Each line goes to the file in a single `write` on an O_APPEND descriptor and is fsync'ed before the
step counts as logged, so a run killed at any moment leaves a file whose complete lines are all
valid; a torn last line (a kill inside the write) is cut off when the run is reopened. Reopening a
run directory (resume) skips steps that are already there instead of writing them twice; `rewind`
instead drops what was logged after the checkpoint a resume restarts from.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from openrlhf_tis.runs.config import check_resume
from openrlhf_tis.runs.layout import (
    METRICS_FILE,
    TOKENS_DIR,
    RunStoreWarning,
    atomic_write,
    remove_stale_temp_files,
    token_files,
)

WALL_TIME_KEY = "wall_time"


def _scalar(value: Any) -> float | None:
    """A metric as a float (NaN stays NaN: a diverging loss must show), or None when not scalar.

    Tensors are recognised by duck typing so that the run store never imports torch (the console
    command must start fast).
    """
    if hasattr(value, "detach") and hasattr(value, "numel"):  # torch.Tensor
        return value.detach().float().mean().item() if value.numel() else None
    if isinstance(value, (bool, int, float, np.generic)):
        return float(value)
    if isinstance(value, np.ndarray):
        return float(value.astype(np.float64).mean()) if value.size else None
    return None


def _step_of(line: bytes) -> int | None:
    try:
        record = json.loads(line)
        return int(record["step"])
    except (ValueError, KeyError, TypeError):
        return None


class RunWriter:
    """Appends per-step metrics to `<run_dir>/metrics.jsonl`; optionally records and checks the config.

    `config` (argparse namespace, dataclass or dict) is written to config.json on a new run and
    checked against it on a resume (`runs.config.check_resume`; `override` is the
    `--logger.run_dir_override` flag; `origin` replaces the collected versions/git provenance, for
    tests). Only one process of a run should own a RunWriter.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        config: Any = None,
        override: bool = False,
        fsync: bool = True,
        origin: Mapping[str, Any] | None = None,
    ):
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.dir / METRICS_FILE
        self.fsync = fsync
        if config is not None:
            check_resume(self.dir, config, override, origin=origin)
        remove_stale_temp_files(self.dir)
        remove_stale_temp_files(self.dir / TOKENS_DIR)
        self.last_step = self._repair_and_last_step()

    def _repair_and_last_step(self) -> int:
        if not self.metrics_path.exists():
            return 0
        raw = self.metrics_path.read_bytes()
        complete = raw[: raw.rfind(b"\n") + 1]
        if len(complete) != len(raw):  # a kill mid-line: keep only whole lines
            with open(self.metrics_path, "r+b") as f:
                f.truncate(len(complete))
                f.flush()
                os.fsync(f.fileno())
        last = 0
        for number, line in enumerate(complete.splitlines(), 1):
            if not line.strip():
                continue
            step = _step_of(line)
            if step is None:
                warnings.warn(f"{self.metrics_path}:{number}: unreadable metrics line kept as is",
                              RunStoreWarning, stacklevel=3)
                continue
            last = max(last, step)
        return last

    def append_metrics(self, step: int, metrics: Mapping[str, Any]) -> bool:
        """Write one step's scalar metrics (non-scalars are left out); False when that step is already stored."""
        if step <= self.last_step:
            return False
        record: dict[str, Any] = {"step": int(step), WALL_TIME_KEY: time.time()}
        for key, value in metrics.items():
            scalar = _scalar(value)
            if scalar is not None and key not in record:
                record[key] = scalar
        data = (json.dumps(record) + "\n").encode()
        fd = os.open(self.metrics_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            view = memoryview(data)
            while view:  # one write for a line of any realistic size; loop only if the kernel splits it
                view = view[os.write(fd, view):]
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        self.last_step = int(step)
        return True

    def rewind(self, step: int) -> int:
        """Forget everything logged after `step`: metrics lines and token dumps. Returns lines dropped.

        Call it when resuming from a checkpoint taken at `step`, so the run's history is the one the
        resumed training actually follows (the steps after the checkpoint are trained again).
        """
        dropped = 0
        if self.metrics_path.exists():
            kept = []
            for line in self.metrics_path.read_bytes().splitlines(keepends=True):
                line_step = _step_of(line)
                if line_step is not None and line_step > step:
                    dropped += 1
                elif line.endswith(b"\n"):
                    kept.append(line)
            if dropped:
                atomic_write(self.metrics_path, b"".join(kept))
        for dump_step, paths in token_files(self.dir).items():
            if dump_step > step:
                for path in paths:
                    path.unlink(missing_ok=True)
        self.last_step = min(self.last_step, int(step))
        return dropped

