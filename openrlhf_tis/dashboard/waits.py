"""Where each of a server's asyncio tasks waits, printed on SIGUSR1: a page that never finishes loading is a task
awaiting something that never comes, and Python's fault handler shows only threads (the event loop idle in
`epoll`), not which `await` holds the page.

`kill -USR1 <dashboard pid>` prints every pending task of the server's loop to stderr, each as its chain of awaits,
outermost first: coroutine frames as `file:line in function`, down to the future (or the socket poll) at the
bottom. Python 3.11's `Task.get_stack` stops at the task's own frame and an `async for` hides the generator it
iterates, so the chain is followed through `cr_await` / `gi_yieldfrom` / `ag_await` and, where an `asend` object or a
future's iterator stands between (neither has an attribute naming what it wraps), through the garbage collector's
referents.

After the tasks it lists every open zmq socket with its POLLIN state read from the socket itself (`zmq.EVENTS`): a
task that waits in a poll while its socket says POLLIN=True is a message that arrived after the poll's wake-up was
consumed (the case `pipeline/kernel_client.py` repolls for), not a kernel that never answered.
"""

from __future__ import annotations

import asyncio
import gc
import signal
import sys
import types
from collections.abc import Iterator
from typing import TextIO

_FRAME = ("cr_frame", "gi_frame", "ag_frame")
_AWAITS = ("cr_await", "gi_yieldfrom", "ag_await")
_STEPPABLE = (types.CoroutineType, types.GeneratorType, types.AsyncGeneratorType)
DEPTH = 64  # a chain longer than this is cut (a cycle would otherwise print forever)


def _first(obj: object, names: tuple[str, ...]) -> object | None:
    return next((value for name in names if (value := getattr(obj, name, None)) is not None), None)


def await_chain(awaitable: object) -> Iterator[str]:
    """One line per link of what `awaitable` (a coroutine, generator or async generator) waits on, outermost
    first; the last line is the future or object at the bottom (repr, cut to 300 characters)."""
    for _ in range(DEPTH):
        if awaitable is None:
            return
        frame = _first(awaitable, _FRAME)
        if frame is None and not isinstance(awaitable, _STEPPABLE):
            referents = gc.get_referents(awaitable)
            inner = [ref for ref in referents if isinstance(ref, _STEPPABLE)]
            if not inner:  # a future (behind its iterator), or a finished coroutine: the bottom
                yield repr(next((ref for ref in referents if asyncio.isfuture(ref)), awaitable))[:300]
                return
            awaitable = inner[0]
            continue
        if frame is not None:
            yield f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"
        awaitable = _first(awaitable, _AWAITS)
    yield "… (cut)"


def print_waits(loop: asyncio.AbstractEventLoop, out: TextIO) -> None:
    """Every pending task of `loop` and its await chain, into `out`."""
    tasks = [task for task in asyncio.all_tasks(loop) if not task.done()]
    print(f"--- {len(tasks)} pending asyncio tasks, each with what it awaits, outermost first ---", file=out)
    for task in tasks:
        print(f"task {task.get_name()}:", file=out)
        for line in await_chain(task.get_coro()):
            print(f"    {line}", file=out)
    for line in zmq_socket_states():
        print(line, file=out)
    print("--- end of tasks ---", file=out, flush=True)


def zmq_socket_states() -> Iterator[str]:
    """One line per open zmq socket in this process: its type, endpoint and whether a message waits in it."""
    import zmq

    for sock in [obj for obj in gc.get_objects() if isinstance(obj, zmq.Socket)]:
        if sock.closed:
            continue
        try:
            events = sock.get(zmq.EVENTS)
            endpoint = sock.get(zmq.LAST_ENDPOINT).decode(errors="replace")
        except zmq.ZMQError as error:  # closed under us, or its context terminated
            yield f"zmq socket {type(sock).__name__}: {error}"
            continue
        kind, waiting = zmq.SocketType(sock.socket_type).name, bool(events & zmq.POLLIN)
        yield f"zmq socket {type(sock).__name__} {kind} {endpoint or '(no endpoint)'}: POLLIN={waiting}"


def print_waits_on_sigusr1(loop: asyncio.AbstractEventLoop, out: TextIO = sys.stderr) -> None:
    """From now on, SIGUSR1 prints `loop`'s tasks into `out` (from the loop's own thread, between callbacks)."""
    loop.add_signal_handler(signal.SIGUSR1, print_waits, loop, out)
