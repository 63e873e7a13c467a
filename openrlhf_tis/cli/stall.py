"""The driver stops a run whose controller made no progress for `--train.stall_timeout_s` seconds.

An actor that hangs without dying (an engine under SIGSTOP, a deadlock in a collective) is invisible to the death
watch (cli/actor_watch.py), and upstream waits on it for ever. The controller publishes its stage, the actors that
stage waits on and a progress count (trainer/stage_board.py); the driver's watch thread reads that record every poll
and judges it with its own monotonic clock: a stage whose count has not moved for the bound is a stall, named with its
stage and the class and pid of each actor it waits on. Progress is any change of stage and, while generating samples
or evaluating, every finished rollout response; training, experience making, a weight sync and a checkpoint save are
each bounded as a whole. Start-up (Ray, the engines, the models' loading) comes before the controller's first stage and
is not bounded; nor is the final model's save after it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from openrlhf_tis.trainer.stage_board import NAMESPACE, StageRecord, record_key

FLAG = "--train.stall_timeout_s"
DEST = "train.stall_timeout_s"
DEFAULT_STALL_TIMEOUT_S = 1800.0  # ~30x the longest stage measured on the 2-core CPU machine (docs/run_store.md)


@dataclass(frozen=True)
class Stall:
    """A stage that made no progress for `seconds`, waiting on `actors` (each "Class (pid N)"; their Ray actor ids:
    `actor_ids`)."""

    stage: str
    seconds: float
    actors: tuple[str, ...]
    actor_ids: tuple[str, ...] = ()

    def __str__(self) -> str:
        waited = ", ".join(self.actors) or "no actor of the run"
        return (f"stalled: {self.stage} made no progress for {self.seconds:.0f} s, waiting on {waited}; raise {FLAG} "
                "or set it to 0 to disable the bound")


def check_stall_timeout(seconds: float) -> str | None:
    """Why `seconds` is not a valid bound, or None."""
    if not seconds >= 0 or seconds == float("inf"):  # NaN fails >= 0
        return f"must be a finite number of seconds >= 0 (0 disables the bound), got {seconds}"
    return None


class StallJudge:
    """Judges successive records with the driver's clock: a stall once a record's stage and count stayed the same for
    `timeout_s` seconds (no stage: never)."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._last: tuple[str | None, int] | None = None
        self._since = 0.0

    def observe(self, record: StageRecord | None, now: float) -> StageRecord | None:
        """The record judged stalled at `now`, or None. `record` None: the controller has published nothing yet."""
        if record is None:
            return None
        state = (record.stage, record.count)
        if state != self._last:
            self._last, self._since = state, now
            return None
        return record if record.stage is not None and now - self._since >= self.timeout_s else None

    def stalled_for(self, now: float) -> float:
        return now - self._since


def name_actors(ids: Iterable[str], records: Mapping[str, Mapping[str, Any]]) -> tuple[str, ...]:
    """Each actor id as "Class (pid N)" from the GCS actor table `records` (id -> record); an id not found as itself."""
    named = []
    for actor_id in ids:
        record = records.get(actor_id)
        named.append(f"{record['ActorClassName']} (pid {record['Pid']})" if record else f"actor {actor_id}")
    return tuple(named)


def read_stage_record() -> StageRecord | None:
    """This driver's job's record in the GCS, or None when the controller has published none."""
    import ray
    from ray.experimental import internal_kv

    raw = internal_kv._internal_kv_get(record_key(ray.get_runtime_context().get_job_id()), namespace=NAMESPACE)
    return StageRecord.decode(raw) if raw else None


def actors_of_this_job() -> Mapping[str, Mapping[str, Any]]:
    import ray
    from ray._private import state

    return state.actors(job_id=ray.JobID.from_hex(ray.get_runtime_context().get_job_id()))


class StallCheck:
    """One poll of the bound (called from the watch thread): the Stall, or None."""

    def __init__(self, timeout_s: float, read: Callable[[], StageRecord | None] = read_stage_record,
                 actors: Callable[[], Mapping[str, Mapping[str, Any]]] = actors_of_this_job,
                 clock: Callable[[], float] = time.monotonic):
        self._judge = StallJudge(timeout_s)
        self._read = read
        self._actors = actors
        self._clock = clock

    def __call__(self) -> Stall | None:
        now = self._clock()
        stalled = self._judge.observe(self._read(), now)
        if stalled is None:
            return None
        return Stall(stalled.stage, self._judge.stalled_for(now), name_actors(stalled.actors, self._actors()),
                     stalled.actors)


def kill_stalled(stall: Stall, records: Mapping[str, Mapping[str, Any]], here: str,
                 kill_pid: Callable[[int], None], ray_kill: Callable[[str], None]) -> None:
    """End the actors a stalled stage waited on, before Ray's shutdown, which asks each worker to exit: a stopped
    (SIGSTOP) or deadlocked one never does, and a SIGSTOPped engine outlived the run (the CPU e2e run). One on this
    driver's node (`here`, a node id) gets SIGKILL from `kill_pid` (it ends a stopped process too); one on another node
    `ray_kill`, the best the driver can do there. `records`: the GCS actor table (id -> record)."""
    for actor_id in stall.actor_ids:
        record = records.get(actor_id)
        if record is None:
            continue
        if record["Address"]["NodeID"] == here:
            kill_pid(record["Pid"])
        else:
            ray_kill(actor_id)


def kill_stalled_actors(stall: Stall) -> None:
    """kill_stalled on this driver's Ray session; an actor already gone, or one this driver holds no handle of, is
    left to Ray's shutdown."""
    import ray
    from ray._private.worker import global_worker

    def kill_pid(pid: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    def ray_kill(actor_id: str) -> None:
        with contextlib.suppress(Exception):  # the driver created the run's actors, so it holds their handles
            ray.kill(global_worker.core_worker.get_actor_handle(ray.ActorID.from_hex(actor_id)), no_restart=True)

    try:
        records = actors_of_this_job()
    except Exception:  # the GCS unreachable: nothing to go on
        return
    kill_stalled(stall, records, ray.get_runtime_context().get_node_id(), kill_pid, ray_kill)
