"""dashboard/waits.py: a pending task's chain of awaits, through an `async for` over an async generator, down to
the future it waits on; the SIGUSR1 handler prints it from the loop's own thread."""

from __future__ import annotations

import asyncio
import io
import os
import signal

import zmq

from openrlhf_tis.dashboard.waits import await_chain, print_waits_on_sigusr1, zmq_socket_states


async def _innermost(gate: asyncio.Future) -> None:
    await gate


async def _snippets(gate: asyncio.Future):
    yield "head"
    await _innermost(gate)
    yield "tail"


async def _page(gate: asyncio.Future) -> list[str]:
    page = []
    async for snippet in _snippets(gate):
        page.append(snippet)
    return page


def _chain_functions(lines: list[str]) -> list[str]:
    return [line.rsplit(" in ", 1)[1] for line in lines if " in " in line]


def test_the_chain_goes_through_an_async_for_down_to_the_future():
    async def main() -> list[str]:
        gate = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(_page(gate), name="page")
        await asyncio.sleep(0.01)  # the task now waits on `gate`
        lines = list(await_chain(task.get_coro()))
        gate.set_result(None)
        assert await task == ["head", "tail"]
        return lines

    lines = asyncio.run(main())
    assert _chain_functions(lines) == ["_page", "_snippets", "_innermost"]
    assert lines[-1].startswith("<Future pending")


def test_sigusr1_prints_each_pending_task():
    async def main() -> str:
        loop = asyncio.get_running_loop()
        out = io.StringIO()
        print_waits_on_sigusr1(loop, out)
        gate = loop.create_future()
        task = asyncio.create_task(_page(gate), name="the-page")
        await asyncio.sleep(0.01)
        os.kill(os.getpid(), signal.SIGUSR1)
        await asyncio.sleep(0.05)  # the handler runs between callbacks
        gate.set_result(None)
        await task
        loop.remove_signal_handler(signal.SIGUSR1)
        return out.getvalue()

    text = asyncio.run(main())
    # the test's own main() is pending too, in any order: read the page's block alone
    block = text.split("task the-page:\n", 1)[1].split("\ntask ", 1)[0]
    assert block.index("in _page") < block.index("in _innermost") < block.index("<Future pending")


def test_each_zmq_socket_says_whether_a_message_waits_in_it():
    context = zmq.Context()
    sender, receiver = context.socket(zmq.PUSH), context.socket(zmq.PULL)
    try:
        receiver.bind("inproc://waits-test")
        sender.connect("inproc://waits-test")
        line = next(line for line in zmq_socket_states() if " PULL inproc://waits-test" in line)
        assert line.endswith("POLLIN=False")
        sender.send(b"reply")
        assert receiver.poll(5000)
        line = next(line for line in zmq_socket_states() if " PULL inproc://waits-test" in line)
        assert line.endswith("POLLIN=True")
    finally:
        sender.close(0)
        receiver.close(0)
        context.term()
