"""What a training process leaves behind when it ends, however it ends.

- A training process started by a notebook ends with the process that started it. pipeline/train.py runs
  the training CLI in its own session (a notebook interrupt must not reach Ray's processes half-way), so
  when the notebook's kernel is killed instead of interrupted (papermill shuts it down when a sweep gets
  Ctrl-C) nothing would stop the run: it would keep training, and keep its run directory locked, with no
  one reading it. The starter names itself in PARENT_ENV; the CLI then asks the kernel (Linux prctl
  PR_SET_PDEATHSIG) for SIGTERM when that parent dies.
- The Ray session a run started goes with it. Ray fate-shares its GCS and raylet with the driver, but the
  raylet's dashboard and runtime-env agents, after a kill -9 of the driver, try to report the raylet's
  death to the dead GCS and linger (about a minute, measured: docs/run_store.md). A watchdog (`python -m
  openrlhf_tis.cli.lifetime SESSION_DIR`, in its own session so a kill of the driver's process group spares it)
  waits for the driver's end (EOF on a pipe only the driver holds), then stops every process of that session
  (`session_processes`).
- A training process stopped on purpose (Ctrl-C in a notebook, the main job or a sweep) is stopped with all it
  started: `stop_process_tree` sends SIGTERM (the CLI's driver then shuts Ray down, which ends the run's actors,
  the controller that writes metrics.jsonl among them) and returns only once every process of the tree has
  ended, so no step is logged after the command that stopped it has said it stopped.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import subprocess
import sys
import time

PARENT_ENV = "OPENRLHF_TIS_PARENT_PID"
_PR_SET_PDEATHSIG = 1
GRACE_S = 3.0  # Ray's own shutdown (a normal exit, or fate-sharing after a kill) goes first
# A stopped run's driver shuts Ray down (its actors, GCS and raylet, then the watchdog's sweep): ~10 s on 2 busy cores.
STOP_TIMEOUT_S = 60.0
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


ARMED = b"armed\n"
ARM_TIMEOUT_S = 60.0  # a watchdog starts a bare Python (~0.1 s); a loaded 2-core machine can take far longer


def reap_when_gone(session_dir: str, timeout: float = ARM_TIMEOUT_S) -> bool:
    """Start the watchdog that stops the processes of the Ray session in `session_dir` (`session_processes`) once
    this process ends, and return once it is armed (it says so on its stdout): True, or False with a warning when
    it did not say so within `timeout` seconds (the run goes on; only the clean-up after a kill -9 is at stake)."""
    watchdog = subprocess.Popen([sys.executable, "-m", __name__, session_dir], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
    _watchdogs.append(watchdog)
    ready, _, _ = select.select([watchdog.stdout], [], [], timeout)
    armed = bool(ready) and watchdog.stdout.readline() == ARMED
    watchdog.stdout.close()
    if not armed:
        print(f"[openrlhf_tis] warning: the watchdog for {session_dir} did not start within {timeout:g} s (exit code "
              f"{watchdog.poll()}); if this run is killed, stop what it leaves running yourself", file=sys.stderr)
    return armed


def session_processes(session_dir: str) -> list:
    """Live processes (psutil.Process; this one and its ancestors excepted) of the Ray session in `session_dir`:
    those whose command line names it (GCS, raylet, dashboard, monitors) and those writing a file under it. Ray's
    agents and workers retitle themselves (`ray::DashboardAgent`, `ray::IDLE`), so their command lines name nothing,
    but their output goes to the session's logs, and so does that of every process they start. A reader (`tail -f`
    of a log) is not one of them, nor is another session's process."""
    import psutil  # a dependency of Ray and DeepSpeed, which a training process has; not of a notebook kernel

    under = os.path.join(os.path.realpath(session_dir), "")  # /proc names open files by their real paths
    # Neither this process nor what started it: `timeout 60 python -c "stop_session(...)" SESSION` names the session.
    ours = {os.getpid(), *(parent.pid for parent in psutil.Process().parents())}
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if proc.pid not in ours and (any(session_dir in part for part in proc.info["cmdline"] or ())
                                     or _writes_under(proc, under)):
            found.append(proc)
    return found


def _writes_under(proc, directory: str) -> bool:
    import psutil

    try:
        return any(file.path.startswith(directory) and file.mode != "r" for file in proc.open_files())
    except psutil.Error:  # ended meanwhile, or another user's
        return False


def stop_session(session_dir: str, grace: float = GRACE_S) -> None:
    """SIGTERM every process of the Ray session in `session_dir`, SIGKILL those still running `grace` seconds later;
    the session is read again until it is empty (a raylet may start a worker meanwhile), at most three times."""
    import psutil

    for _ in range(3):
        procs = session_processes(session_dir)
        if not procs:
            return
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                proc.terminate()
        _, alive = psutil.wait_procs(procs, timeout=grace)
        for proc in alive:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(alive, timeout=grace)


def stop_process_tree(pids: list[int], timeout: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM the processes `pids`, then wait until they and every process they started have ended; SIGKILL
    whatever is left after `timeout` seconds. The tree is re-read while it shrinks: a process started meanwhile,
    or re-parented when its parent died, is waited for too."""
    import psutil

    roots = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):  # already gone
            roots.append(psutil.Process(pid))
    tree = {proc.pid: proc for proc in roots}

    def alive() -> list:
        children: dict[int, list] = {}
        for proc in psutil.process_iter(["ppid"]):  # one pass over the process table per poll
            children.setdefault(proc.info["ppid"], []).append(proc)
        todo = list(tree)
        while todo:
            for child in children.get(todo.pop(), []):
                if child.pid not in tree:
                    tree[child.pid] = child
                    todo.append(child.pid)
        return [proc for proc in tree.values() if _running(proc)]

    def wait(seconds: float) -> list:
        deadline = time.monotonic() + seconds
        while (left := alive()) and time.monotonic() < deadline:
            time.sleep(0.5)
        return left

    alive()
    for proc in roots:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    for proc in wait(timeout):
        with contextlib.suppress(psutil.Error):
            proc.kill()
    wait(GRACE_S)  # never reaps: a caller's Popen keeps its child's exit code


def _running(proc) -> bool:
    """Alive and not a zombie (an ended child its parent has not reaped yet)."""
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _watch(session_dir: str) -> None:
    sys.stdout.buffer.write(ARMED)  # reap_when_gone returns on this: from now on the driver's end is seen
    sys.stdout.buffer.flush()
    sys.stdout.close()
    while sys.stdin.buffer.read(1 << 16):  # EOF: the driver ended
        pass
    time.sleep(GRACE_S)
    stop_session(session_dir)


if __name__ == "__main__":
    _watch(sys.argv[1])
