"""The gRPC server: ``vcap.v1.Controller`` plus the standard health and reflection services.

The servicer only converts messages; the rules live in ``control.py``. Domain errors map to
status codes in one place (``_status_for``), so no path answers UNKNOWN.
"""

import asyncio
import functools
import logging
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from vcap.policy import InvalidPolicy
from vcap.v1 import controller_pb2 as pb
from vcap.v1 import controller_pb2_grpc as pb_grpc

from .auth import AuthError, require_token
from .control import StaleGeneration
from .convert import CONTROL_MODE_NAMES, policy_from_proto, state_to_proto

__all__ = ["create_server", "ControllerServicer", "SERVICE_NAME"]

log = logging.getLogger("vcap.sidecar")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Controller"].full_name
DEFAULT_WATCH_INTERVAL_MS = 1000
MIN_WATCH_INTERVAL_MS = 50


def _status_for(error: Exception) -> grpc.StatusCode:
    if isinstance(error, InvalidPolicy):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(error, StaleGeneration):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(error, AuthError):
        return grpc.StatusCode.UNAUTHENTICATED
    return grpc.StatusCode.INTERNAL


def _rpc(method):
    """Turn domain errors into a status with the error's message."""

    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            return await method(self, request, context)
        except (InvalidPolicy, StaleGeneration, AuthError) as error:
            await context.abort(_status_for(error), str(error))
    return wrapper


class ControllerServicer(pb_grpc.ControllerServicer):
    def __init__(self, sidecar, auth_token: str | None = None):
        self.sidecar, self.auth_token = sidecar, auth_token

    @_rpc
    async def GetPolicy(self, request, context):
        return state_to_proto(self.sidecar.control.state())

    @_rpc
    async def SetPolicy(self, request, context):
        require_token(context, self.auth_token)
        policy = policy_from_proto(request.policy)
        expected = request.expected_generation if request.HasField("expected_generation") else None
        state = self.sidecar.control.set_policy(policy, "manual", who=context.peer(),
                                                expected_generation=expected, reason=request.reason)
        return state_to_proto(state)

    @_rpc
    async def SetControlMode(self, request, context):
        require_token(context, self.auth_token)
        if request.control_mode not in CONTROL_MODE_NAMES:
            raise InvalidPolicy(f"control_mode must be MANUAL or AUTO, got enum value {request.control_mode}")
        mode = CONTROL_MODE_NAMES[request.control_mode]
        if mode == "auto" and self.sidecar.controller is None:
            raise StaleGeneration("automatic control is not available in this sidecar")
        return state_to_proto(self.sidecar.control.set_control_mode(mode))

    @_rpc
    async def GetStats(self, request, context):
        return self.sidecar.stats()

    async def WatchStats(self, request, context):
        interval_ms = request.interval_ms or DEFAULT_WATCH_INTERVAL_MS
        if interval_ms < MIN_WATCH_INTERVAL_MS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"interval_ms must be 0 or >= {MIN_WATCH_INTERVAL_MS}, got {interval_ms}")
        interval = interval_ms / 1000
        next_due = time.monotonic()
        while True:
            # The write waits for the client (flow control): a slow reader holds one message,
            # and the updates it missed are counted, not queued.
            await context.write(self.sidecar.stats())
            next_due += interval
            now = time.monotonic()
            if now > next_due + interval:
                missed = int((now - next_due) // interval)
                self.sidecar.watch_updates_dropped += missed
                next_due += missed * interval
            await asyncio.sleep(max(0.0, next_due - now))


async def create_server(sidecar, address: str, credentials: grpc.ServerCredentials | None = None,
                        auth_token: str | None = None) -> tuple[grpc.aio.Server, int]:
    """Build and start the server on ``address``; returns ``(server, bound port)``."""
    server = grpc.aio.server(maximum_concurrent_rpcs=1024)
    pb_grpc.add_ControllerServicer_to_server(ControllerServicer(sidecar, auth_token), server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME), server)
    if address.startswith("unix:"):
        port = server.add_insecure_port(address)
    elif credentials is not None:
        port = server.add_secure_port(address, credentials)
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind gRPC to {address}")
    await server.start()
    sidecar.health = health
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    await health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    return server, port
