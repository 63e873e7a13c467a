"""Where the controller is in its step, and whether it moves, for the driver's stall bound (cli/stall.py).

Upstream's controller waits on its actors with no time limit: an engine that hangs without dying (SIGSTOP, a
deadlock) stalls the run in silence, which no death watch sees. The controller runs in a Ray actor of its own, so it
tells the driver what it waits on through the GCS key-value store of its Ray session (one small record per job, no
file): the stage it is in, the actors that stage waits on (Ray actor ids) and a count that moves at every change of
stage and at every finished rollout response. The driver reads the record every few seconds and judges it with its
own clock (two processes, perhaps two nodes: no clock is shared).

Stages nest: a step's experience making holds its training and its weight sync; leaving a stage returns to the one
around it. Outside every stage (before the training loop, after it) the record says no stage, which is never bounded.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

GENERATE = "generate samples"
MAKE_EXPERIENCE = "make experience"
TRAIN = "train"
SYNC = "sync weights"
EVALUATE = "evaluate"
SAVE = "save checkpoint"
LOAD = "load checkpoint"

NAMESPACE = "openrlhf_tis"
PUBLISH_S = 1.0  # rollout progress reaches the GCS at most this often (every stage change at once)


@dataclass(frozen=True)
class StageRecord:
    """The controller's stage (None: outside the training loop), the actor ids it waits on, and a count that moves
    with every stage change and every finished rollout response."""

    stage: str | None
    actors: tuple[str, ...]
    count: int

    def encode(self) -> bytes:
        return json.dumps({"stage": self.stage, "actors": list(self.actors), "count": self.count}).encode()

    @staticmethod
    def decode(raw: bytes) -> StageRecord:
        record = json.loads(raw)
        return StageRecord(record["stage"], tuple(record["actors"]), int(record["count"]))


def record_key(job_id: str) -> str:
    """The GCS key of one job's record (the controller and the driver of a run share its Ray job)."""
    return f"stage:{job_id}"


def actor_ids(handles: Iterable) -> tuple[str, ...]:
    """The Ray actor ids (hex) of actor handles (anything else, such as a test's stand-in, has none)."""
    return tuple(handle._actor_id.hex() for handle in handles if hasattr(handle, "_actor_id"))


def group_ids(*groups) -> tuple[str, ...]:
    """The actor ids of upstream's RayActorGroups (None: a group the run does not have)."""
    return tuple(i for group in groups if group is not None for i in actor_ids(getattr(group, "_actor_handlers", ())))


class StageBoard:
    """The controller's side: `stage` around each waiting seam, `progress` at each finished rollout response.
    `publish` receives each record to publish; `clock` (seconds, monotonic) paces the progress records."""

    def __init__(self, publish: Callable[[StageRecord], None], clock: Callable[[], float] = time.monotonic):
        self._publish = publish
        self._clock = clock
        self._stack: list[tuple[str, tuple[str, ...]]] = []
        self._count = 0
        self._published_at = float("-inf")

    @contextmanager
    def stage(self, name: str, actors: tuple[str, ...]) -> Iterator[None]:
        self._stack.append((name, actors))
        self._moved()
        try:
            yield
        finally:
            self._stack.pop()
            self._moved()

    def progress(self) -> None:
        """A rollout response finished: the count moves; published when PUBLISH_S passed since the last record."""
        self._count += 1
        if self._clock() - self._published_at >= PUBLISH_S:
            self._moved(counted=True)

    def _moved(self, counted: bool = False) -> None:
        if not counted:
            self._count += 1
        stage, actors = self._stack[-1] if self._stack else (None, ())
        self._published_at = self._clock()
        self._publish(StageRecord(stage, actors, self._count))


def gcs_publisher() -> Callable[[StageRecord], None]:
    """Publish to this Ray job's record in the GCS (called in the controller's actor; nothing outside Ray, where no
    driver watches); a failed write is skipped: the bound then sees no move, as of a controller that cannot reach the
    GCS."""
    import ray
    from ray.experimental import internal_kv

    if not ray.is_initialized():
        return lambda record: None
    key = record_key(ray.get_runtime_context().get_job_id())

    def publish(record: StageRecord) -> None:
        try:
            internal_kv._internal_kv_put(key, record.encode(), overwrite=True, namespace=NAMESPACE)
        except Exception:  # the GCS unreachable for a moment
            pass

    return publish
