"""Ctrl-C in a command that runs notebooks through papermill (the main job, a sweep): the training stops, is waited
for, and the command says in one line what was stopped, what was kept and how to go on.

The terminal's SIGINT reaches only this process: papermill's kernel runs in a session of its own, the training CLI
the kernel starts (pipeline/train.py) in another. papermill therefore runs in a worker thread (in the main thread
nbclient takes SIGINT itself, kills the kernel and leaves asyncio tasks failing with DeadKernelError), and the
main thread turns KeyboardInterrupt into `Stopped`: it stops what the kernel started (the training CLI and
everything under it, cli/lifetime.py), lets papermill end on the failed cell, and raises once nothing is left.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from openrlhf_tis.cli.lifetime import stop_process_tree
from openrlhf_tis.cli.run_dir import checkpoint_dir
from openrlhf_tis.pipeline.execute import execute
from openrlhf_tis.runs.identity import foreign_checkpoint
from openrlhf_tis.runs.layout import METRICS_FILE
from openrlhf_tis.runs.reader import last_logged_step

# papermill ends within a few seconds once its cell's training is gone (run_training polls every refresh_seconds)
CELL_END_S = 30.0


class Interrupted(KeyboardInterrupt):
    """Ctrl-C ended a command; the message says what was stopped, what was kept and how to go on."""


class Stopped(KeyboardInterrupt):
    """Ctrl-C stopped a notebook's execution; `jobs` are the (pid, `python -m` module) the notebook had started."""

    def __init__(self, jobs: list[tuple[int, str]]):
        super().__init__(stopped(jobs))
        self.jobs = jobs


def execute_stoppable(name: str, output: Path, parameters: Mapping[str, Any], cwd: Path,
                      wait: Callable[[threading.Event], None] | None = None) -> Path:
    """pipeline.execute in a worker thread while `wait(done)` runs here (default: just wait); raises what papermill
    raised, or `Stopped` on Ctrl-C once every process the notebook started has ended."""
    done, outcome = threading.Event(), {}

    def work() -> None:
        try:
            outcome["notebook"] = execute(name, output, parameters, cwd=cwd)
        except BaseException as err:  # raised here, in the main thread
            outcome["error"] = err
        finally:
            done.set()

    thread = threading.Thread(target=work, name=f"papermill {name}", daemon=True)
    thread.start()
    try:
        (wait or _wait)(done)
        thread.join()
    except KeyboardInterrupt:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the stop short
        try:
            jobs = _stop_notebook(thread)
        finally:
            signal.signal(signal.SIGINT, previous)
        raise Stopped(jobs) from None
    if "error" in outcome:
        raise outcome["error"]
    return outcome["notebook"]


def _wait(done: threading.Event) -> None:
    while not done.wait(0.5):
        pass


def _stop_notebook(thread: threading.Thread) -> list[tuple[int, str]]:
    """Stop what the kernel started and wait for papermill to end; the kernel itself goes when papermill does not."""
    import psutil

    kernels = psutil.Process().children()
    jobs = [proc for kernel in kernels for proc in _children(kernel)]
    described = [(proc.pid, _module(proc)) for proc in jobs]
    stop_process_tree([proc.pid for proc in jobs])
    thread.join(CELL_END_S)
    if thread.is_alive():  # the kernel was not in a training cell (starting, between cells, drawing a report)
        stop_process_tree([kernel.pid for kernel in kernels])
        thread.join(CELL_END_S)
    return described


def _children(proc) -> list:
    import psutil

    try:
        return proc.children()
    except psutil.Error:
        return []


def _module(proc) -> str:
    """The `python -m` module a process runs (how the notebooks start theirs), else its executable's name."""
    import psutil

    try:
        cmdline = proc.cmdline()
    except psutil.Error:
        return "a process"
    if "-m" in cmdline[:-1]:
        return cmdline[cmdline.index("-m") + 1]
    return os.path.basename(cmdline[0]) if cmdline else "a process"


def stopped(jobs: list[tuple[int, str]]) -> str:
    """`jobs` (Stopped.jobs) as the start of an account: what Ctrl-C stopped."""
    return "stopped " + ", ".join(f"{module} (pid {pid})" for pid, module in jobs) if jobs else "nothing was running"


def resumable(run_dir: Path) -> bool:
    """Whether a run directory holds steps and a checkpoint of that same history (the notebooks save checkpoints
    under <run_dir>/ckpt, when extra_args ask for them with --ckpt.save_steps)."""
    actor = checkpoint_dir(str(run_dir / "ckpt"))
    return actor is not None and bool(last_logged_step(run_dir)) and foreign_checkpoint(run_dir, actor) is None


def kept(run_dir: Path, planned_steps: int) -> str:
    """What a stopped run left, to follow "kept: ": its logged steps and its checkpoint (under run_dir/ckpt)."""
    last = last_logged_step(run_dir) or 0
    logged = "no step" if not last else "step 1" if last == 1 else f"steps 1-{last}"
    steps = f"{logged} of {planned_steps} in {run_dir / METRICS_FILE}" if last else logged
    actor = checkpoint_dir(str(run_dir / "ckpt"))
    if actor is None:
        return f"{steps}, no checkpoint"
    return f"{steps} and the checkpoint {(actor / 'latest').read_text().strip()} in {actor}"
