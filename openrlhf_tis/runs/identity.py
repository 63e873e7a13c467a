"""Which run a checkpoint belongs to, so a resume never continues from another history's weights.

A run directory's history is its metrics.jsonl under the `run_id` of its config.json (runs/config.py).
Upstream's checkpoints live elsewhere (`--ckpt.path`) and outlive that history: `--logger.run_dir_overwrite`
erases metrics but not checkpoints, and a later `--ckpt.load_enable` would silently load the erased run's
weights. So every checkpoint the fork saves carries the run id beside its DeepSpeed files
(`<ckpt.path>/_actor/<tag>/openrlhf_tis_run.json`, written by the policy actor), and a resume is allowed
only from a checkpoint of this run id whose step is at most the last logged step.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from openrlhf_tis.runs.config import RUN_ID_KEY, read_run_config
from openrlhf_tis.runs.layout import atomic_write
from openrlhf_tis.runs.reader import last_logged_step

CHECKPOINT_ID_FILE = "openrlhf_tis_run.json"
_TAG_STEP = re.compile(r"global_step(\d+)$")


def latest_checkpoint(actor_dir: str | os.PathLike) -> tuple[str, int | None]:
    """(tag, step) of the checkpoint DeepSpeed loads from `actor_dir` (its `latest` file); step None when the
    tag carries no `global_stepN`."""
    tag = (Path(actor_dir) / "latest").read_text().strip()
    match = _TAG_STEP.search(tag)
    return tag, int(match.group(1)) if match else None


def repair_empty_latest(actor_dir: str | os.PathLike) -> str | None:
    """Point an empty `latest` at the newest `global_stepN` tag; returns that tag, None when nothing was wrong.

    DeepSpeed writes `latest` in place (open for writing, then the tag) and only after the tag's files are whole,
    so a kill in that instant leaves it empty while the newest tag is complete; every later resume would then
    fail. Whether that tag belongs to this run is still judged by `foreign_checkpoint`.
    """
    latest = Path(actor_dir) / "latest"
    if not latest.is_file() or latest.read_text().strip():
        return None
    steps = {int(m.group(1)): p.name for p in Path(actor_dir).iterdir()
             if p.is_dir() and (m := _TAG_STEP.search(p.name))}
    if not steps:
        return None
    tag = steps[max(steps)]
    atomic_write(latest, tag.encode())
    return tag


def write_checkpoint_identity(tag_dir: str | os.PathLike, run_id: str, step: int) -> Path:
    """Mark a saved checkpoint as `run_id`'s (called once the DeepSpeed files are written)."""
    data = json.dumps({RUN_ID_KEY: run_id, "step": int(step)}).encode()
    return atomic_write(Path(tag_dir) / CHECKPOINT_ID_FILE, data)


def read_checkpoint_identity(tag_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The identity record of a checkpoint tag directory, None when it has none (or an unreadable one)."""
    try:
        record = json.loads((Path(tag_dir) / CHECKPOINT_ID_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def foreign_checkpoint(run_dir: str | os.PathLike, actor_dir: str | os.PathLike) -> str | None:
    """Why the checkpoint in `actor_dir` is not part of `run_dir`'s current history; None when it is.

    A run directory written before run ids existed (config.json without one) is judged by step only.
    """
    tag, step = latest_checkpoint(actor_dir)
    last = last_logged_step(run_dir) or 0
    try:
        run_id = (read_run_config(run_dir) or {}).get(RUN_ID_KEY)
    except ValueError as err:
        return str(err)
    if run_id is not None:
        saved_by = (read_checkpoint_identity(Path(actor_dir) / tag) or {}).get(RUN_ID_KEY)
        if saved_by != run_id:
            who = f"run {saved_by}" if saved_by else "a run without a recorded identity"
            return (f"its checkpoint {tag} was saved by {who}, not by this directory's run {run_id} (an earlier "
                    "run, e.g. one erased by --logger.run_dir_overwrite)")
    if step is not None and step > last:
        return f"its checkpoint {tag} is past the directory's last logged step ({last})"
    return None
