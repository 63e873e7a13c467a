"""Why a job the notebooks start failed, in one line: its exit (a code, or the signal that killed it) and the line
of its log that names the error.

A training log is mostly Ray's prefixed actor output and upstream's per-step metrics dicts, whose keys contain
words such as `error` (`rollout/int8_max_rel_error`): the cause is the last line that *is* an error, i.e. a Python
exception line (`ValueError: ...`, `ray.exceptions.ActorDiedError: ...`) or a command's own `prog: error: ...`,
never a line that merely holds the word. A process killed by a signal wrote nothing about it: its exit says so.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

TAIL_LINES = 60
# What Ray puts before an actor's line ("(_TisPPOTrainer pid=123) "), terminal colours included.
_RAY_PREFIX = re.compile(r"^(?:\x1b\[[0-9;]*m)*\([^()]*pid=\d+[^()]*\)(?:\x1b\[[0-9;]*m)*\s*")
# A Python exception line: a dotted class name ending in Error/Exception/Exit/Interrupt (Ray adds the wrapped
# type in parentheses), a colon, the message; or argparse's `prog: error: message`.
_ERROR_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)(?:\([\w.]*\))?: \S"
                         r"|\S+: error: \S)")


def log_tail(path: Path, lines: int = TAIL_LINES) -> str:
    """The last `lines` lines of a log (read from its end only)."""
    if not path.is_file():
        return "(no log written)"
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - (1 << 16)))
        return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")


def cause(tail: str) -> str:
    """The line of a log tail that says why the job failed: the last error line, else the last line."""
    lines = [_RAY_PREFIX.sub("", line).strip() for line in tail.splitlines()]
    lines = [line for line in lines if line]
    errors = [line for line in lines if _ERROR_LINE.match(line)]
    return (errors or lines or ["(empty log)"])[-1]


def failure(what: str, code: int, log: Path) -> str:
    """`what` ended with exit status `code` (Popen's: negative for a signal): the cause, then the log's tail."""
    tail = log_tail(log)
    if code < 0:
        why = f"was killed by {_signal_name(-code)} from outside it (another process, or the kernel's OOM killer)"
    else:
        why = f"exited with code {code}: {cause(tail)}"
    return f"{what} {why}\nfull log: {log}; its tail:\n{tail}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def notebook_error(err: BaseException) -> str:
    """papermill's error as one line: which cell, which exception, the first line of its message."""
    cell = getattr(err, "cell_index", None)
    ename, evalue = getattr(err, "ename", type(err).__name__), getattr(err, "evalue", str(err))
    first_line = str(evalue).strip().splitlines()[0] if str(evalue).strip() else ""
    return (f"cell {cell}: " if cell is not None else "") + f"{ename}: {first_line}"
