"""Issue 7.5: load on a sidecar process (``vcap-sidecar`` next to a simulated engine, SYNTHETIC
workload). 100 concurrent clients poll GetStats and hold WatchStats streams while another client
sets policies: SetPolicy's p99 stays bounded, and the server has no more threads or open files
afterwards than before. A client that never reads its WatchStats stream costs the server no
memory: updates are skipped and counted (``watch_updates_dropped``), RSS stays flat."""

import asyncio
import os
import socket
import struct
import threading
import time

import grpc
import numpy as np
import pytest

from vcap.v1 import controller_pb2 as pb
from vcap.v1 import controller_pb2_grpc as pb_grpc

from ._helpers import num_fds, own_threads, rss_bytes, sidecar_beside, start_sim, wait_for

NUM_CLIENTS = 100
NUM_SETS = 200
P99_BOUND_S = 0.5  # generous: a loaded 2-core CI machine; typical is a few ms
SIM_ARGS = ("--max-bs", "64", "--mean-bs", "32", "--layers", "8", "--time-scale", "0.5")


@pytest.fixture
def sidecar_process(segment_name, tmp_path):
    engine = start_sim(segment_name, *SIM_ARGS)
    with sidecar_beside(engine, segment_name, tmp_path / "sidecar.log", "--log-level", "WARNING") as started:
        yield started


async def _client(target, stop, counts):
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.ControllerStub(channel)
        stream = stub.WatchStats(pb.WatchStatsRequest(interval_ms=200))

        async def watch():
            async for _ in stream:
                counts["watch"] += 1
        watcher = asyncio.ensure_future(watch())
        while not stop.is_set():
            await stub.GetStats(pb.GetStatsRequest(), timeout=30)
            counts["get"] += 1
            await asyncio.sleep(0.05)
        stream.cancel()
        await asyncio.gather(watcher, return_exceptions=True)


async def _load(target):
    stop, counts = asyncio.Event(), {"get": 0, "watch": 0}
    clients = [asyncio.ensure_future(_client(target, stop, counts)) for _ in range(NUM_CLIENTS)]
    await asyncio.sleep(1.0)  # every client connected and streaming
    latencies = []
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.ControllerStub(channel)
        for i in range(NUM_SETS):
            request = pb.SetPolicyRequest(policy=pb.Policy(mode=pb.MODE_FIXED, fixed_k=1 + i % 5))
            started = time.perf_counter()
            await stub.SetPolicy(request, timeout=30)
            latencies.append(time.perf_counter() - started)
            await asyncio.sleep(0.01)
    stop.set()
    await asyncio.gather(*clients)
    return np.array(latencies), counts


def test_many_clients_bounded_set_latency_no_leaks(sidecar_process):
    process, port = sidecar_process
    target = f"127.0.0.1:{port}"
    asyncio.run(_warm_up(target))
    time.sleep(1.0)
    fds_before, threads_before = num_fds(process.pid), own_threads(process.pid)
    client_fds, client_threads = num_fds(), threading.active_count()
    latencies, counts = asyncio.run(_load(target))
    p50, p99 = np.percentile(latencies, [50, 99])
    # the server lets go of every connection, stream and thread of its own
    wait_for(lambda: num_fds(process.pid) <= fds_before and own_threads(process.pid) <= threads_before,
             20, f"server fds/threads back to {fds_before}/{threads_before}", interval=0.2)
    fds_after, threads_after = num_fds(process.pid), own_threads(process.pid)
    time.sleep(0.5)
    assert num_fds() <= client_fds + 2 and threading.active_count() <= client_threads
    print(f"\nload: {NUM_CLIENTS} clients, {counts['get']} GetStats, {counts['watch']} WatchStats updates, "
          f"{NUM_SETS} SetPolicy: p50 {p50 * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms, max {latencies.max() * 1000:.1f} ms; "
          f"server fds {fds_before}->{fds_after}, threads {threads_before}->{threads_after}")
    assert p99 < P99_BOUND_S, f"SetPolicy p99 {p99:.3f}s"
    assert counts["get"] > NUM_CLIENTS and counts["watch"] > NUM_CLIENTS


async def _warm_up(target):
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.ControllerStub(channel)
        await stub.GetStats(pb.GetStatsRequest(), timeout=30)
        stream = stub.WatchStats(pb.WatchStatsRequest(interval_ms=50))
        await stream.read()
        stream.cancel()


NUM_SLOW = 20
SLOW_S = float(os.environ.get("VCAP_SLOW_READER_S", "8"))


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


def _literal(name: str, value: str) -> bytes:  # HPACK: literal header field, new name, no indexing
    return b"\x00" + bytes([len(name)]) + name.encode() + bytes([len(value)]) + value.encode()


def _never_reading_watch(port: int, interval_ms: int) -> socket.socket:
    """A WatchStats call over raw HTTP/2 that announces a receive window of 0 and never reads
    a message: the server can send nothing, as with a client that stopped reading."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    headers = b"".join(_literal(n, v) for n, v in [
        (":method", "POST"), (":scheme", "http"), (":path", "/vcap.v1.Controller/WatchStats"),
        (":authority", f"127.0.0.1:{port}"), ("content-type", "application/grpc"), ("te", "trailers")])
    message = pb.WatchStatsRequest(interval_ms=interval_ms).SerializeToString()
    sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
                 + _frame(4, 0, 0, struct.pack(">HI", 4, 0))             # SETTINGS: window 0
                 + _frame(1, 4, 1, headers)                              # HEADERS, END_HEADERS
                 + _frame(0, 1, 1, b"\x00" + struct.pack(">I", len(message)) + message))  # DATA, END_STREAM
    received = b""
    while True:  # acknowledge the server's SETTINGS (else it drops the connection), then stop reading
        received += sock.recv(65536)
        while len(received) >= 9:
            length, kind, flags = int.from_bytes(received[:3], "big"), received[3], received[4]
            if kind == 4 and not flags & 1:
                sock.sendall(_frame(4, 1, 0))
                return sock
            received = received[9 + length:]


def test_slow_watchers_do_not_grow_server_memory(sidecar_process):
    process, port = sidecar_process
    with grpc.insecure_channel(f"127.0.0.1:{port}") as reader:
        stub = pb_grpc.ControllerStub(reader)
        dropped_before = stub.GetStats(pb.GetStatsRequest(), timeout=10).watch_updates_dropped
        sockets = [_never_reading_watch(port, 50) for _ in range(NUM_SLOW)]
        try:
            time.sleep(1.0)
            rss = []
            for _ in range(int(SLOW_S * 4)):
                rss.append(rss_bytes(process.pid))
                time.sleep(0.25)
            rss.append(rss_bytes(process.pid))
            dropped_after = stub.GetStats(pb.GetStatsRequest(), timeout=10).watch_updates_dropped
            # the server still answers everyone else
            assert stub.GetPolicy(pb.GetPolicyRequest(), timeout=10).engine_attached
        finally:
            for sock in sockets:
                sock.close()
    # A leak raises the floor; the engine link's and controller's batches come and go (peaks
    # of tens of MiB, returned at once): compare the troughs of the two halves.
    half = len(rss) // 2
    growth_mb = (min(rss[half:]) - min(rss[:half])) / 2**20
    expected = NUM_SLOW * SLOW_S * 20  # updates due at 50 ms
    print(f"\nslow watchers: {NUM_SLOW} streams unread for {SLOW_S:.0f}s: server RSS "
          f"{rss[0] / 2**20:.1f} -> {rss[-1] / 2**20:.1f} MiB (growth {growth_mb:.2f} MiB, peak {max(rss) / 2**20:.1f}), "
          f"watch_updates_dropped +{dropped_after - dropped_before} of ~{expected:.0f} due; "
          f"samples {[round(r / 2**20, 1) for r in rss[::4]]}")
    assert dropped_after - dropped_before > expected / 2
    assert growth_mb < 8, f"server RSS grew {growth_mb:.1f} MiB under unread streams"
    # and the server lets go of the dead streams' connections
    wait_for(lambda: num_fds(process.pid) < 15 + NUM_SLOW // 2, 20, "server fds released", interval=0.2)
