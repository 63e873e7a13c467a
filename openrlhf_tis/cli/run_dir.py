"""Open the run directory for a training start: a run's steps are never erased by accident, and a start
that failed before its first step never blocks the corrected command.

A directory holds steps once metrics.jsonl has a step or token dumps exist. Starting there again is
refused unless the user says what should happen: `--ckpt.load_enable` resumes (only when upstream's
checkpoint exists: without one upstream silently starts at step 0 and the store would rewind to it),
`--logger.run_dir_overwrite` erases the run store's files and starts over. A directory without steps
is a start that never trained: its config.json (written before Ray starts) is replaced.

Only files the fork wrote are ever replaced or erased: a directory whose config.json is not a run record
(a model's directory, a project's) or that holds metrics or token dumps without one is refused before
anything is written there.

A run directory belongs to one live run: the start takes an exclusive `flock` on `<run_dir>/.lock` (its
pid inside) and holds it until the process ends, so the kernel releases it however the run ends (kill -9
included) and a second start into the same directory is refused while the first lives. A resume loads a
checkpoint only when it belongs to the directory's current history (runs/identity.py).
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import os
import shutil
import sys
from pathlib import Path

from openrlhf_tis.errors import UsageError
from openrlhf_tis.runs.config import RUN_ID_KEY, RunConfigMismatch, check_resume, is_run_record, read_run_config
from openrlhf_tis.runs.identity import foreign_checkpoint, repair_empty_latest
from openrlhf_tis.runs.layout import CONFIG_FILE, METRICS_FILE, TOKENS_DIR, token_files
from openrlhf_tis.runs.reader import last_logged_step

FLAG = "--logger.run_dir"
OVERWRITE_FLAG = "--logger.run_dir_overwrite"
LOAD_FLAG = "--ckpt.load_enable"
LOCK_FILE = ".lock"
# flock answers these, at once, where the filesystem cannot lock (never a wait: the lock is taken with LOCK_NB)
NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)
_held_locks: dict[Path, int] = {}  # run directory -> the descriptor holding its lock, open for the process's life


class RunFinished(Exception):
    """A resume with nothing left to do: every planned step is logged and the final model saved after them."""


def final_model_saved(output_dir: str, run_dir: Path) -> bool:
    """Whether a model's weights in `output_dir` (upstream's final save, `--ckpt.output_dir`) were written after the
    run's last logged step; weights older than metrics.jsonl belong to an earlier history or a crash before the save."""
    metrics = run_dir / METRICS_FILE
    if not metrics.is_file():
        return False
    logged = metrics.stat().st_mtime
    return any(w.stat().st_mtime >= logged for w in Path(output_dir).expanduser().glob("*.safetensors"))


def checkpoint_dir(ckpt_path: str) -> Path | None:
    """Upstream's actor checkpoint under --ckpt.path when DeepSpeed can load one (its `latest` tag file)."""
    actor = Path(ckpt_path).expanduser().resolve() / "_actor"
    return actor if (actor / "latest").is_file() else None


def interrupted_account(run_dir: Path, ckpt_path: str) -> str:
    """What a training start stopped by Ctrl-C kept, and how to go on, as one line's end."""
    last = last_logged_step(run_dir)
    steps = f"step{'s 1-' if last > 1 else ' '}{last} in {run_dir / METRICS_FILE}" if last else "no step"
    actor = checkpoint_dir(ckpt_path)
    if actor is None:
        again = f"start again with {OVERWRITE_FLAG}" if last else "start again with the same command"
        return f"kept {steps} and no checkpoint; {again}"
    tag = (actor / "latest").read_text().strip()
    return f"kept {steps} and the checkpoint {tag} in {actor}; resume with the same command and {LOAD_FLAG}"


def _check_writable(run_dir: Path) -> None:
    if run_dir.exists() and not run_dir.is_dir():
        raise UsageError(FLAG, f"{run_dir} exists and is not a directory")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(FLAG, f"cannot create {run_dir}: {err.strerror or err}") from None
    if not os.access(run_dir, os.W_OK | os.X_OK):
        raise UsageError(FLAG, f"{run_dir} is not writable")


def lock_run_dir(run_dir: Path) -> None:
    """Own `run_dir` for the life of this process; UsageError naming the owner's pid when a live run holds it."""
    if run_dir in _held_locks:  # this process already owns it (a start parsed twice in one process)
        return
    path = run_dir / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise UsageError(FLAG, f"cannot create {path}: {err.strerror or err}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        if err.errno in NO_LOCKS:
            raise UsageError(FLAG, f"cannot lock {path}: {err.strerror or err}: the filesystem of {run_dir} offers "
                             "no flock (NFSv3 without lockd, Lustre mounted without -o flock, some FUSE mounts); "
                             "mount it with locking (NFSv4, Lustre -o flock, GPFS and CephFS have it) or choose a "
                             f"{FLAG} on one that does") from None
        if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise UsageError(FLAG, f"cannot lock {path}: {err.strerror or err}") from None
        raise UsageError(FLAG, f"{run_dir} is in use by another run (pid {owner}); wait for it to end, stop it, "
                         f"or choose another {FLAG}") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _held_locks[run_dir] = fd


def lock_owner(run_dir: Path) -> str | None:
    """The pid written by the live process that holds `run_dir`, None when no live process holds it."""
    try:
        fd = os.open(run_dir / LOCK_FILE, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # released by the close below
    except OSError:
        return os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
    finally:
        os.close(fd)
    return None


def check_fork_made(run_dir: Path) -> None:
    """UsageError naming the flag when `run_dir` holds run-store files the fork cannot vouch for: a config.json that
    is no run record, or metrics / token dumps without one. A new, empty or otherwise unrelated directory passes."""
    config = run_dir / CONFIG_FILE
    if config.exists() or config.is_symlink():
        try:
            record = read_run_config(run_dir)
        except (ValueError, OSError):
            record = None
        if not is_run_record(record):
            raise UsageError(FLAG, f"{run_dir} holds a {CONFIG_FILE} that no run of this fork wrote (a model's or a "
                             f"project's directory?); it is left untouched: choose a new or empty {FLAG}")
        return
    strays = [name for name in (METRICS_FILE, TOKENS_DIR) if (run_dir / name).exists()]
    if strays:
        raise UsageError(FLAG, f"{run_dir} holds {' and '.join(strays)} but no run {CONFIG_FILE}, so it is not a run "
                         f"directory this fork can vouch for; they are left untouched: choose a new or empty {FLAG}")


def erase_run_store(run_dir: Path) -> None:
    """Remove what the run store wrote (metrics, token dumps, config); other files (checkpoints, logs) stay.
    config.json goes last: it is what marks the directory as the fork's (check_fork_made) until the rest is gone."""
    (run_dir / METRICS_FILE).unlink(missing_ok=True)
    shutil.rmtree(run_dir / TOKENS_DIR, ignore_errors=True)
    (run_dir / CONFIG_FILE).unlink(missing_ok=True)


def open_run_dir(args: argparse.Namespace, planned_steps: int | None = None) -> str | None:
    """Decide new run / resume / overwrite, then record or check the configuration (before Ray starts); return the
    directory's run id (config.json's, kept across resumes), which cli/resolve.py `apply_run_id` hands the actors.

    `planned_steps`: how many steps the run will train, when the CLI could count them (config.json). A resume of a
    run that logged them all and saved its final model raises RunFinished, before anything is written.
    """
    run_dir = Path(getattr(args, "logger.run_dir"))
    _check_writable(run_dir)
    check_fork_made(run_dir)  # before the lock: a refused directory gets no .lock either
    lock_run_dir(run_dir)
    last = last_logged_step(run_dir) or 0
    dumps = token_files(run_dir)
    overwrite, load = getattr(args, "logger.run_dir_overwrite"), getattr(args, "ckpt.load_enable")
    output_dir = getattr(args, "ckpt.output_dir")
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
        elif planned_steps is not None and last >= planned_steps and final_model_saved(output_dir, run_dir):
            raise RunFinished(f"{run_dir} already holds all {planned_steps} planned step(s) and its final model in "
                              f"{output_dir}; to train further add prompts or raise --train.num_episodes, or pass "
                              f"{OVERWRITE_FLAG} to start over")
        elif checkpoint is None:
            raise UsageError(LOAD_FLAG, f"no checkpoint in {Path(getattr(args, 'ckpt.path')) / '_actor'} to resume "
                             f"{run_dir} ({held}) from; pass the --ckpt.path it was saved to, or {OVERWRITE_FLAG} "
                             "to start over")
    else:
        (run_dir / CONFIG_FILE).unlink(missing_ok=True)  # left by a start that never reached step 1
    if load and checkpoint is not None:  # (with overwrite too it was refused above)
        if (tag := repair_empty_latest(checkpoint)) is not None:
            print(f"[openrlhf_tis] {checkpoint / 'latest'} was empty (a run killed while DeepSpeed wrote it): "
                  f"pointed at {tag}, the newest checkpoint", file=sys.stderr)
        foreign = foreign_checkpoint(run_dir, checkpoint)
        if foreign:
            raise UsageError(LOAD_FLAG, f"will not resume {run_dir} from {checkpoint}: {foreign}; pass "
                             f"{OVERWRITE_FLAG} to start over, or the --ckpt.path this run saved to")
    try:
        record = check_resume(run_dir, args, override=getattr(args, "logger.run_dir_override"),
                              planned_steps=planned_steps)
    except RunConfigMismatch as err:
        raise UsageError(FLAG, str(err)) from None
    return record.get(RUN_ID_KEY)
