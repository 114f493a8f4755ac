"""Helpers for the reliability tests: process probes through /proc, waiting, engines."""

import asyncio
import contextlib
import os
import subprocess
import sys
import time

import numpy as np

from vcap.policy import Bucket, Policy

__all__ = ["wait_for", "rss_bytes", "cpu_seconds", "num_fds", "num_threads", "start_sim",
           "policy_for", "stop_process", "unread_watch_streams"]

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


def wait_for(condition, timeout: float, what: str, interval: float = 0.01):
    """Poll ``condition`` until it returns something true; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def rss_bytes(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/statm") as file:
        return int(file.read().split()[1]) * _PAGE_SIZE


def cpu_seconds(pid: int | str = "self") -> float:
    """utime + stime of a process (all its threads)."""
    with open(f"/proc/{pid}/stat") as file:
        fields = file.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def num_fds(pid: int | str = "self") -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def own_threads(pid: int | str = "self") -> int:
    """Threads of ``pid`` other than grpc core's event-engine pool, which grows under load and
    gives workers back on its own schedule (a loaded machine kept them past 20 s): a thread
    per call or connection left behind shows here, the pool's size does not."""
    tasks = f"/proc/{pid}/task"
    names = []
    for task in os.listdir(tasks):
        try:
            with open(f"{tasks}/{task}/comm") as file:
                names.append(file.read().strip())
        except FileNotFoundError:   # the thread ended meanwhile
            pass
    return sum(name != "event_engine" for name in names)


def num_threads(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as file:
        for line in file:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    raise RuntimeError("no Threads line")


def start_sim(segment: str, *args: str, log=subprocess.DEVNULL) -> subprocess.Popen:
    """A simulated engine (SYNTHETIC workload) creating ``segment``; returns once it exists."""
    process = subprocess.Popen([sys.executable, "-m", "vcap.engine_hook.sim", "--segment", segment,
                                "--log-every", "0", *args], stdout=log, stderr=subprocess.STDOUT)
    path = f"/dev/shm/{segment}"
    wait_for(lambda: os.path.exists(path) or process.poll() is not None, 30, f"{path} to appear")
    if process.poll() is not None:
        raise RuntimeError(f"vcap-sim exited with {process.returncode}")
    return process


@contextlib.contextmanager
def sidecar_beside(engine: subprocess.Popen, segment: str, log_path, *args: str, log_tail: int = 2000):
    """A real ``vcap-sidecar`` on a free loopback port, yielded as ``(process, port)`` once it has
    attached to ``engine``'s segment; both processes are stopped after, and the log's tail printed."""
    import grpc

    from vcap.v1 import controller_pb2 as pb
    from vcap.v1 import controller_pb2_grpc as pb_grpc

    from ..utils import free_port

    port = free_port()
    log = open(log_path, "w")
    process = subprocess.Popen([sys.executable, "-m", "vcap.sidecar.cli", "--segment", segment,
                                "--grpc", f"127.0.0.1:{port}", "--metrics", "", *args],
                               stdout=log, stderr=subprocess.STDOUT)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.ControllerStub(channel)

            def attached():
                try:
                    return stub.GetPolicy(pb.GetPolicyRequest(), timeout=5).engine_attached
                except grpc.RpcError:
                    return False
            wait_for(attached, 60, "sidecar up and attached", interval=0.1)
        yield process, port
    finally:
        stop_process(process)
        stop_process(engine)
        log.close()
        with open(log_path) as text:
            print(text.read()[-log_tail:])


def stop_process(process: subprocess.Popen, timeout: float = 20) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=timeout)


def policy_for(generation: int, num_drafts: int = 5) -> Policy:
    """The policy written for ``generation`` in these tests: every field depends on it, so a
    record computed with another generation's policy (or a mix of two) shows."""
    i = generation
    thresholds = tuple(float(np.float32(((i * 37 + 11 * p) % 97) / 100)) for p in range(num_drafts))
    buckets = (Bucket(1, 1 + i % 2, num_drafts, thresholds),
               Bucket(2 + i % 12, 1, 1 + i % num_drafts, thresholds[::-1]))
    return Policy(mode=("conf", "fixed", "conf", "off")[i % 4], fixed_k=1 + i % num_drafts,
                  buckets=buckets, explore_period=(0, 0, 7)[i % 3])


@contextlib.asynccontextmanager
async def unread_watch_streams(target: str, num_streams: int, num_channels: int = 11):
    """``num_streams`` WatchStats streams without a token over ``num_channels`` channels. Each is
    answered before this yields ``(admitted, refused, others)``: an admitted stream's first update
    is read, a refused one raises RESOURCE_EXHAUSTED; ``others`` maps any other status to its
    count and first message. The admitted ones are then left unread until the block exits
    (cancelled, channels closed)."""
    import grpc

    from vcap.v1 import controller_pb2 as pb
    from vcap.v1 import controller_pb2_grpc as pb_grpc
    channels = [grpc.aio.insecure_channel(target) for _ in range(num_channels)]
    streams = [pb_grpc.ControllerStub(channels[i % num_channels]).WatchStats(pb.WatchStatsRequest(interval_ms=50))
               for i in range(num_streams)]
    try:
        admitted = refused = 0
        others = {}
        for stream in streams:
            try:
                await asyncio.wait_for(stream.read(), timeout=120)
                admitted += 1
            except grpc.aio.AioRpcError as error:
                if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    refused += 1
                else:
                    count, message = others.get(error.code().name, (0, error.details()))
                    others[error.code().name] = (count + 1, message)
        yield admitted, refused, others
    finally:
        for stream in streams:
            stream.cancel()
        for channel in channels:
            await channel.close()
