"""What a training process leaves behind when it ends, however it ends.

- A training process started by a notebook ends with the process that started it. pipeline/train.py runs
  the training CLI in its own session (a notebook interrupt must not reach Ray's processes half-way), so
  when the notebook's kernel is killed instead of interrupted (papermill shuts it down when a sweep gets
  Ctrl-C) nothing would stop the run: it would keep training, and keep its run directory locked, with no
  one reading it. The starter names itself in PARENT_ENV; the CLI then asks the kernel (Linux prctl
  PR_SET_PDEATHSIG) for SIGTERM when that parent dies.
- The Ray session a run started goes with it. Ray fate-shares its GCS and raylet with the driver, but the
  raylet's dashboard and runtime-env agents, after a kill -9 of the driver, try to report the raylet's
  death to the dead GCS and linger. A watchdog (`python -m openrlhf_tis.cli.lifetime SESSION_DIR`, in its
  own session so a kill of the driver's process group spares it) waits for the driver's end (EOF on a
  pipe only the driver holds), then stops every process still running from that session's directory.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

PARENT_ENV = "OPENRLHF_TIS_PARENT_PID"
_PR_SET_PDEATHSIG = 1
GRACE_S = 3.0  # Ray's own shutdown (a normal exit, or fate-sharing after a kill) goes first
_watchdogs: list[subprocess.Popen] = []  # their stdin pipes stay open for this process's life


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


def reap_when_gone(marker: str) -> None:
    """Start the watchdog that stops the processes whose command line holds `marker` once this process ends."""
    _watchdogs.append(subprocess.Popen([sys.executable, "-m", __name__, marker], stdin=subprocess.PIPE,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                       start_new_session=True))


def leftover_processes(marker: str) -> list:
    """Live processes (psutil.Process, this one excepted) whose command line mentions `marker`."""
    import psutil  # a dependency of Ray and DeepSpeed, which a training process has; not of a notebook kernel

    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if proc.pid != os.getpid() and any(marker in part for part in proc.info["cmdline"] or ()):
            found.append(proc)
    return found


def _watch(marker: str) -> None:
    import psutil

    while sys.stdin.buffer.read(1 << 16):  # EOF: the driver ended
        pass
    time.sleep(GRACE_S)
    procs = leftover_processes(marker)
    for proc in procs:
        try:
            proc.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=GRACE_S)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass


if __name__ == "__main__":
    _watch(sys.argv[1])
