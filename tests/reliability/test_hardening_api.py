"""Issue 16, the API side: what an attacker without a token did to the sidecar over gRPC and
HTTP (memory exhaustion, lockout through WatchStats, a second sidecar on the port, unbounded
/metrics connections, audit injection). Each test drives a real sidecar over loopback; bounds
are generous (a busy 2-core machine), figures are in docs/RELIABILITY.md (bench/sidecar_attack.py)."""

import asyncio
import logging
import socket
import subprocess
import sys
import time
from collections import Counter

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from vcap.policy import Bucket, Policy
from vcap.segment import Segment, SegmentConfig
from vcap.sidecar import call_guard
from vcap.sidecar.app import Sidecar, SidecarConfig
from vcap.sidecar.convert import policy_to_proto
from vcap.sidecar.logs import RateLimit
from vcap.sidecar.metrics_http import MAX_CONNECTIONS
from vcap.sidecar.server import MAX_REQUEST_BYTES
from vcap.v1 import controller_pb2 as pb
from vcap.v1 import controller_pb2_grpc as pb_grpc

from ._helpers import num_threads, rss_bytes, sidecar_beside, start_sim, unread_watch_streams, wait_for

TOKEN = "attack-test-token-0123456789abcdef"
GOOD = (("authorization", f"Bearer {TOKEN}"),)
RSS_BOUND_MIB = 150
CONFIG = SegmentConfig(stride=6, max_bs=16, num_moe_layers=2, ring_slots=8)


@pytest.fixture
def sidecar_process(segment_name, tmp_path):
    """A real vcap-sidecar (loopback, token for changes) next to a simulated engine."""
    engine = start_sim(segment_name, "--max-bs", "32", "--layers", "4", "--time-scale", "1")
    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    with sidecar_beside(engine, segment_name, tmp_path / "sidecar.log", "--auth-token-file", str(token),
                        log_tail=3000) as started:
        yield started


def _serving(target: str) -> bool:
    with grpc.insecure_channel(target) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


async def _big_requests(target: str, method: str, size: int, count: int) -> list:
    async with grpc.aio.insecure_channel(target) as channel:
        call = channel.unary_unary(f"/vcap.v1.Controller/{method}")
        body = b"\x0a" + b"\xff" * (size - 1)

        async def one():
            try:
                await call(body, timeout=60)
                return grpc.StatusCode.OK
            except grpc.aio.AioRpcError as error:
                return error.code()
        return await asyncio.gather(*(one() for _ in range(count)))


def test_large_requests_refused_and_rss_bounded(sidecar_process):
    """16.1: 5 rounds of 64 concurrent 4 MB GetPolicy and GetStats bodies, and a SetPolicy with
    999k thresholds, without a token: each refused, RSS under the bound, the sidecar alive."""
    process, port = sidecar_process
    target = f"127.0.0.1:{port}"
    assert 16 * 1024 < MAX_REQUEST_BYTES < 128 * 1024  # the largest valid request, computed
    before = rss_bytes(process.pid)
    peak = before
    for _ in range(5):
        for method in ("GetPolicy", "GetStats"):
            codes = asyncio.run(_big_requests(target, method, 4 << 20, 64))
            assert set(codes) == {grpc.StatusCode.RESOURCE_EXHAUSTED}, set(codes)
            peak = max(peak, rss_bytes(process.pid))
    huge = pb.SetPolicyRequest(policy=pb.Policy(mode=pb.MODE_CONF, buckets=[pb.Bucket(
        min_bs=1, thresholds=[0.5] * 999_000)]))
    with grpc.insecure_channel(target) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            pb_grpc.ControllerStub(channel).SetPolicy(huge, timeout=60)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # the largest valid request still arrives (and is judged on its content)
        drafts = 254
        largest = pb.SetPolicyRequest(reason="\U0001F600" * 1024, policy=pb.Policy(
            mode=pb.MODE_CONF, fixed_k=drafts, buckets=[pb.Bucket(min_bs=65536, k_min=drafts, k_max=drafts,
                                                                  thresholds=[0.5] * drafts)] * 64))
        assert largest.ByteSize() > 64 * 1024
        with pytest.raises(grpc.RpcError) as caught:
            pb_grpc.ControllerStub(channel).SetPolicy(largest, metadata=GOOD, timeout=60)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    peak = max(peak, rss_bytes(process.pid))
    print(f"\nmemory attack: RSS {before / 2**20:.1f} MiB before, peak {peak / 2**20:.1f} MiB, "
          f"max request {MAX_REQUEST_BYTES} bytes")
    assert process.poll() is None
    assert peak < RSS_BOUND_MIB * 2**20, f"RSS {peak / 2**20:.1f} MiB"
    assert _serving(target)


async def _lockout(target: str, num_streams: int) -> dict:
    async with unread_watch_streams(target, num_streams) as (admitted, refused, others):
        # now, with every admitted stream unread, the operator and the kubelet
        async with grpc.aio.insecure_channel(target) as channel:
            stub = pb_grpc.ControllerStub(channel)
            state = await stub.SetPolicy(pb.SetPolicyRequest(policy=pb.Policy(mode=pb.MODE_FIXED, fixed_k=2)),
                                         metadata=GOOD, timeout=30)
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
            policy = await stub.GetPolicy(pb.GetPolicyRequest(), timeout=30)
    return {"admitted": admitted, "refused": refused, "others": others, "fixed_k": state.policy.fixed_k,
            "health": health.status, "generation": policy.generation}


def test_watch_streams_cannot_lock_out_control_or_health(sidecar_process):
    """16.2: 1,100 unread WatchStats streams without a token: the watch caps refuse the excess,
    and SetPolicy with the token, GetPolicy and Health.Check still succeed."""
    process, port = sidecar_process
    result = asyncio.run(_lockout(f"127.0.0.1:{port}", 1100))
    print(f"\nwatch lockout: 1,100 streams, {result['admitted']} admitted, {result['refused']} refused, "
          f"other answers {result['others']}")
    assert result["admitted"] <= 128, result   # per-peer cap (default 128), all from 127.0.0.1
    # every stream not admitted was refused: RESOURCE_EXHAUSTED, or on a loaded machine now and
    # then (1 in about 10 runs beside two CPU burners) CANCELLED by the transport, never served
    assert set(result["others"]) <= {"CANCELLED"}, result
    cancelled = result["others"].get("CANCELLED", (0, ""))[0]
    assert result["admitted"] + result["refused"] + cancelled == 1100 and cancelled <= 11, result
    assert result["fixed_k"] == 2 and result["health"] == health_pb2.HealthCheckResponse.SERVING
    assert process.poll() is None


async def _half_sent_calls(target: str, num_calls: int, num_connections: int = 3) -> dict:
    """``num_calls`` calls without a token whose headers go out and whose request message never
    does (GetPolicy, SetPolicy and Health.Check in turn, over ``num_connections`` connections, no
    deadline); while the newest of them wait, the operator's calls. Returns what each side got."""
    methods = ("/vcap.v1.Controller/GetPolicy", "/vcap.v1.Controller/SetPolicy", "/grpc.health.v1.Health/Check")
    channels = [grpc.aio.insecure_channel(target, options=(("grpc.use_local_subchannel_pool", 1),))
                for _ in range(num_connections)]
    try:
        calls = [channels[i % num_connections].stream_unary(methods[i % 3])() for i in range(num_calls)]

        async def code(call):
            try:
                await call
                return "OK"
            except grpc.aio.AioRpcError as error:
                return error.code().name
        endings = [asyncio.ensure_future(code(call)) for call in calls]
        deadline = time.monotonic() + 60   # generous: each ends within milliseconds of the next arrivals
        while sum(ending.done() for ending in endings) < num_calls - 64 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)   # the guard's per-peer cap: all but 64 end
        early = Counter(ending.result() for ending in endings if ending.done())
        async with grpc.aio.insecure_channel(target) as channel:
            stub = pb_grpc.ControllerStub(channel)
            state = await stub.SetPolicy(pb.SetPolicyRequest(policy=pb.Policy(mode=pb.MODE_FIXED, fixed_k=3)),
                                         metadata=GOOD, timeout=30)
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
        waiting = sum(not ending.done() for ending in endings)
        for call in calls:
            call.cancel()
        return {"early": early, "waiting": waiting, "fixed_k": state.policy.fixed_k, "health": health.status}
    finally:
        for channel in channels:
            await channel.close()


def test_calls_whose_request_never_comes_cannot_lock_out_control(segment_name, tmp_path, monkeypatch):
    """2,100 calls without a token that send headers and never a message (more than the
    server's 2,048 call slots; before the guard they answered everyone else RESOURCE_EXHAUSTED
    until they disconnected): all but the peer's newest 64 end at once, and while those
    64 wait, SetPolicy with the token and Health.Check on the same port succeed. (The guard's
    request timeout is raised here so that no call ends by it while the test runs.)"""
    monkeypatch.setattr(call_guard, "REQUEST_TIMEOUT_S", 600.0)
    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    sidecar = Sidecar(SidecarConfig(segment=segment_name, grpc_address="127.0.0.1:0", metrics_address="",
                                    auth_token_file=str(token))).start()
    try:
        result = asyncio.run(_half_sent_calls(f"127.0.0.1:{sidecar.grpc_port}", 2100))
    finally:
        sidecar.stop()
    print(f"\nhalf-sent calls: {result}")
    # ended by the guard; a share of them the transport reports CANCELLED (the server answers
    # before the client has finished sending), as with the watch streams above
    assert set(result["early"]) <= {"RESOURCE_EXHAUSTED", "CANCELLED"}, result
    # the operator's two calls come from the same host: each may evict one more of the oldest
    assert result["early"]["RESOURCE_EXHAUSTED"] > 1000 and 62 <= result["waiting"] <= 64, result
    assert result["fixed_k"] == 3 and result["health"] == health_pb2.HealthCheckResponse.SERVING


def test_guard_ends_a_call_without_request_and_caps_request_streams():
    """CallGuard on a bare server (health and reflection): a call whose message does not come
    ends DEADLINE_EXCEEDED with the guard's message (the client set no deadline); request streams
    beyond the per-peer cap are refused at once, and served again once one closes."""
    from grpc_health.v1.health import aio as health_aio
    from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

    async def run():
        guard = call_guard.CallGuard(64, request_timeout_s=0.5)
        server = grpc.aio.server(maximum_concurrent_rpcs=64, interceptors=(guard,))
        health_pb2_grpc.add_HealthServicer_to_server(health_aio.HealthServicer(), server)
        reflection.enable_server_reflection((reflection.SERVICE_NAME,), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await channel.stream_unary("/grpc.health.v1.Health/Check")()
                assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                assert "no request message within 0.5 s" in error.value.details()
                stub = reflection_pb2_grpc.ServerReflectionStub(channel)
                streams = [stub.ServerReflectionInfo() for _ in range(guard.max_streams_per_peer + 1)]
                for stream in streams[:-1]:   # each open and served
                    await stream.write(reflection_pb2.ServerReflectionRequest(list_services=""))
                    assert (await stream.read()).list_services_response.service
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await streams[-1].read()
                assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                await streams[0].done_writing()
                assert await streams[0].read() == grpc.aio.EOF
                await streams[0].wait_for_connection()
                again = stub.ServerReflectionInfo()
                await again.write(reflection_pb2.ServerReflectionRequest(list_services=""))
                assert (await again.read()).list_services_response.service
        finally:
            await server.stop(0)
    asyncio.run(run())


def test_second_sidecar_on_a_taken_port_fails_with_one_line(segment_name, sidecar_process):
    """16.7: no SO_REUSEPORT sharing; a taken gRPC or metrics port is one line naming the flag."""
    _, port = sidecar_process
    result = subprocess.run([sys.executable, "-m", "vcap.sidecar.cli", "--segment", segment_name + "-other",
                             "--grpc", f"127.0.0.1:{port}", "--metrics", ""],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert f"--grpc 127.0.0.1:{port}: cannot listen there" in result.stderr
    assert "Traceback" not in result.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        metrics_port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "vcap.sidecar.cli", "--segment", segment_name + "-other",
                                 "--grpc", "127.0.0.1:0", "--metrics", f"127.0.0.1:{metrics_port}"],
                                capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert f"--metrics 127.0.0.1:{metrics_port}: cannot listen there" in result.stderr
    assert "Traceback" not in result.stderr


def _scrape(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_metrics_endpoint_is_bounded(segment_name):
    """16.8: 300 half-sent requests cost at most MAX_CONNECTIONS threads; silent connections are
    dropped (idle timeout); scrapes work again once they are gone; the sidecar stays up."""
    engine = Segment.create(segment_name, CONFIG)
    sidecar = Sidecar(SidecarConfig(segment=segment_name, grpc_address="127.0.0.1:0",
                                    metrics_address="127.0.0.1:0")).start()
    try:
        assert b"vcap_engine_attached" in _scrape(sidecar.metrics_port)
        threads_before = num_threads()
        sockets = []
        for _ in range(300):
            sock = socket.create_connection(("127.0.0.1", sidecar.metrics_port), timeout=30)
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # never finished
            sockets.append(sock)
        wait_for(lambda: sidecar._metrics_server.refused >= 300 - MAX_CONNECTIONS, 60, "excess refused")
        threads_during = num_threads()
        assert threads_during <= threads_before + MAX_CONNECTIONS + 2, (threads_before, threads_during)
        # a held connection is dropped by the idle timeout: the server closes it
        assert sockets[0].recv(1) == b""
        for sock in sockets:
            sock.close()
        wait_for(lambda: b"vcap_engine_attached" in _scrape(sidecar.metrics_port), 60, "scrape after the attack")
        print(f"\nmetrics: 300 half-sent requests, threads {threads_before} -> {threads_during}, "
              f"{sidecar._metrics_server.refused} connections refused")
    finally:
        sidecar.stop()
        engine.unlink()


def test_metrics_clients_trickling_their_request_are_closed_at_the_deadline(segment_name):
    """MAX_CONNECTIONS clients that send one header line every 2 s (under the idle timeout)
    hold every slot; each is closed DEADLINE_S after it was accepted, and a scrape gets through
    while they keep trickling (found by an outside review: they kept Prometheus out for good)."""
    import threading
    engine = Segment.create(segment_name, CONFIG)
    sidecar = Sidecar(SidecarConfig(segment=segment_name, grpc_address="127.0.0.1:0",
                                    metrics_address="127.0.0.1:0")).start()
    stop, closed = threading.Event(), []

    def trickle():
        sock = socket.create_connection(("127.0.0.1", sidecar.metrics_port), timeout=30)
        try:
            sock.sendall(b"GET /metrics HTTP/1.0\r\n")
            while not stop.wait(2.0):
                sock.sendall(b"X-Slow: 1\r\n")
        except OSError:   # the server closed it
            closed.append(True)
        finally:
            sock.close()
    trickling = [threading.Thread(target=trickle, daemon=True) for _ in range(MAX_CONNECTIONS)]
    try:
        for thread in trickling:
            thread.start()
        wait_for(lambda: _scrape_or_none(sidecar.metrics_port), 90, "a scrape past the trickling clients")
        wait_for(lambda: len(closed) == MAX_CONNECTIONS, 90, "every trickling client closed by the server")
    finally:
        stop.set()
        for thread in trickling:
            thread.join(timeout=30)
        sidecar.stop()
        engine.unlink()


def _scrape_or_none(port: int) -> bytes | None:
    try:
        body = _scrape(port)
    except OSError:
        return None
    return body if b"vcap_engine_attached" in body else None


def test_repeated_log_lines_are_rate_limited(caplog):
    """16.8: a loop failing every tick logs once per window, then says how many it held back."""
    now = [0.0]
    logger = logging.getLogger("vcap.test-rate-limit")
    limit = RateLimit(window_s=10, clock=lambda: now[0])
    logger.addFilter(limit)
    try:
        with caplog.at_level(logging.ERROR, logger="vcap.test-rate-limit"):
            for _ in range(1767):
                try:
                    raise OSError(24, "Too many open files")
                except OSError:
                    logger.exception("engine link error; detaching")
            logger.error("another line")
            now[0] = 11.0
            try:
                raise OSError(24, "Too many open files")
            except OSError:
                logger.exception("engine link error; detaching")
        lines = [r.getMessage() for r in caplog.records if r.name == "vcap.test-rate-limit"]
        assert lines == ["engine link error; detaching", "another line",
                         "engine link error; detaching (1766 identical lines held back)"]
    finally:
        logger.removeFilter(limit)


def test_audit_lines_cannot_be_forged_or_flooded(segment_name, caplog):
    """16.10: the reason is escaped and bounded in the audit log; an oversized one is refused."""
    engine = Segment.create(segment_name, CONFIG)
    sidecar = Sidecar(SidecarConfig(segment=segment_name, grpc_address="127.0.0.1:0", metrics_address="")).start()
    try:
        wait_for(lambda: sidecar.link.attach_count, 10, "attach")
        with grpc.insecure_channel(f"127.0.0.1:{sidecar.grpc_port}") as channel, \
                caplog.at_level(logging.INFO, logger="vcap.audit"):
            stub = pb_grpc.ControllerStub(channel)
            policy = pb.Policy(mode=pb.MODE_FIXED, fixed_k=2)
            forged = "ok\n2099-01-01 INFO vcap.audit: policy change by admin"
            stub.SetPolicy(pb.SetPolicyRequest(policy=policy, reason=forged), timeout=10)
            stub.SetPolicy(pb.SetPolicyRequest(policy=policy, reason="r" * 1000), timeout=10)
            with pytest.raises(grpc.RpcError) as caught:
                stub.SetPolicy(pb.SetPolicyRequest(policy=policy, reason="r" * 5000), timeout=10)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(grpc.RpcError) as caught:
                stub.SetPolicy(pb.SetPolicyRequest(policy=policy, reason="r" * 3_900_000), timeout=30)
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            # auto -> manual is audited like manual -> auto
            stub.SetControlMode(pb.SetControlModeRequest(control_mode=pb.CONTROL_MODE_AUTO), timeout=10)
            stub.SetPolicy(pb.SetPolicyRequest(policy=policy), timeout=10)
            # 14.4: thresholds as written, not float32 noise
            stub.SetPolicy(pb.SetPolicyRequest(policy=policy_to_proto(Policy(
                "conf", 5, (Bucket(1, 1, 5, (0.3,) * 5),)))), timeout=10)
        audits = [r.getMessage() for r in caplog.records if r.name == "vcap.audit"]
        assert audits[-1].endswith("new conf | bs>=1 k 1..5 t 0.3,0.3,0.3,0.3,0.3"), audits[-1]
        assert not any("0.30000001" in line for line in audits)
        assert all("\n" not in line for line in audits)
        assert "(ok\\n2099-01-01 INFO vcap.audit" in audits[0]
        assert "r" * 200 + "...(1000 chars)" in audits[1] and "r" * 201 not in audits[1]
        assert any("manual -> auto" in line for line in audits)
        assert any("auto -> manual" in line for line in audits)
    finally:
        sidecar.stop()
        engine.unlink()


def test_metrics_beyond_loopback_is_said_at_start(segment_name):
    """16 (low): --metrics 0.0.0.0 is allowed, and said."""
    sidecar = Sidecar(SidecarConfig(segment=segment_name, grpc_address="127.0.0.1:0", metrics_address="0.0.0.0:0"))
    assert any("--metrics 0.0.0.0:0 listens beyond this machine" in w for w in sidecar.warnings)


def test_health_server_on_its_own_port(segment_name):
    """16.2/16.9: --health serves health alone, in plaintext, with its own call slots (what the
    kubelet's probes reach while the Controller's port speaks TLS)."""
    sidecar = Sidecar(SidecarConfig(segment=segment_name, grpc_address="127.0.0.1:0", metrics_address="",
                                    health_address="127.0.0.1:0")).start()
    try:
        assert sidecar.health_port and _serving(f"127.0.0.1:{sidecar.health_port}")
        with grpc.insecure_channel(f"127.0.0.1:{sidecar.health_port}") as channel:
            with pytest.raises(grpc.RpcError) as caught:
                pb_grpc.ControllerStub(channel).GetPolicy(pb.GetPolicyRequest(), timeout=10)
            assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        sidecar.stop()
