"""The driver stops, naming the cause, when an actor of its run dies of an error.

Upstream's train() waits on Ray futures with no time limit, and not always on the actor that died: a vLLM engine whose
constructor raised (a KV cache larger than the node's free memory) left the policy actor waiting for it at the weight
sync's rendezvous, and the driver waiting on the policy actor until it was killed. Ray's GCS knows at once that the
engine is DEAD and why. A daemon thread of the driver reads this job's dead actors from the GCS actor table every POLL_S
seconds (`ray._private.state`, Ray 2.55: `ray.util.state` needs the dashboard, which a local run does not start) and,
at the first one dead of an error, interrupts the main thread; the CLI then shuts Ray down as after Ctrl-C and ends in
one line naming the actor and its error (cli/train_ppo_ray.py). Deaths on purpose are ignored (`ray.kill`, handles out
of scope, an owner's death: the owner is reported itself, `exit_actor`); the watch stops before the driver's shutdown.

vLLM's async engine starts its engine core in a child process whose error never reaches the actor, which raises
"Engine core initialization failed. See root cause above.": the root cause is read from the actor's worker log, where
the child's traceback went, when that log is on the driver's node.
"""

from __future__ import annotations

import _thread
import glob
import os
import re
import signal
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ray.core.generated.common_pb2 import ActorDiedErrorContext

POLL_S = 2.0
# The main thread is woken through this signal's Python handler by `_thread.interrupt_main`, which sends no OS signal:
# SIGINT stays the user's (and may be ignored when the CLI runs in the background); a SIGUSR1 from outside is ignored.
WAKE_SIGNAL = signal.SIGUSR1
MAX_CAUSE_CHARS = 600
# Worker deaths that are failures; OWNER_DIED, RAY_KILL, OUT_OF_SCOPE and REF_DELETED end actors on purpose.
_FAILED_REASONS = frozenset({ActorDiedErrorContext.WORKER_DIED, ActorDiedErrorContext.NODE_DIED})
_INTENDED_EXIT = "INTENDED_USER_EXIT"  # ray.actor.exit_actor(): Ray files it as a worker death
LOG_TAIL_BYTES = 1 << 16
VLLM_SEE_ABOVE = "See root cause above"  # vLLM's words when its engine core process failed to start
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# A Python exception's first line: a dotted class name (Ray adds the wrapped type in parentheses), a colon, the message.
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)(?:\([\w.]*\))?: \S")

Records = Iterable[Mapping[str, Any]]


@dataclass(frozen=True)
class ActorDeath:
    """An actor of the run that died of an error."""

    class_name: str
    pid: int
    cause: str

    def __str__(self) -> str:
        return f"the Ray actor {self.class_name} (pid {self.pid}) died: {self.cause}"


def first_failure(records: Records) -> ActorDeath | None:
    """The earliest death of an error among `records` (the values of `ray._private.state.actors()`), or None."""
    deaths = []
    for record in records:
        cause = failure_cause(record["DeathCause"]) if record.get("State") == "DEAD" else None
        if cause is not None:
            deaths.append((record.get("EndTime", 0), ActorDeath(record["ActorClassName"], record["Pid"], cause)))
    return min(deaths, key=lambda death: death[0])[1] if deaths else None


def failure_cause(death_cause) -> str | None:
    """An actor's death cause (Ray's `ActorDeathCause` message) in one line when it is an error; None otherwise."""
    kind = death_cause.WhichOneof("context")
    if kind == "creation_task_failure_context":  # its constructor raised
        return exception_text(death_cause.creation_task_failure_context.formatted_exception_string)
    if kind == "actor_died_error_context":
        context = death_cause.actor_died_error_context
        if context.reason not in _FAILED_REASONS or _INTENDED_EXIT in context.error_message:
            return None
        # Ray appends a paragraph of guesses ("There are some potential root causes...") to what it saw.
        return _one_line(context.error_message.split(" There are some potential root causes")[0])
    if kind is None:
        return None
    return _one_line(getattr(death_cause, kind).error_message)  # runtime env failed, out of memory, unschedulable


def exception_text(formatted: str) -> str:
    """A formatted traceback's last exception, from its `Name: message` line to the end, on one line (a message can
    span lines: pydantic's validation errors); the last line when no such line is found."""
    lines = [_ANSI.sub("", line).rstrip() for line in formatted.splitlines()]
    lines = [line for line in lines if line.strip()]
    starts = [i for i, line in enumerate(lines) if _EXCEPTION_LINE.match(line)]
    return _one_line(" ".join(lines[starts[-1]:] if starts else lines[-1:]) or "(no message)")


def _one_line(text: str) -> str:
    text = " ".join(_ANSI.sub("", text).split())
    return text if len(text) <= MAX_CAUSE_CHARS else text[:MAX_CAUSE_CHARS - 1] + "…"


def with_root_cause(death: ActorDeath, log_tail: str) -> ActorDeath:
    """`death` with the root cause its actor's log holds when the actor's own error only points there (vLLM's engine
    core): the last exception line of `log_tail` before that error's; `death` unchanged otherwise."""
    if VLLM_SEE_ABOVE not in death.cause:
        return death
    lines = [_ANSI.sub("", line).rstrip() for line in log_tail.splitlines()]
    causes = [line for line in lines if _EXCEPTION_LINE.match(line) and VLLM_SEE_ABOVE not in line]
    if not causes:
        return death
    return ActorDeath(death.class_name, death.pid, f"{_one_line(causes[-1])} (in its vLLM engine core process)")


def worker_log_tail(pid: int) -> str:
    """The end of the stderr log of the Ray worker `pid` on this node (Ray's `worker-<id>-<job>-<pid>.err`), or ""
    when it is not here (a worker on another node, a driver that did not start or join a node)."""
    from ray._private import worker

    node = worker._global_node
    paths = glob.glob(os.path.join(node.get_logs_dir_path(), f"worker-*-{pid}.err")) if node is not None else []
    if not paths:
        return ""
    with open(max(paths, key=os.path.getmtime), "rb") as log:
        log.seek(max(0, log.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
        return log.read().decode(errors="replace")


def dead_actors_of_this_job() -> Records:
    """The dead actors this driver's job created, read from the GCS (works without the dashboard)."""
    import ray
    from ray._private import state

    if not ray.is_initialized():
        return ()
    job = ray.JobID.from_hex(ray.get_runtime_context().get_job_id())
    return state.actors(job_id=job, actor_state_name="DEAD").values()


class ActorWatch:
    """Polls the run's dead actors on a daemon thread; `start` and `stop` are called from the main thread.

    At the first death of an error it records it in `death` and raises KeyboardInterrupt in the main thread (inside
    `ray.get`, which checks for signals every second); `woke_main` then tells that interrupt from a user's Ctrl-C."""

    def __init__(self, read: Callable[[], Records] = dead_actors_of_this_job,
                 log_tail: Callable[[int], str] = worker_log_tail, poll_s: float = POLL_S):
        self._read = read
        self._log_tail = log_tail
        self.poll_s = poll_s
        self.death: ActorDeath | None = None
        self.woke_main = False
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._previous_handler: Any = None

    def start(self) -> ActorWatch:
        self._previous_handler = signal.signal(WAKE_SIGNAL, self._wake)
        self._thread = threading.Thread(target=self._poll, name="openrlhf_tis-actor-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the polling and put the signal's previous handler back (a no-op once stopped)."""
        if self._thread is None:
            return
        self._stopped.set()
        self._thread.join(timeout=self.poll_s + 10)  # a GCS read under way finishes, or is left to the daemon
        self._thread = None
        if self._previous_handler is not None:  # None: a handler not set from Python, which cannot be put back
            signal.signal(WAKE_SIGNAL, self._previous_handler)

    def _poll(self) -> None:
        while not self._stopped.wait(self.poll_s):
            try:
                death = first_failure(self._read())
            except Exception:  # the GCS unreachable for a moment; its end ends the driver anyway (fate sharing)
                continue
            if death is not None:
                try:
                    death = with_root_cause(death, self._log_tail(death.pid))
                except OSError:  # a log rotated or removed meanwhile: the actor's own error stands
                    pass
                self.death = death
                _thread.interrupt_main(WAKE_SIGNAL)
                return

    def _wake(self, signum: int, frame: Any) -> None:
        if self._stopped.is_set() or self.death is None:  # the run ended first, or a SIGUSR1 from outside
            return
        self.woke_main = True
        raise KeyboardInterrupt
