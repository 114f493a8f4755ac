"""The gRPC server: ``vcap.v1.Controller`` plus the standard health and reflection services.

The servicer only converts messages; the rules live in ``policy_control.py``, the statistics
come from the ``stats`` callable it is given, and the sidecar (``app.py``) owns the health
service it registers. Domain errors map to
status codes in one place (``_status_for``), so no path answers UNKNOWN or INTERNAL.

The Controller's handlers are registered with a pass-through request deserializer and parse the
bytes themselves: grpc answers INTERNAL when a deserializer raises, and a malformed request is
the caller's fault (INVALID_ARGUMENT), not the server's.
"""

import asyncio
import functools
import logging
import time
from typing import Callable

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from vcap.policy import InvalidPolicy
from vcap.v1 import controller_pb2 as pb
from vcap.v1 import controller_pb2_grpc as pb_grpc

from .auth import AuthError, require_token
from .policy_control import PolicyControl, StaleGeneration
from .convert import CONTROL_MODE_NAMES, policy_from_proto, state_to_proto

__all__ = ["create_server", "ControllerServicer", "SERVICE_NAME", "MalformedRequest"]

log = logging.getLogger("vcap.sidecar")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Controller"].full_name
DEFAULT_WATCH_INTERVAL_MS = 1000
MIN_WATCH_INTERVAL_MS = 50


class MalformedRequest(ValueError):
    """Request bytes that do not parse as the method's request message."""


def _status_for(error: Exception) -> grpc.StatusCode:
    if isinstance(error, (InvalidPolicy, MalformedRequest)):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(error, StaleGeneration):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(error, AuthError):
        return grpc.StatusCode.UNAUTHENTICATED
    return grpc.StatusCode.INTERNAL


def _parse(request_class, raw: bytes):
    if not isinstance(raw, (bytes, bytearray)):  # already a message (a direct call in tests)
        return raw
    try:
        return request_class.FromString(raw)
    except DecodeError as error:
        raise MalformedRequest(
            f"malformed request: {len(raw)} bytes are not a {request_class.DESCRIPTOR.full_name}: {error}") from None


def _rpc(request_class, mutating: bool = False):
    """Authenticate (changes only), parse the request bytes, and turn domain errors into a
    status with the error's message."""

    def decorate(method):
        @functools.wraps(method)
        async def wrapper(self, raw, context):
            try:
                if mutating:
                    require_token(context, self.auth_token)
                return await method(self, _parse(request_class, raw), context)
            except (InvalidPolicy, StaleGeneration, AuthError, MalformedRequest) as error:
                await context.abort(_status_for(error), str(error))
        wrapper.request_class = request_class
        return wrapper
    return decorate


def _retrieve(task: asyncio.Future) -> None:
    # a write that fails because the stream went away is the end of the stream, not an error
    if not task.cancelled():
        task.exception()


def _who(context) -> str:
    """The caller for the audit log: its address, plus its certificate's name under mTLS."""
    peer = context.peer()
    try:
        names = (context.auth_context() or {}).get("x509_common_name") or []
    except Exception:  # not every transport has an auth context
        names = []
    return f"{peer} (cert CN={names[0].decode(errors='replace')})" if names else peer


class ControllerServicer(pb_grpc.ControllerServicer):
    """``vcap.v1.Controller`` over the policy control, a source of statistics and the token
    that changes need (None: none). Counts the WatchStats updates it skipped."""

    def __init__(self, control: PolicyControl, stats: Callable[[], pb.Stats], auth_token: str | None = None):
        self.control, self.stats, self.auth_token = control, stats, auth_token
        self.watch_updates_dropped = 0

    @_rpc(pb.GetPolicyRequest)
    async def GetPolicy(self, request, context):
        return state_to_proto(self.control.state())

    @_rpc(pb.SetPolicyRequest, mutating=True)
    async def SetPolicy(self, request, context):
        policy = policy_from_proto(request.policy)
        expected = request.expected_generation if request.HasField("expected_generation") else None
        state = self.control.set_policy(policy, "manual", who=_who(context),
                                                expected_generation=expected, reason=request.reason)
        return state_to_proto(state)

    @_rpc(pb.SetControlModeRequest, mutating=True)
    async def SetControlMode(self, request, context):
        if request.control_mode not in CONTROL_MODE_NAMES:
            raise InvalidPolicy(f"control_mode must be MANUAL or AUTO, got enum value {request.control_mode}")
        mode = CONTROL_MODE_NAMES[request.control_mode]
        return state_to_proto(self.control.set_control_mode(mode, who=_who(context)))

    @_rpc(pb.GetStatsRequest)
    async def GetStats(self, request, context):
        return self.stats()

    @_rpc(pb.WatchStatsRequest)
    async def WatchStats(self, request, context):
        interval_ms = request.interval_ms or DEFAULT_WATCH_INTERVAL_MS
        if interval_ms < MIN_WATCH_INTERVAL_MS:
            raise InvalidPolicy(f"interval_ms must be 0 or >= {MIN_WATCH_INTERVAL_MS}, got {interval_ms}")
        interval = interval_ms / 1000
        # One write in flight at a time: the write waits for the client (flow control), and
        # every update that falls due meanwhile is skipped and counted, never queued, so a
        # client that stops reading costs one message of memory.
        sending = None
        next_due = time.monotonic()
        try:
            while not context.done():
                if sending is None or sending.done():
                    if sending is not None and sending.exception() is not None:
                        return  # the stream is gone (the client cancelled or disconnected)
                    sending = asyncio.ensure_future(context.write(self.stats()))
                    sending.add_done_callback(_retrieve)
                else:
                    self.watch_updates_dropped += 1
                next_due += interval
                now = time.monotonic()
                if now > next_due + interval:  # this loop itself fell behind: skip, don't burst
                    missed = int((now - next_due) // interval)
                    self.watch_updates_dropped += missed
                    next_due += missed * interval
                await asyncio.sleep(max(0.0, next_due - now))
        finally:
            if sending is not None and not sending.done():
                sending.cancel()


def _add_controller(servicer: ControllerServicer, server) -> None:
    """``add_ControllerServicer_to_server`` with bytes in: the handlers parse the request."""
    responses = {"GetPolicy": pb.PolicyState, "SetPolicy": pb.PolicyState,
                 "SetControlMode": pb.PolicyState, "GetStats": pb.Stats, "WatchStats": pb.Stats}
    handlers = {}
    for name, response_class in responses.items():
        make = grpc.unary_stream_rpc_method_handler if name == "WatchStats" else grpc.unary_unary_rpc_method_handler
        handlers[name] = make(getattr(servicer, name), request_deserializer=None,
                              response_serializer=response_class.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


async def create_server(servicer: ControllerServicer, health, address: str,
                        credentials: grpc.ServerCredentials | None = None) -> tuple[grpc.aio.Server, int]:
    """Build and start the server on ``address`` with ``servicer`` and the ``health`` servicer;
    returns ``(server, bound port)``."""
    server = grpc.aio.server(maximum_concurrent_rpcs=1024)
    _add_controller(servicer, server)
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
    return server, port
