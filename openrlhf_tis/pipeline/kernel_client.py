"""A Jupyter kernel client whose unbounded waits for a message ask the socket again every REPOLL_S.

nbclient waits for a cell's reply with one poll of the shell socket and no timeout. A zmq.asyncio poll wakes only
when the socket's notification fd turns readable, and that fd is edge-like: whatever processes the socket's pending
commands first (any other operation on the socket, a read of its EVENTS) drains it, so a reply already in the
socket can wait unseen. Measured (docs/measurements.md, 2026-12-06, seventh sitting): a dashboard page stayed loading
forever with the kernel idle, IOPub's "idle" for its last cell received (nbclient's output task had ended) and the
reply-waiting task still polling the shell socket; the same with ipykernel 6.31 as with 7.4. A poll that is asked
again reads the socket's state first (pyzmq checks EVENTS when a poll is added), so a reply that arrived is found
within REPOLL_S whatever consumed its wake-up. Waits with a timeout keep it; only the wait with none is split.

Used by the dashboard's Voilà server (dashboard/voila_server.py, through the kernel manager's `client_class`) and
by papermill's notebook runs (pipeline/execute.py, through RepollingKernelManager).
"""

from __future__ import annotations

import time
from queue import Empty
from typing import Any

from jupyter_client.asynchronous import AsyncKernelClient
from jupyter_client.channels import AsyncZMQSocketChannel
from jupyter_client.manager import AsyncKernelManager
from traitlets import DottedObjectName, Type

REPOLL_S = 1.0


class RepollingChannel(AsyncZMQSocketChannel):
    """A channel whose `get_msg` never waits on one poll longer than REPOLL_S (the caller's timeout still holds)."""

    async def get_msg(self, timeout: float | None = None) -> dict[str, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = REPOLL_S if deadline is None else max(0.0, min(REPOLL_S, deadline - time.monotonic()))
            try:
                return await super().get_msg(timeout=left)
            except Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    raise


class RepollingKernelClient(AsyncKernelClient):
    """jupyter_client's async kernel client with RepollingChannel on every message channel."""

    shell_channel_class = Type(RepollingChannel)
    iopub_channel_class = Type(RepollingChannel)
    stdin_channel_class = Type(RepollingChannel)
    control_channel_class = Type(RepollingChannel)


CLIENT_CLASS = f"{RepollingKernelClient.__module__}.{RepollingKernelClient.__qualname__}"


class RepollingKernelManager(AsyncKernelManager):
    """jupyter_client's async kernel manager handing out RepollingKernelClient (papermill's `kernel_manager_class`)."""

    client_class = DottedObjectName(CLIENT_CLASS)
    client_factory = Type(klass=RepollingKernelClient, default_value=RepollingKernelClient)
