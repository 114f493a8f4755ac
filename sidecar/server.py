"""The gRPC server: ``vcap.v1.Controller`` plus the standard health and reflection services.

The servicer only converts messages; the rules live in ``policy_control.py``, the statistics
come from the ``stats`` callable it is given, and the sidecar (``app.py``) owns the health
service it registers. Domain errors map to
status codes in one place (``_status_for``), so no path answers UNKNOWN or INTERNAL.

The Controller's handlers are registered with a pass-through request deserializer and parse the
bytes themselves: grpc answers INTERNAL when a deserializer raises, and a malformed request is
the caller's fault (INVALID_ARGUMENT), not the server's.

Bounds (docs/RELIABILITY.md, issue 16): the server receives at most :data:`MAX_REQUEST_BYTES`
per message (computed from the largest valid request); each method has its own cap on calls
in progress (:data:`MAX_CONCURRENT_CALLS`), and WatchStats streams a global and a per-peer cap,
so no method can take the slots of another; calls whose request message does not come are
ended and capped (``call_guard.py``), so they cannot take the server's slots either;
SO_REUSEPORT is off, so a second server on a taken port fails instead of sharing it.
"""

import asyncio
import functools
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from vcap.policy import MAX_BATCH_SIZE, InvalidPolicy
from vcap.segment import MAX_BUCKETS, MAX_STRIDE, SegmentError
from vcap.v1 import controller_pb2 as pb
from vcap.v1 import controller_pb2_grpc as pb_grpc

from .auth import AuthError, require_token
from .call_guard import CallGuard, peer_host
from .convert import CONTROL_MODE_NAMES, history_to_proto, policy_from_proto, state_to_proto
from .history import UnknownGeneration
from .policy_control import PolicyControl, StaleGeneration

__all__ = ["create_server", "create_health_server", "ControllerServicer", "SERVICE_NAME", "MalformedRequest",
           "MAX_REQUEST_BYTES", "MAX_REASON_CHARS", "MAX_CONCURRENT_CALLS", "WatchLimits"]

log = logging.getLogger("vcap.sidecar")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Controller"].full_name
DEFAULT_WATCH_INTERVAL_MS = 1000
MIN_WATCH_INTERVAL_MS = 50
MAX_REASON_CHARS = 1024
# Calls of one method in progress at once; more are answered RESOURCE_EXHAUSTED at once.
MAX_CONCURRENT_CALLS = {"GetPolicy": 64, "GetStats": 64, "SetPolicy": 16, "SetControlMode": 16,
                        "ListPolicyHistory": 16, "Rollback": 16}
# Every call in progress on the server (grpc's own cap): above the per-method caps together
# (192 unary + 256 watch streams); calls waiting for their request hold at most half of it
# (CallGuard).
MAX_SERVER_RPCS = 2048


def _max_request_bytes() -> int:
    """The largest valid request: SetPolicy with a policy of the largest geometry a segment may
    have (MAX_BUCKETS buckets of MAX_STRIDE - 1 thresholds, every varint at its widest) and the
    longest reason (4 UTF-8 bytes a character); rounded up to a KiB."""
    drafts = MAX_STRIDE - 1
    bucket = pb.Bucket(min_bs=MAX_BATCH_SIZE, k_min=drafts, k_max=drafts, thresholds=[0.5] * drafts)
    policy = pb.Policy(mode=pb.MODE_CONF, fixed_k=drafts, explore_period=1_000_000, buckets=[bucket] * MAX_BUCKETS)
    request = pb.SetPolicyRequest(policy=policy, expected_generation=2**64 - 1, reason="\U0001F600" * MAX_REASON_CHARS)
    return (request.ByteSize() + 1023) // 1024 * 1024


MAX_REQUEST_BYTES = _max_request_bytes()


@dataclass(frozen=True, slots=True)
class WatchLimits:
    """WatchStats streams open at once, over all clients and per peer address."""

    max_streams: int = 256
    max_streams_per_peer: int = 128

    def __post_init__(self):
        if not 1 <= self.max_streams_per_peer <= self.max_streams <= 100_000:
            raise ValueError("need 1 <= max watch streams per peer <= max watch streams <= 100000")


class MalformedRequest(ValueError):
    """Request bytes that do not parse as the method's request message."""


class Busy(Exception):
    """Too many calls of one method (or watch streams of one peer) in progress."""


def _status_for(error: Exception) -> grpc.StatusCode:
    if isinstance(error, (InvalidPolicy, MalformedRequest)):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(error, StaleGeneration):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(error, UnknownGeneration):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(error, AuthError):
        return grpc.StatusCode.UNAUTHENTICATED
    if isinstance(error, Busy):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(error, SegmentError):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


def _parse(request_class, raw: bytes):
    if not isinstance(raw, (bytes, bytearray)):  # already a message (a direct call in tests)
        return raw
    try:
        return request_class.FromString(raw)
    except DecodeError as error:
        raise MalformedRequest(
            f"malformed request: {len(raw)} bytes are not a {request_class.DESCRIPTOR.full_name}: {error}") from None


_DOMAIN_ERRORS = (InvalidPolicy, StaleGeneration, AuthError, MalformedRequest, Busy, SegmentError, UnknownGeneration)


def _rpc(request_class, mutating: bool = False, reports_rejections: bool = False):
    """Authenticate (changes always; reads too when the token guards reads), bound the calls in
    progress, parse the request bytes, and turn domain errors into a status with the error's
    message. With ``reports_rejections``, an invalid request of an authenticated caller is kept
    as the control's last rejection."""

    def decorate(method):
        name = method.__name__

        @functools.wraps(method)
        async def wrapper(self, raw, context):
            held = False
            try:
                if mutating or self.token_guards_reads:
                    require_token(context, self.auth_token)
                if self.calls[name] >= MAX_CONCURRENT_CALLS.get(name, 1 << 30):
                    raise Busy(f"{MAX_CONCURRENT_CALLS[name]} {name} calls already in progress; retry")
                self.calls[name] += 1
                held = True
                return await method(self, _parse(request_class, raw), context)
            except _DOMAIN_ERRORS as error:
                if reports_rejections and isinstance(error, (InvalidPolicy, MalformedRequest)):
                    self.control.reject("manual", _who(context), f"{name}: {error}")
                await context.abort(_status_for(error), str(error))
            finally:
                if held:
                    self.calls[name] -= 1
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
    # the audit log escapes and bounds it (policy_control.audit_text): a CN is the caller's text
    return f"{peer} (cert CN={names[0].decode(errors='replace')})" if names else peer


class ControllerServicer(pb_grpc.ControllerServicer):
    """``vcap.v1.Controller`` over the policy control, a source of statistics and the token
    that changes need (None: none). Counts the WatchStats updates it skipped."""

    def __init__(self, control: PolicyControl, stats: Callable[[], pb.Stats], auth_token: str | None = None,
                 token_guards_reads: bool = False, watch_limits: WatchLimits | None = None):
        self.control, self.stats, self.auth_token = control, stats, auth_token
        # beyond loopback a token guards every method (reads disclose the segment, the engine's
        # pid, the policy and the statistics); health is another service and stays open
        self.token_guards_reads = token_guards_reads and auth_token is not None
        self.watch_limits = watch_limits or WatchLimits()
        self.watch_updates_dropped = 0
        self.watch_streams_refused = 0
        self.calls = Counter()          # method -> calls in progress
        self.watch_by_peer = Counter()  # peer host -> WatchStats streams open
        self._cached = (0.0, None)

    def _shared_stats(self) -> pb.Stats:
        """The statistics for watchers, computed at most every MIN_WATCH_INTERVAL_MS / 2 however
        many streams are open (each sends the same message)."""
        now = time.monotonic()
        at, message = self._cached
        if message is None or now - at >= MIN_WATCH_INTERVAL_MS / 2000:
            message = self.stats()
            self._cached = (now, message)
        return message

    @property
    def watch_streams(self) -> int:
        return self.calls["WatchStats"]

    @_rpc(pb.GetPolicyRequest)
    async def GetPolicy(self, request, context):
        return state_to_proto(self.control.state())

    @_rpc(pb.SetPolicyRequest, mutating=True, reports_rejections=True)
    async def SetPolicy(self, request, context):
        if len(request.reason) > MAX_REASON_CHARS:
            raise InvalidPolicy(f"reason must be at most {MAX_REASON_CHARS} characters, got {len(request.reason)}")
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

    @_rpc(pb.ListPolicyHistoryRequest)
    async def ListPolicyHistory(self, request, context):
        history = self.control.history
        with self.control.lock:
            entries = history.newest(request.limit)
        return history_to_proto(entries, history.max_entries, history.path)

    @_rpc(pb.RollbackRequest, mutating=True, reports_rejections=True)
    async def Rollback(self, request, context):
        if len(request.reason) > MAX_REASON_CHARS:
            raise InvalidPolicy(f"reason must be at most {MAX_REASON_CHARS} characters, got {len(request.reason)}")
        expected = request.expected_generation if request.HasField("expected_generation") else None
        return state_to_proto(self.control.rollback(request.generation, who=_who(context),
                                                    expected_generation=expected, reason=request.reason))

    @_rpc(pb.WatchStatsRequest)
    async def WatchStats(self, request, context):
        interval_ms = request.interval_ms or DEFAULT_WATCH_INTERVAL_MS
        if interval_ms < MIN_WATCH_INTERVAL_MS:
            raise InvalidPolicy(f"interval_ms must be 0 or >= {MIN_WATCH_INTERVAL_MS}, got {interval_ms}")
        limits, peer = self.watch_limits, peer_host(context)
        # self.calls["WatchStats"] counts this stream already
        if self.calls["WatchStats"] > limits.max_streams:
            self.watch_streams_refused += 1
            raise Busy(f"{limits.max_streams} WatchStats streams already open (the server's limit); retry later")
        if self.watch_by_peer[peer] >= limits.max_streams_per_peer:
            self.watch_streams_refused += 1
            raise Busy(f"{limits.max_streams_per_peer} WatchStats streams already open from {peer} "
                       "(the per-client limit); close one first")
        self.watch_by_peer[peer] += 1
        try:
            await self._watch(interval_ms / 1000, context)
        finally:
            self.watch_by_peer[peer] -= 1
            if not self.watch_by_peer[peer]:
                del self.watch_by_peer[peer]

    async def _watch(self, interval: float, context) -> None:
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
                    sending = asyncio.ensure_future(context.write(self._shared_stats()))
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
                 "SetControlMode": pb.PolicyState, "GetStats": pb.Stats, "WatchStats": pb.Stats,
                 "ListPolicyHistory": pb.PolicyHistory, "Rollback": pb.PolicyState}
    handlers = {}
    for name, response_class in responses.items():
        make = grpc.unary_stream_rpc_method_handler if name == "WatchStats" else grpc.unary_unary_rpc_method_handler
        handlers[name] = make(getattr(servicer, name), request_deserializer=None,
                              response_serializer=response_class.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


# Options of every server: no SO_REUSEPORT (a second sidecar on a taken port must fail, not
# share it), messages no larger than the largest valid request, and no BDP probing: with it,
# grpc opens a stream's receive window to whatever the peer announces and buffers an oversized
# message before refusing it (64 x 4 MB bodies took +100 MiB); without it a stream gets the
# 64 KiB default window, which the requests of this API never need more than.
SERVER_OPTIONS = (("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
                  ("grpc.max_send_message_length", 4 << 20), ("grpc.http2.bdp_probe", 0))


def _bind(server: grpc.aio.Server, address: str, credentials, flag: str) -> int:
    try:
        if credentials is not None and not address.startswith("unix:"):
            port = server.add_secure_port(address, credentials)
        else:
            port = server.add_insecure_port(address)
    except RuntimeError:  # grpc raises RuntimeError("Failed to bind to address ...")
        port = 0
    if port == 0:
        raise OSError(f"{flag} {address}: cannot listen there (address in use by another process, "
                      "or not an address of this machine)")
    return port


async def create_server(servicer: ControllerServicer, health, address: str,
                        credentials: grpc.ServerCredentials | None = None) -> tuple[grpc.aio.Server, int]:
    """Build and start the server on ``address`` with ``servicer`` and the ``health`` servicer;
    returns ``(server, bound port)``.

    Raises:
        OSError: the address cannot be bound (one line naming it).
    """
    server = grpc.aio.server(maximum_concurrent_rpcs=MAX_SERVER_RPCS, options=SERVER_OPTIONS,
                             interceptors=(CallGuard(MAX_SERVER_RPCS),))
    _add_controller(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME), server)
    port = _bind(server, address, credentials, "--grpc")
    await server.start()
    return server, port


async def create_health_server(health, address: str) -> tuple[grpc.aio.Server, int]:
    """A plaintext server with the health service only (``--health``): what the kubelet's gRPC
    probes can reach (they speak neither TLS nor tokens), with its own call slots, so nothing
    on the Controller's server can starve it."""
    server = grpc.aio.server(maximum_concurrent_rpcs=64, options=SERVER_OPTIONS, interceptors=(CallGuard(64),))
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = _bind(server, address, None, "--health")
    await server.start()
    return server, port
