"""A new Ray node's agent ports chosen before its raylet starts, so a slow dashboard agent cannot abort the start.

Ray 2.55's raylet, starting, waits a fixed 15 s for its dashboard agent to write each port it bound into a file of
the session (node_manager.cc, `WaitForDashboardAgentPorts`; `RAY_agent_register_timeout_ms` does not reach that wait,
measured) and aborts when one is missing. The agent is a Python process importing aiohttp, grpc and opentelemetry: on
a loaded 2-core machine that is how most starts failed (measured: the agent SIGSTOPped for 25 s aborts every start).
A port the raylet is given on its command line it does not wait for, but `ray.init` gives none, and Ray's
`start_raylet` never passes the agent's listen port to the raylet at all. Inside `agent_ports_given()` a new node's
parameters get a free port for each agent port left open (and for the listen port left at Ray's fixed default, which
two clusters on one machine would share), and the raylet's command line gets the listen port its agent was given.
"""

from __future__ import annotations

import contextlib
import re
import socket
from collections.abc import Callable, Iterator
from typing import Any

from openrlhf_tis.upstream_guards import require_version, swapped

_THIS_FILE = "openrlhf_tis/cli/agent_ports.py"
AGENT_PORTS = ("metrics_agent_port", "metrics_export_port", "dashboard_agent_listen_port", "runtime_env_agent_port")
"""RayParams' ports of a node's agents: each is a port file the raylet waits for when its own value is 0."""
LISTEN_FLAG = "--dashboard_agent_listen_port"
_AGENT_COMMAND = "--dashboard_agent_command="
_LISTEN_PORT = re.compile(r"--listen-port=(\d+)")


def free_port() -> int:
    """A TCP port free on this machine now (the OS's choice), for an agent to bind a moment later."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def fill_agent_ports(ray_params: Any, default_listen_port: int, pick: Callable[[], int] = free_port) -> None:
    """Give each agent port `ray_params` leaves open (None or 0), and a listen port left at Ray's default, a port."""
    for field in AGENT_PORTS:
        value = getattr(ray_params, field, None)
        if not value or (field == "dashboard_agent_listen_port" and value == default_listen_port):
            setattr(ray_params, field, pick())


def with_listen_port(command: list[str]) -> list[str]:
    """A raylet's command line with the listen port its dashboard agent's command was given (unchanged when the
    raylet has one already or its agent's command names none)."""
    if any(arg.startswith(LISTEN_FLAG) for arg in command):
        return command
    agent = next((arg for arg in command if arg.startswith(_AGENT_COMMAND)), "")
    if not (port := _LISTEN_PORT.search(agent)):
        return command
    return [*command, f"{LISTEN_FLAG}={port.group(1)}"]


@contextlib.contextmanager
def agent_ports_given() -> Iterator[None]:
    """Inside the block, every Ray node this process starts gets its agents' ports before its raylet starts."""
    from ray._private import node, ray_constants, services

    require_version("ray", "==2.55.0", patch=_THIS_FILE)
    node_init, start_process = node.Node.__init__, services.start_ray_process

    def init(self, ray_params, *args, **kwargs):
        fill_agent_ports(ray_params, ray_constants.DEFAULT_DASHBOARD_AGENT_LISTEN_PORT)
        node_init(self, ray_params, *args, **kwargs)

    def start(command, process_type, *args, **kwargs):
        if process_type == ray_constants.PROCESS_TYPE_RAYLET:
            command = with_listen_port(list(command))
        return start_process(command, process_type, *args, **kwargs)

    with swapped(node.Node, "__init__", init, patch=_THIS_FILE), \
            swapped(services, "start_ray_process", start, patch=_THIS_FILE):
        yield
