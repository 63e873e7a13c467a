"""The driver stops, naming the cause, when an actor of its run dies of an error.

Upstream's train() waits on Ray futures with no time limit, and not always on the actor that died: a vLLM engine whose
constructor raised (a KV cache larger than the node's free memory) left the policy actor waiting for it at the weight
sync's rendezvous, and the driver waiting on the policy actor until it was killed. Ray's GCS knows at once that the
engine is DEAD and why. A daemon thread of the driver reads this job's dead actors from the GCS actor table every POLL_S
seconds (`ray._private.state`, Ray 2.55: `ray.util.state` needs the dashboard, which a local run does not start) and,
at the first one dead of an error, interrupts the main thread; the CLI then shuts Ray down as after Ctrl-C and ends in
one line naming the actor and its error (cli/train_ppo_ray.py). Deaths on purpose are ignored (`ray.kill`, handles out
of scope, an owner's death: the owner is reported itself, `exit_actor`); the watch stops before the driver's shutdown.
The same thread polls the stall bound (cli/stall.py), which ends the driver the same way.

A death can also reach the driver first as the error of upstream's `ray.get` on the controller (the controller's own
`ray.get` on the dead actor raised `ActorDiedError`): Ray's error then carries the dead actor's class, pid and why it
died, and `death_in_error` reads them, so a `ray.kill` of an engine, which the watch leaves alone as a death on
purpose, or a SIGKILLed trainer process seen by upstream before the watch's next poll, ends in the same one line.
An engine whose vLLM engine core process died (SIGKILL, a crash) stays alive but raises vLLM's `EngineDeadError`,
which is read the same way.

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

from openrlhf_tis.cli.stall import Stall

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
# Ray's paragraph of guesses after what it saw of a dead worker (its words differ between the GCS and a task's error).
_RAY_GUESSES = re.compile(r" (?:There are some potential root causes|Some common causes include)")
# What Ray's ActorDiedError says of an actor that died while a task waited on it (ray/exceptions.py, Ray 2.55).
_ACTOR_DIED = re.compile(r"The actor died unexpectedly before finishing this task\.\n\tclass_name: (?P<cls>\S+)\n"
                         r"(?:\t(?!pid:)\w+: .*\n)*(?:\tpid: (?P<pid>\d+)\n)?(?:\t\w+: .*\n)*(?P<why>[\s\S]*)")
_DIED_TYPE = "ray.exceptions.ActorDiedError"
ENGINE_DEAD = "EngineDeadError"  # vLLM's error once an engine's engine core process is gone
# Where a task's error says it was raised: "ray::Class.method() (pid=N, ...", the innermost task last.
_TASK_PLACE = re.compile(r"ray::(?P<cls>\w+)\.\w+\(\) \(pid=(?P<pid>\d+)")

Records = Iterable[Mapping[str, Any]]


@dataclass(frozen=True)
class ActorDeath:
    """An actor of the run that died of an error."""

    class_name: str
    pid: int
    cause: str
    what: str = "died"  # what became of it: an engine that lost its engine core process did not die itself

    def __str__(self) -> str:
        return f"the Ray actor {self.class_name} (pid {self.pid}) {self.what}: {self.cause}"


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
        return _without_guesses(context.error_message)
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


def _without_guesses(message: str) -> str:
    """Ray's message on a dead worker, on one line, without the paragraph of guesses Ray appends to what it saw."""
    return _one_line(_RAY_GUESSES.split(message)[0])


def death_in_error(err: BaseException) -> ActorDeath | None:
    """The actor death that `err` (a Ray error raised in the driver, perhaps wrapping the controller's) reports: an
    actor that died while a task waited on it, or an engine whose vLLM engine core process died; None for any other
    error (the controller's own exceptions keep their traceback)."""
    from ray.exceptions import ActorDiedError, RayError, RayTaskError

    tasks, root = [], err
    while isinstance(root, RayTaskError) and root.cause is not None and root.cause is not root:
        tasks.append(root)
        root = root.cause
    # Ray keeps the ActorDiedError itself as the cause, or, where it could not pickle it, its text in a RayError.
    if isinstance(root, ActorDiedError) or (isinstance(root, RayError) and _DIED_TYPE in str(root)):
        died = _ACTOR_DIED.search(_ANSI.sub("", str(root)))
        if died is None:
            return None
        return ActorDeath(died["cls"], int(died["pid"] or 0), _without_guesses(died["why"]))
    if tasks and any(cls.__name__ == ENGINE_DEAD for cls in type(root).__mro__):
        text = _ANSI.sub("", str(tasks[-1]))  # Ray's copy of the engine's error (its attributes stay behind)
        places = _TASK_PLACE.findall(text)
        if not places:
            return None
        cls, pid = places[-1]
        return ActorDeath(cls, int(pid), exception_text(text), what="lost its vLLM engine core process")
    return None


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

    At the first death of an error it records it in `death` (at a stall, `stalled`: `stall_check`, cli/stall.py) and
    raises KeyboardInterrupt in the main thread (inside `ray.get`, which checks for signals every second); `woke_main`
    then tells that interrupt from a user's Ctrl-C."""

    def __init__(self, read: Callable[[], Records] = dead_actors_of_this_job,
                 log_tail: Callable[[int], str] = worker_log_tail, poll_s: float = POLL_S,
                 stall_check: Callable[[], Stall | None] | None = None):
        self._read = read
        self._log_tail = log_tail
        self._stall_check = stall_check
        self.poll_s = poll_s
        self.death: ActorDeath | None = None
        self.stalled: Stall | None = None
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

    def recorded_failure(self) -> ActorDeath | None:
        """The death the watch saw, else the first failure the GCS knows of now (None when it cannot be read)."""
        try:
            return self.death or self._with_root_cause(first_failure(self._read()))
        except Exception:
            return None

    def _poll(self) -> None:
        while not self._stopped.wait(self.poll_s):
            try:
                death = first_failure(self._read())
                stalled = self._stall_check() if death is None and self._stall_check is not None else None
            except Exception:  # the GCS unreachable for a moment; its end ends the driver anyway (fate sharing)
                continue
            if death is not None or stalled is not None:
                self.death, self.stalled = self._with_root_cause(death), stalled
                _thread.interrupt_main(WAKE_SIGNAL)
                return

    def _with_root_cause(self, death: ActorDeath | None) -> ActorDeath | None:
        if death is None:
            return None
        try:
            return with_root_cause(death, self._log_tail(death.pid))
        except OSError:  # a log rotated or removed meanwhile: the actor's own error stands
            return death

    def _wake(self, signum: int, frame: Any) -> None:
        if self._stopped.is_set() or (self.death is None and self.stalled is None):  # ended first, or from outside
            return
        self.woke_main = True
        raise KeyboardInterrupt
