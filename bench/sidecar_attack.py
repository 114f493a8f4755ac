"""Figures for issue 16's two high items, against a real vcap-sidecar process next to a simulated
engine (SYNTHETIC workload), over loopback:

1. memory: RSS of the sidecar before, at the peak of, and after 5 rounds of 64 concurrent 4 MB
   GetPolicy and GetStats bodies (no token) and one SetPolicy with 999k thresholds;
2. lockout: SetPolicy (with the token) and Health.Check latency, first with nothing else open,
   then with 1,100 unread WatchStats streams attempted (the caps admit 128 from one address).

    python bench/sidecar_attack.py [--calls 200]
"""

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from vcap.v1 import controller_pb2 as pb
from vcap.v1 import controller_pb2_grpc as pb_grpc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.reliability._helpers import unread_watch_streams  # noqa: E402  (the same flood the test opens)

TOKEN = "bench-attack-token-0123456789abcdef"
GOOD = (("authorization", f"Bearer {TOKEN}"),)


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as file:
        return int(file.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


async def _big(target: str, method: str) -> None:
    async with grpc.aio.insecure_channel(target) as channel:
        call = channel.unary_unary(f"/vcap.v1.Controller/{method}")
        body = b"\x0a" + b"\xff" * ((4 << 20) - 1)

        async def one():
            try:
                await call(body, timeout=60)
            except grpc.aio.AioRpcError:
                pass
        await asyncio.gather(*(one() for _ in range(64)))


async def _latencies(target: str, calls: int) -> dict:
    async with grpc.aio.insecure_channel(target) as channel:
        stub, health = pb_grpc.ControllerStub(channel), health_pb2_grpc.HealthStub(channel)
        out = {"SetPolicy": [], "Health.Check": []}
        for i in range(calls):
            began = time.perf_counter()
            await stub.SetPolicy(pb.SetPolicyRequest(policy=pb.Policy(mode=pb.MODE_FIXED, fixed_k=1 + i % 5)),
                                 metadata=GOOD, timeout=30)
            out["SetPolicy"].append(time.perf_counter() - began)
            began = time.perf_counter()
            await health.Check(health_pb2.HealthCheckRequest(), timeout=30)
            out["Health.Check"].append(time.perf_counter() - began)
        return out


async def _with_watchers(target: str, calls: int, num_streams: int) -> tuple[dict, int]:
    async with unread_watch_streams(target, num_streams) as (admitted, _, _):
        return await _latencies(target, calls), admitted


def _summary(samples: list[float]) -> str:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return f"p50 {statistics.median(ordered) * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms, max {ordered[-1] * 1e3:.1f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    segment = f"vcap-bench-{uuid.uuid4().hex[:8]}"
    port = 50000 + os.getpid() % 10000
    target = f"127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as directory:
        token = os.path.join(directory, "token")
        with open(token, "w") as file:
            file.write(TOKEN)
        os.chmod(token, 0o600)
        engine = subprocess.Popen([sys.executable, "-m", "vcap.engine_hook.sim", "--segment", segment, "--log-every", "0",
                                   "--max-bs", "32", "--layers", "4"], stdout=subprocess.DEVNULL)
        sidecar = subprocess.Popen([sys.executable, "-m", "vcap.sidecar.cli", "--segment", segment, "--grpc", target,
                                    "--metrics", "", "--auth-token-file", token, "--log-level", "WARNING"])
        try:
            with grpc.insecure_channel(target) as channel:
                grpc.channel_ready_future(channel).result(timeout=60)
            time.sleep(2)
            before = peak = _rss_mib(sidecar.pid)
            for _ in range(5):
                for method in ("GetPolicy", "GetStats"):
                    asyncio.run(_big(target, method))
                    peak = max(peak, _rss_mib(sidecar.pid))
            with grpc.insecure_channel(target) as channel:
                try:
                    pb_grpc.ControllerStub(channel).SetPolicy(pb.SetPolicyRequest(policy=pb.Policy(
                        mode=pb.MODE_CONF, buckets=[pb.Bucket(min_bs=1, thresholds=[0.5] * 999_000)])), timeout=60)
                except grpc.RpcError:
                    pass
            peak = max(peak, _rss_mib(sidecar.pid))
            time.sleep(2)
            print(f"memory attack (5 x 64 x 4 MB GetPolicy + GetStats, 999k thresholds): RSS {before:.1f} MiB "
                  f"before, peak {peak:.1f} MiB, {_rss_mib(sidecar.pid):.1f} MiB after; alive: {sidecar.poll() is None}")
            quiet = asyncio.run(_latencies(target, args.calls))
            attacked, admitted = asyncio.run(_with_watchers(target, args.calls, 1100))
            for name in quiet:
                print(f"{name}: idle {_summary(quiet[name])}; with 1,100 unread WatchStats attempted "
                      f"({admitted} admitted): {_summary(attacked[name])}")
        finally:
            for process in (sidecar, engine):
                process.terminate()
                process.wait(timeout=20)


if __name__ == "__main__":
    main()
