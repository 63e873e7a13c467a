"""A training process started by a notebook ends with the process that started it.

pipeline/train.py runs the training CLI in its own session (a notebook interrupt must not reach Ray's
processes half-way), so when the notebook's kernel is killed instead of interrupted (papermill shuts it
down when a sweep gets Ctrl-C) nothing would stop the run: it would keep training, and keep its run
directory locked, with no one reading it. The starter names itself in PARENT_ENV; the CLI then asks the
kernel (Linux prctl PR_SET_PDEATHSIG) for SIGTERM when that parent dies.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PARENT_ENV = "OPENRLHF_TIS_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """SIGTERM this process when the process named in PARENT_ENV dies (no-op when unset or not on Linux)."""
    expected = os.environ.get(PARENT_ENV)
    if not expected or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if str(os.getppid()) != expected:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)
