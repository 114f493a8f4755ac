"""Issue 7.4: bad input. Every RPC's fields fuzzed, garbage bytes as each method's request, and
damaged segments. Every invalid request is answered INVALID_ARGUMENT / FAILED_PRECONDITION /
UNAUTHENTICATED with a message (never UNKNOWN or INTERNAL), the control block is byte-for-byte
unchanged after a refused request, and the server stays healthy. Damaged segments are refused
with a message naming the problem; a control block with valid framing but out-of-range values is
clamped on the engine side (never ``L`` outside ``1..stride``).
"""

import os
import re
import struct

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vcap.engine_hook import reference
from vcap.engine_hook.sim import SimConfig, SimulatedEngine, create_segment
from vcap.segment import ControlReader, Segment, SegmentConfig, SegmentError
from vcap.sidecar.app import Sidecar, SidecarConfig
from vcap.v1 import controller_pb2 as pb
from vcap.v1 import controller_pb2_grpc as pb_grpc

from ._helpers import wait_for

CONFIG = SegmentConfig(stride=6, max_bs=32, num_moe_layers=3, ring_slots=8, lease_ms=60_000)
REFUSED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION}
METHODS = {"GetPolicy": False, "SetPolicy": True, "SetControlMode": True, "GetStats": False,
           "WatchStats": False}
FUZZ = settings(max_examples=int(os.environ.get("VCAP_FUZZ_EXAMPLES", "250")), deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
COUNTS = {"field": 0, "garbage": 0, "header": 0, "control": 0}

u32 = st.one_of(st.integers(0, 8), st.integers(0, 2**32 - 1), st.sampled_from([2**31 - 1, 2**31, 2**32 - 1]))
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32),
                   st.sampled_from([0.0, 0.5, 1.0, -0.0, 1.0000001, -1e-9, float("nan"), float("inf")]))
bucket = st.builds(pb.Bucket, min_bs=u32, k_min=u32, k_max=u32,
                   thresholds=st.lists(floats, max_size=40))
policy = st.builds(pb.Policy, mode=st.integers(-3, 6), fixed_k=u32, explore_period=u32,
                   buckets=st.lists(bucket, max_size=10))


@pytest.fixture(scope="module")
def server():
    name = f"vcap-test-fuzz-{os.getpid()}"
    engine = Segment.create(name, CONFIG)
    sidecar = Sidecar(SidecarConfig(segment=name, grpc_address="127.0.0.1:0", metrics_address="")).start()
    channel = grpc.insecure_channel(f"127.0.0.1:{sidecar.grpc_port}")
    try:
        wait_for(lambda: sidecar.link.attach_count, 20, "attach")
        yield sidecar, engine, channel
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "vcap.v1.Controller", "vcap.engine"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
        assert pb_grpc.ControllerStub(channel).GetPolicy(pb.GetPolicyRequest(), timeout=10).engine_attached
        print(f"\nrequests fuzzed: {COUNTS}")
    finally:
        channel.close()
        sidecar.stop()
        engine.unlink()


def _block(engine):
    return engine.read_block(engine.layout.control_offset)


def _check_refusal(error: grpc.RpcError, allowed=REFUSED):
    assert error.code() in allowed, f"{error.code()}: {error.details()}"
    assert error.details(), f"{error.code()} without a message"


@FUZZ
@given(policy=policy, expected=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
       reason=st.text(max_size=50))
def test_set_policy_fields_fuzzed(server, policy, expected, reason):
    sidecar, engine, channel = server
    COUNTS["field"] += 1
    request = pb.SetPolicyRequest(policy=policy, reason=reason)
    if expected is not None:
        request.expected_generation = expected
    before = _block(engine)
    try:
        state = pb_grpc.ControllerStub(channel).SetPolicy(request, timeout=10)
    except grpc.RpcError as error:
        _check_refusal(error)
        assert _block(engine) == before, "a refused request changed the control block"
    else:  # accepted: exactly that generation is in force
        assert engine.read_policy()[1] == state.generation


@FUZZ
@given(mode=st.integers(-2**31, 2**31 - 1), interval=u32)
def test_control_mode_and_watch_fuzzed(server, mode, interval):
    sidecar, engine, channel = server
    COUNTS["field"] += 2
    stub = pb_grpc.ControllerStub(channel)
    before = _block(engine)
    try:
        stub.SetControlMode(pb.SetControlModeRequest(control_mode=mode), timeout=10)
        assert mode == pb.CONTROL_MODE_MANUAL or (mode == pb.CONTROL_MODE_AUTO and sidecar.controller is not None)
    except grpc.RpcError as error:
        _check_refusal(error)
    if mode == pb.CONTROL_MODE_AUTO:  # accepted where a controller exists: back to manual
        stub.SetControlMode(pb.SetControlModeRequest(control_mode=pb.CONTROL_MODE_MANUAL), timeout=10)
        before = _block(engine)  # the controller may have written in between
    stream = stub.WatchStats(pb.WatchStatsRequest(interval_ms=interval), timeout=10)
    try:
        assert next(stream).engine_attached
        assert interval == 0 or interval >= 50
    except grpc.RpcError as error:
        _check_refusal(error)
        assert 0 < interval < 50
    finally:
        stream.cancel()
    assert _block(engine) == before


@FUZZ
@given(method=st.sampled_from(sorted(METHODS)), payload=st.binary(max_size=300))
def test_garbage_request_bytes(server, method, payload):
    sidecar, engine, channel = server
    COUNTS["garbage"] += 1
    before = _block(engine)
    path = f"/vcap.v1.Controller/{method}"
    try:
        if method == "WatchStats":
            stream = channel.unary_stream(path)(payload, timeout=10)
            try:
                next(stream)
            finally:
                stream.cancel()
        else:
            channel.unary_unary(path)(payload, timeout=10)
    except grpc.RpcError as error:
        _check_refusal(error)
        if error.code() == grpc.StatusCode.INVALID_ARGUMENT and "malformed" in error.details():
            assert method in error.details() or "vcap.v1." in error.details()
        assert _block(engine) == before
        return
    if method == "SetPolicy" and _block(engine) != before:  # bytes that parse as a valid policy
        assert engine.read_policy() is not None


def test_malformed_bytes_are_invalid_argument_not_internal(server):
    _, engine, channel = server
    before = _block(engine)
    for method in METHODS:
        with pytest.raises(grpc.RpcError) as caught:
            if method == "WatchStats":
                next(channel.unary_stream(f"/vcap.v1.Controller/{method}")(b"\xff\xff\xff", timeout=10))
            else:
                channel.unary_unary(f"/vcap.v1.Controller/{method}")(b"\xff\xff\xff", timeout=10)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
        assert caught.value.details().startswith("malformed request: 3 bytes are not a vcap.v1.")
    assert _block(engine) == before


def test_uint32_beyond_the_control_block_is_refused(server):
    _, engine, channel = server
    stub = pb_grpc.ControllerStub(channel)
    before = _block(engine)
    for policy in (pb.Policy(mode=pb.MODE_OFF, fixed_k=2**31),
                   pb.Policy(mode=pb.MODE_CONF, buckets=[pb.Bucket(min_bs=1, thresholds=[0.1]),
                                                         pb.Bucket(min_bs=2**32 - 1, thresholds=[0.2])])):
        with pytest.raises(grpc.RpcError) as caught:
            stub.SetPolicy(pb.SetPolicyRequest(policy=policy), timeout=10)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert re.search(r"fixed k must be in 0\.\.5|min_bs must be in 1\.\.65536", caught.value.details())
    assert _block(engine) == before


def test_garbage_is_unauthenticated_before_parsing_when_a_token_is_required(segment_name, tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret-token-of-32-characters-xx")
    token.chmod(0o600)
    sidecar = Sidecar(SidecarConfig(segment=segment_name, grpc_address="0.0.0.0:0", metrics_address="",
                                    auth_token_file=str(token), allow_cleartext_token=True)).start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{sidecar.grpc_port}") as channel:
            for method in ("SetPolicy", "SetControlMode", "GetPolicy", "GetStats"):
                with pytest.raises(grpc.RpcError) as caught:
                    channel.unary_unary(f"/vcap.v1.Controller/{method}")(b"\xff\x00garbage", timeout=10)
                assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        sidecar.stop()


# -- damaged segments ------------------------------------------------------------------------


@FUZZ
@given(damage=st.lists(st.tuples(st.integers(0, 127), st.integers(0, 255)), min_size=1, max_size=8),
       length=st.one_of(st.none(), st.integers(0, 1 << 16)))
def test_fuzzed_header_refused_with_a_reason(segment_name, damage, length):
    COUNTS["header"] += 1
    segment = Segment.create(segment_name, CONFIG)
    with open(segment.path, "r+b") as file:
        for offset, value in damage:
            file.seek(offset)
            file.write(bytes([value]))
    if length is not None:
        os.truncate(segment.path, length)
    try:
        attached = Segment.attach(segment_name)
    except SegmentError as error:
        assert str(error).startswith(segment.path + ": ") and len(str(error)) > len(segment.path) + 10
    else:  # only bytes the reader does not depend on were hit, or it still describes the file
        assert attached.layout.total_size <= os.path.getsize(segment.path)
        attached.close()
    os.unlink(segment.path)
    segment.close()


def test_foreign_and_wrong_version_refused_by_the_sidecar(segment_name, caplog):
    path = f"/dev/shm/{segment_name}"
    with open(path, "wb") as file:
        file.write(b"VCAPSHM\x00" + struct.pack("<I", 99) + os.urandom(4096))
    sidecar = Sidecar(SidecarConfig(segment=segment_name, grpc_address="127.0.0.1:0", metrics_address="")).start()
    try:
        wait_for(lambda: "ABI version 99" in sidecar.link.last_error, 10, "the refusal")
        assert not sidecar.link.attached
        assert any("refusing segment" in r.getMessage() and "ABI version 99" in r.getMessage()
                   for r in caplog.records)
    finally:
        sidecar.stop()


i32 = st.one_of(st.integers(-3, 8), st.sampled_from([77, 999, 1000, -2**31, 2**31 - 1]),
                st.integers(-2**31, 2**31 - 1))
f32 = st.one_of(st.floats(width=32), st.sampled_from([float("nan"), float("inf"), -1.0, 2.0]))


@settings(FUZZ, max_examples=min(FUZZ.max_examples, 120))  # a segment and an engine per example
@given(head=st.tuples(i32, i32, i32, i32, i32),
       buckets=st.lists(st.tuples(i32, i32, i32, st.lists(f32, min_size=5, max_size=5)), min_size=8, max_size=8),
       bs=st.integers(1, 32), confidence=st.lists(f32, min_size=32 * 5, max_size=32 * 5))
def test_out_of_range_control_block_is_clamped_by_the_engine(segment_name, head, buckets, bs, confidence):
    COUNTS["control"] += 1
    config = SimConfig(stride=6, max_bs=32, num_moe_layers=3, ring_slots=8, lease_ms=60_000, mean_bs=bs,
                       load_noise=0.0)
    segment = create_segment(segment_name, config)
    try:
        layout = segment.layout
        body = bytearray(layout.control_size)
        mode, fixed_k, num_buckets, explore, source = head
        struct.pack_into("<IIiiiiiI", body, 0, 0, 7, mode, fixed_k, num_buckets, explore, source, 0)
        for i, (min_bs, k_min, k_max, thresholds) in enumerate(buckets):
            offset = 32 + i * layout.bucket_size
            struct.pack_into("<iiii5f", body, offset, min_bs, k_min, k_max, 0, *thresholds)
        segment.buffer[layout.control_offset:layout.control_offset + layout.control_size] = bytes(body)
        snapshot = ControlReader(segment).snapshot()
        conf = np.array(confidence, dtype=np.float32).reshape(32, 5)
        for explore_step in (False, True):
            live = reference.live_lengths(conf, snapshot.policy, bs, 6, explore_step)
            assert live.shape == (bs,) and live.min() >= 1 and live.max() <= 6
        # the simulated engine steps on it as the hook would
        records = SimulatedEngine(config, segment).step()
        n = int(records[0]["bs"])
        live, accepted = records[0]["live"][:n], records[0]["accepted"][:n]
        assert live.min() >= 1 and live.max() <= 6 and np.all(accepted <= live - 1)
    finally:
        segment.unlink()
        segment.close()


def test_sidecar_attaching_to_out_of_range_control_block_stays_answerable(segment_name):
    engine = Segment.create(segment_name, CONFIG)
    layout = engine.layout
    struct.pack_into("<IIiiiiiI", engine.buffer, layout.control_offset, 0, 9, 77, 999, 1000, 0, 42, 0)
    sidecar = Sidecar(SidecarConfig(segment=segment_name, grpc_address="127.0.0.1:0", metrics_address="")).start()
    try:
        wait_for(lambda: sidecar.link.attach_count, 10, "attach")
        with grpc.insecure_channel(f"127.0.0.1:{sidecar.grpc_port}") as channel:
            stub = pb_grpc.ControllerStub(channel)
            try:
                stub.GetPolicy(pb.GetPolicyRequest(), timeout=10)
            except grpc.RpcError as error:
                assert error.code() not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), error.details()
    finally:
        sidecar.stop()
        engine.unlink()
