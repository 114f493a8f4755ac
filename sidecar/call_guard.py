"""Calls whose request never comes cannot hold a server's call slots.

grpc takes one of a server's ``maximum_concurrent_rpcs`` slots when a call's headers arrive and
runs a unary handler only once the request message follows. A client that sends headers and
never a message (no token needed: the token is checked in the handler) held a slot for as long
as it kept the connection, and a few thousand such calls answered every other caller, the
operator with the token and the health checks included, RESOURCE_EXHAUSTED.

:class:`CallGuard` is a server interceptor that turns every handler with a unary request into
one that reads the request itself:
- a request that does not arrive within :data:`REQUEST_TIMEOUT_S` ends the call
  (DEADLINE_EXCEEDED);
- calls waiting for their request are capped per peer host and in all (half the server's
  slots); above a cap the oldest waiting call ends (RESOURCE_EXHAUSTED), so a flood from one
  host evicts its own calls, not a caller whose message arrives with its headers.
Handlers with a request stream (reflection) get a per-peer and a total cap on open streams;
a stream above them is refused at once. The handlers themselves are unchanged.
"""

import asyncio
from collections import Counter, OrderedDict

import grpc

__all__ = ["CallGuard", "REQUEST_TIMEOUT_S", "peer_host"]

# A client sends the request right after the headers; seconds allow a slow link, not a parked call.
REQUEST_TIMEOUT_S = 5.0


def peer_host(context) -> str:
    """The caller's address without its port (``ipv4:10.0.0.7``), the unit of per-peer caps."""
    return context.peer().rsplit(":", 1)[0]


class CallGuard(grpc.aio.ServerInterceptor):
    """Bounds the calls of a server of ``max_rpcs`` slots that wait for their request, and its
    request streams (see the module's docstring)."""

    def __init__(self, max_rpcs: int, request_timeout_s: float | None = None):
        self.request_timeout_s = REQUEST_TIMEOUT_S if request_timeout_s is None else request_timeout_s
        self.max_waiting = max(max_rpcs // 2, 1)
        self.max_waiting_per_peer = max(min(64, max_rpcs // 4), 1)
        self.max_streams = max(max_rpcs // 8, 1)
        self.max_streams_per_peer = max(min(16, max_rpcs // 16), 1)
        # a waiting call's read of its request -> (peer, future set when it is evicted), oldest first
        self._waiting: OrderedDict[asyncio.Future, tuple[str, asyncio.Future]] = OrderedDict()
        self._waiting_per_peer: Counter = Counter()
        self._streams: Counter = Counter()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        if handler.request_streaming:
            return self._capped_stream(handler)
        return self._reading_request(handler)

    # -- unary requests ------------------------------------------------------------------------

    def _reading_request(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        deserialize = handler.request_deserializer
        read = self._read_request

        if handler.unary_unary is not None:
            behaviour = handler.unary_unary

            async def unary_response(requests, context):
                return await behaviour(await read(requests, context, deserialize), context)
            return grpc.stream_unary_rpc_method_handler(
                unary_response, response_serializer=handler.response_serializer)

        behaviour = handler.unary_stream

        async def streamed_response(requests, context):
            responses = behaviour(await read(requests, context, deserialize), context)
            if hasattr(responses, "__aiter__"):
                async for response in responses:
                    yield response
            else:   # a handler that writes with context.write and returns
                await responses
        return grpc.stream_stream_rpc_method_handler(
            streamed_response, response_serializer=handler.response_serializer)

    async def _read_request(self, requests, context, deserialize):
        peer = peer_host(context)
        arrival = asyncio.ensure_future(requests.__anext__())
        evicted = asyncio.get_running_loop().create_future()
        self._waiting[arrival] = (peer, evicted)
        self._waiting_per_peer[peer] += 1
        if self._waiting_per_peer[peer] > self.max_waiting_per_peer:
            self._evict(next(f for f, (p, _) in self._waiting.items() if p == peer))
        if len(self._waiting) > self.max_waiting:
            self._evict(next(iter(self._waiting)))
        try:
            await asyncio.wait((arrival, evicted), timeout=self.request_timeout_s,
                               return_when=asyncio.FIRST_COMPLETED)
            if evicted.done():
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"too many calls from {peer} waiting for their request message; retry")
            if not arrival.done():
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"no request message within {self.request_timeout_s:g} s of the call's headers")
            if isinstance(arrival.exception(), StopAsyncIteration):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the call ended without its request message")
            raw = arrival.result()
        finally:
            arrival.cancel()   # a no-op once it is done
            self._forget(arrival)
        if deserialize is None:
            return raw
        try:
            return deserialize(raw)
        except Exception as error:   # grpc would answer UNKNOWN: the request is the caller's fault
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {error}")

    def _evict(self, arrival: asyncio.Future) -> None:
        # no longer counted from now on (its call ends on the loop's next turn): an arrival
        # before then must evict another
        _, evicted = self._forget(arrival)
        evicted.set_result(None)

    def _forget(self, arrival: asyncio.Future):
        entry = self._waiting.pop(arrival, None)
        if entry is not None:
            peer = entry[0]
            self._waiting_per_peer[peer] -= 1
            if not self._waiting_per_peer[peer]:
                del self._waiting_per_peer[peer]
        return entry

    # -- request streams -----------------------------------------------------------------------

    def _capped_stream(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        if handler.stream_stream is None:
            return handler   # no stream-unary method is served
        streams, guard, behaviour = self._streams, self, handler.stream_stream

        async def capped(requests, context):
            peer = peer_host(context)
            if streams[peer] >= guard.max_streams_per_peer or sum(streams.values()) >= guard.max_streams:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"too many request streams open from {peer} or in all; retry")
            streams[peer] += 1
            try:
                async for response in behaviour(requests, context):
                    yield response
            finally:
                streams[peer] -= 1
                if not streams[peer]:
                    del streams[peer]

        return grpc.stream_stream_rpc_method_handler(
            capped, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)
