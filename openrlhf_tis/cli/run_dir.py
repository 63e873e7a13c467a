"""Open the run directory for a training start: a run's steps are never erased by accident, and a start
that failed before its first step never blocks the corrected command.

A directory holds steps once metrics.jsonl has a step or token dumps exist. Starting there again is
refused unless the user says what should happen: `--ckpt.load_enable` resumes (only when upstream's
checkpoint exists: without one upstream silently starts at step 0 and the store would rewind to it),
`--logger.run_dir_overwrite` erases the run store's files and starts over. A directory without steps
is a start that never trained: its config.json (written before Ray starts) is replaced.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from openrlhf_tis.errors import UsageError
from openrlhf_tis.runs.config import RunConfigMismatch, check_resume
from openrlhf_tis.runs.layout import CONFIG_FILE, METRICS_FILE, TOKENS_DIR, token_files
from openrlhf_tis.runs.reader import last_logged_step

FLAG = "--logger.run_dir"
OVERWRITE_FLAG = "--logger.run_dir_overwrite"
LOAD_FLAG = "--ckpt.load_enable"


def checkpoint_dir(ckpt_path: str) -> Path | None:
    """Upstream's actor checkpoint under --ckpt.path when DeepSpeed can load one (its `latest` tag file)."""
    actor = Path(ckpt_path).expanduser().resolve() / "_actor"
    return actor if (actor / "latest").is_file() else None


def _check_writable(run_dir: Path) -> None:
    if run_dir.exists() and not run_dir.is_dir():
        raise UsageError(FLAG, f"{run_dir} exists and is not a directory")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(FLAG, f"cannot create {run_dir}: {err.strerror or err}") from None
    if not os.access(run_dir, os.W_OK | os.X_OK):
        raise UsageError(FLAG, f"{run_dir} is not writable")


def erase_run_store(run_dir: Path) -> None:
    """Remove what the run store wrote (config, metrics, token dumps); other files (checkpoints, logs) stay."""
    for name in (CONFIG_FILE, METRICS_FILE):
        (run_dir / name).unlink(missing_ok=True)
    shutil.rmtree(run_dir / TOKENS_DIR, ignore_errors=True)


def open_run_dir(args: argparse.Namespace) -> None:
    """Decide new run / resume / overwrite, then record or check the configuration (before Ray starts)."""
    run_dir = Path(getattr(args, "logger.run_dir"))
    _check_writable(run_dir)
    last = last_logged_step(run_dir) or 0
    dumps = token_files(run_dir)
    overwrite, load = getattr(args, "logger.run_dir_overwrite"), getattr(args, "ckpt.load_enable")
    checkpoint = checkpoint_dir(getattr(args, "ckpt.path"))
    if overwrite and load and checkpoint is not None:
        raise UsageError(OVERWRITE_FLAG, f"starts over, but {LOAD_FLAG} would resume from the checkpoint in "
                         f"{checkpoint}; pass one of them")
    if last or dumps:
        held = f"{last} step(s)" if last else f"token dumps of {len(dumps)} step(s)"
        if overwrite:
            erase_run_store(run_dir)
            print(f"[openrlhf_tis] {OVERWRITE_FLAG}: erased {held} of {run_dir}", file=sys.stderr)
        elif not load:
            raise UsageError(FLAG, f"{run_dir} already holds {held}; pass {LOAD_FLAG} to resume it from its "
                             f"checkpoint, {OVERWRITE_FLAG} to erase them and start over, or another {FLAG}")
        elif checkpoint is None:
            raise UsageError(LOAD_FLAG, f"no checkpoint in {Path(getattr(args, 'ckpt.path')) / '_actor'} to resume "
                             f"{run_dir} ({held}) from; pass the --ckpt.path it was saved to, or {OVERWRITE_FLAG} "
                             "to start over")
    else:
        (run_dir / CONFIG_FILE).unlink(missing_ok=True)  # left by a start that never reached step 1
    try:
        check_resume(run_dir, args, override=getattr(args, "logger.run_dir_override"))
    except RunConfigMismatch as err:
        raise UsageError(FLAG, str(err)) from None
