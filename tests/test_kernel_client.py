"""pipeline/kernel_client.py: a message whose wake-up was consumed before the event loop saw it (the socket's
commands processed by another operation) is found by a RepollingChannel within REPOLL_S, while jupyter_client's own
channel waits on; timeouts still hold; the dashboard's server and papermill's runs are handed the repolling client."""

from __future__ import annotations

import asyncio
import time
from queue import Empty

import pytest
import zmq
import zmq.asyncio
from jupyter_client.channels import AsyncZMQSocketChannel
from jupyter_client.session import Session

from openrlhf_tis.pipeline.kernel_client import (
    REPOLL_S,
    RepollingChannel,
    RepollingKernelClient,
    RepollingKernelManager,
)


async def _wait_with_a_swallowed_wakeup(channel_class: type, wait_s: float) -> tuple[dict | None, float]:
    """A DEALER channel waiting with no timeout; a ROUTER replies, and before the loop runs again the DEALER's pending
    commands are processed through a raw shadow of it (reading EVENTS), which drains its notification fd: the reply
    sits in the socket with nothing to wake the poll. Returns (message or None within `wait_s`, seconds taken)."""
    session = Session()
    router = zmq.Context.instance().socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    context = zmq.asyncio.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    channel = channel_class(dealer, session)
    try:
        session.send(dealer, session.msg("kernel_info_request"))
        identity, *_ = router.recv_multipart()  # the router knows the dealer now
        waiting = asyncio.ensure_future(channel.get_msg(timeout=None))
        await asyncio.sleep(0.2)  # the poll is registered and the loop sleeps on the dealer's fd
        started = time.monotonic()
        session.send(router, session.msg("kernel_info_reply"), ident=identity)
        raw = zmq.Socket.shadow(dealer.underlying)
        arrival = time.monotonic() + 30
        # blocking, so the loop does not run: each read of EVENTS processes the dealer's commands, which drains its
        # notification fd; the read that finds the reply leaves it waiting in the socket with the fd drained
        while not raw.get(zmq.EVENTS) & zmq.POLLIN:
            assert time.monotonic() < arrival, "the reply never reached the dealer"
            time.sleep(0.05)
        try:
            message = await asyncio.wait_for(waiting, wait_s)
        except TimeoutError:
            return None, time.monotonic() - started
        return message, time.monotonic() - started
    finally:
        dealer.close(linger=0)
        context.term()
        router.close(linger=0)


def test_a_reply_whose_wakeup_was_swallowed_is_found_within_the_repoll_interval():
    message, seconds = asyncio.run(_wait_with_a_swallowed_wakeup(RepollingChannel, wait_s=REPOLL_S + 3))
    assert message is not None and message["msg_type"] == "kernel_info_reply"
    assert seconds <= REPOLL_S + 1.5, seconds


def test_jupyter_clients_own_channel_waits_on_such_a_reply():
    """The defect the repolling channel exists for; if pyzmq or jupyter_client ever find such a reply themselves,
    this fails and the repolling can go."""
    message, _ = asyncio.run(_wait_with_a_swallowed_wakeup(AsyncZMQSocketChannel, wait_s=REPOLL_S + 3))
    assert message is None


def test_a_timeout_still_holds():
    async def wait() -> float:
        context = zmq.asyncio.Context()
        dealer = context.socket(zmq.DEALER)
        dealer.connect("tcp://127.0.0.1:9")  # nothing answers
        started = time.monotonic()
        try:
            with pytest.raises(Empty):
                await RepollingChannel(dealer, Session()).get_msg(timeout=2.5)
            return time.monotonic() - started
        finally:
            dealer.close(linger=0)
            context.term()

    assert 2.5 <= asyncio.run(wait()) < 2.5 + REPOLL_S


def test_the_managers_hand_out_the_repolling_client(tmp_path):
    """papermill's runs get RepollingKernelManager (pipeline/execute.py); the dashboard's Voilà app, configured by
    voila_args as it serves, makes kernel managers whose clients are repolling ones."""
    from openrlhf_tis.dashboard.voila_app import LocalVoila
    from openrlhf_tis.dashboard.voila_server import voila_args

    assert isinstance(RepollingKernelManager().client(), RepollingKernelClient)
    notebook = tmp_path / "dashboard.ipynb"
    notebook.write_text('{"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}')
    app = LocalVoila()
    app.initialize(voila_args(notebook, 8866))
    app.connection_dir = str(tmp_path)
    app.init_settings()  # builds the app's multi-kernel manager, as `start` does before it listens
    pages = app.kernel_manager
    manager = pages.kernel_manager_factory(connection_file=str(tmp_path / "kernel.json"), parent=pages,
                                           log=pages.log, kernel_name="python3")
    assert isinstance(manager.client(), RepollingKernelClient), type(manager.client())
