"""`RAY_ADDRESS` checked before ray.init: resolved the way Ray resolves it, then answered by Ray itself.

ray.init on an address where no Ray cluster runs does not fail: it logs GCS time-out warnings for minutes
(`auto` read from a stale address file, a port where another server listens). The address is resolved here
with Ray's own rule, a closed port is refused by a TCP connect, and an open one must answer the first call a
Ray driver makes (the GCS's GetClusterId; a Ray client server, `ray://`, must at least speak gRPC) within
seconds, so a wrong address ends in one line naming it.
"""

from __future__ import annotations

import socket

import grpc
from ray._common.utils import get_ray_address_file
from ray._private import services
from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

from openrlhf_tis.errors import UsageError

ADDRESS_VAR = "RAY_ADDRESS"
CONNECT_TIMEOUT_S = 10.0
# A live GCS answers GetClusterId in milliseconds, even on a loaded 2-core machine.
REPLY_TIMEOUT_S = 5.0
# How a GetClusterId call ends where no Ray GCS listens (any other reply, an auth refusal too, is Ray's).
_NOT_RAY = {grpc.StatusCode.UNAVAILABLE: "it does not speak gRPC",
            grpc.StatusCode.DEADLINE_EXCEEDED: f"no gRPC reply in {REPLY_TIMEOUT_S:.0f} s",
            grpc.StatusCode.UNIMPLEMENTED: "a gRPC server without Ray's GCS service"}


def check_ray_address(address: str) -> None:
    """Raises UsageError naming RAY_ADDRESS (and what it resolved to) unless a Ray cluster answers there."""
    resolved, source = resolve(address)
    note = f"; {ADDRESS_VAR}={address} took it from {source}" if source else ""
    client = resolved.startswith("ray://")
    host, sep, port = resolved.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():  # another form Ray accepts: left to Ray
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as err:
        raise UsageError(ADDRESS_VAR, f"no Ray cluster answers at {resolved} ({err.strerror or err}{note}); start one "
                         f"there, or unset {ADDRESS_VAR} to let the run start its own Ray") from None
    failure = _grpc_failure(f"{host}:{port}", client)
    if failure is not None:
        raise UsageError(ADDRESS_VAR, f"something listens at {resolved} but it is not a Ray "
                         f"{'client server' if client else 'cluster'} ({failure}{note}); point {ADDRESS_VAR} at a Ray "
                         f"head node, or unset it to let the run start its own Ray")


def resolve(address: str) -> tuple[str, str]:
    """The address ray.init would join, and where `auto` found it (empty when it is `address` itself)."""
    if address != "auto":
        return address, ""
    try:
        resolved = services.get_ray_address_from_environment(address, None)
    except ConnectionError:
        raise UsageError(ADDRESS_VAR, f"{address} finds no Ray cluster on this machine (no running Ray, no "
                         f"{get_ray_address_file(None)}); start one with `ray start --head`, or unset "
                         f"{ADDRESS_VAR} to let the run start its own Ray") from None
    if services.find_bootstrap_address(None) == resolved:
        return resolved, str(get_ray_address_file(None))
    return resolved, "a Ray process running on this machine"


def _grpc_failure(target: str, client: bool) -> str | None:
    """Why `target` is not a Ray GCS (or, for `client`, not a gRPC server), or None when it answers as one."""
    with grpc.insecure_channel(target) as channel:
        if client:
            try:
                grpc.channel_ready_future(channel).result(timeout=REPLY_TIMEOUT_S)
            except grpc.FutureTimeoutError:
                return f"no gRPC handshake in {REPLY_TIMEOUT_S:.0f} s"
            return None
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        try:
            stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=REPLY_TIMEOUT_S)
        except grpc.RpcError as err:
            return _NOT_RAY.get(err.code())
        return None
