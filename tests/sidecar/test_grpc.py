"""The gRPC API through a real server on loopback, against a real segment."""

import os
import re
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from vcap.segment import Segment, SegmentConfig
from vcap.sidecar.app import ENGINE_HEALTH_SERVICE, Sidecar, SidecarConfig
from vcap.v1 import controller_pb2 as pb
from vcap.v1 import controller_pb2_grpc as pb_grpc

from tests.utils import policy_in_force

CONFIG = SegmentConfig(stride=6, max_bs=32, num_moe_layers=3, ring_slots=8, lease_ms=300)


def wait_for(condition, timeout=5.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def sidecar(segment_name):
    server = Sidecar(SidecarConfig(segment=segment_name, grpc_address="127.0.0.1:0",
                                   metrics_address="127.0.0.1:0")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def channel(sidecar):
    with grpc.insecure_channel(f"127.0.0.1:{sidecar.grpc_port}") as channel:
        yield channel


@pytest.fixture
def stub(channel):
    return pb_grpc.ControllerStub(channel)


@pytest.fixture
def engine(segment_name, sidecar):
    segment = Segment.create(segment_name, CONFIG)
    wait_for(lambda: sidecar.link.attached, what="attach")
    yield segment
    segment.unlink()


def conf_request(thresholds, **fields):
    bucket = pb.Bucket(min_bs=1, k_min=1, k_max=5, thresholds=thresholds)
    return pb.SetPolicyRequest(policy=pb.Policy(mode=pb.MODE_CONF, buckets=[bucket]), **fields)


def test_health_and_reflection(channel, sidecar, segment_name):
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "vcap.v1.Controller"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    engine_health = lambda: health.Check(health_pb2.HealthCheckRequest(service=ENGINE_HEALTH_SERVICE)).status
    assert engine_health() == health_pb2.HealthCheckResponse.NOT_SERVING
    segment = Segment.create(segment_name, CONFIG)
    wait_for(lambda: engine_health() == health_pb2.HealthCheckResponse.SERVING, what="engine SERVING")
    segment.unlink()
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for reply in replies for s in reply.list_services_response.service}
    assert {"vcap.v1.Controller", "grpc.health.v1.Health"} <= names


def test_set_policy_reaches_the_control_block(stub, engine):
    state = stub.SetPolicy(conf_request([0.0, 0.5, 0.25, 0.125, 0.0625], reason="test"))
    assert state.engine_attached and state.num_drafts == 5 and state.max_bs == 32
    policy, generation, source = Segment.attach(engine.path).read_policy()
    assert (policy.mode, generation, source) == ("conf", state.generation, "manual")
    assert policy.buckets[0].thresholds == (0.0, 0.5, 0.25, 0.125, 0.0625)
    one = stub.SetPolicy(conf_request([0.3]))
    assert list(one.policy.buckets[0].thresholds) == pytest.approx([0.3] * 5)
    assert one.generation == state.generation + 1


INVALID = [
    (pb.Policy(), "mode is required"),
    (pb.Policy(mode=pb.MODE_FIXED), "fixed k must be in 1..5"),
    (pb.Policy(mode=pb.MODE_FIXED, fixed_k=6), "fixed k must be in 1..5"),
    (pb.Policy(mode=pb.MODE_CONF, buckets=[pb.Bucket(min_bs=1, k_max=9, thresholds=[0.1])]), "k_max <= 5"),
    (pb.Policy(mode=pb.MODE_CONF, buckets=[pb.Bucket(min_bs=1, k_min=4, k_max=2, thresholds=[0.1])]), "k_min <= k_max"),
    (pb.Policy(mode=pb.MODE_CONF, buckets=[pb.Bucket(min_bs=1, thresholds=[0.1, 0.2])]), "2 thresholds given"),
    (pb.Policy(mode=pb.MODE_CONF, buckets=[pb.Bucket(min_bs=1, thresholds=[float("nan")])]), "must be in \\[0, 1\\]"),
    (pb.Policy(mode=pb.MODE_CONF, buckets=[pb.Bucket(min_bs=1, thresholds=[1.01])]), "must be in \\[0, 1\\]"),
    (pb.Policy(mode=pb.MODE_CONF, buckets=[pb.Bucket(min_bs=1, thresholds=[-0.5])]), "must be in \\[0, 1\\]"),
    (pb.Policy(mode=pb.MODE_CONF, buckets=[pb.Bucket(min_bs=3, thresholds=[0.1])]), "start at batch size 1"),
    (pb.Policy(mode=pb.MODE_CONF, buckets=[pb.Bucket(min_bs=1, thresholds=[0.1]), pb.Bucket(min_bs=1, thresholds=[0.1])]), "without overlap"),
    (pb.Policy(mode=pb.MODE_CONF, buckets=[pb.Bucket(min_bs=1, thresholds=[0.1]), pb.Bucket(min_bs=9, thresholds=[0.1]),
                                           pb.Bucket(min_bs=5, thresholds=[0.1])]), "sorted"),
    (pb.Policy(mode=pb.MODE_CONF, buckets=[pb.Bucket(min_bs=b + 1, thresholds=[0.1]) for b in range(9)]), "1..8 buckets"),
    (pb.Policy(mode=pb.MODE_OFF, buckets=[pb.Bucket(min_bs=1, thresholds=[])]), "0 thresholds given"),
    (pb.Policy(mode=7), "mode is required"),
    (pb.Policy(mode=pb.MODE_CONF), "conf mode needs its buckets"),   # once read as every draft verified
]


@pytest.mark.parametrize("policy, message", INVALID)
def test_invalid_policy_rejected_whole(stub, engine, policy, message):
    stub.SetPolicy(conf_request([0.2]))
    before = bytes(engine.buffer[:engine.layout.lease_offset])
    with pytest.raises(grpc.RpcError) as error:
        stub.SetPolicy(pb.SetPolicyRequest(policy=policy))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.search(message, error.value.details()), error.value.details()
    assert bytes(engine.buffer[:engine.layout.lease_offset]) == before


def test_expected_generation(stub, engine):
    first = stub.SetPolicy(conf_request([0.2]))
    second = stub.SetPolicy(conf_request([0.4], expected_generation=first.generation))
    before = bytes(engine.buffer[:engine.layout.lease_offset])
    with pytest.raises(grpc.RpcError) as error:
        stub.SetPolicy(conf_request([0.6], expected_generation=first.generation))
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"current is {second.generation}" in error.value.details()
    assert bytes(engine.buffer[:engine.layout.lease_offset]) == before
    assert stub.SetPolicy(conf_request([0.6])).generation == second.generation + 1


def test_policy_kept_until_engine_attaches_and_rewritten_on_restart(stub, sidecar, segment_name):
    path = f"/dev/shm/{segment_name}"
    pending = stub.SetPolicy(pb.SetPolicyRequest(policy=pb.Policy(mode=pb.MODE_FIXED, fixed_k=2)))
    assert pending.pending and not pending.engine_attached
    time.sleep(0.2)
    assert not os.path.exists(path)  # the sidecar never creates the segment
    segment = Segment.create(segment_name, CONFIG)
    wait_for(lambda: policy_in_force(segment)[0].mode == "fixed", what="pending policy written")
    assert policy_in_force(segment)[0].fixed_k == 2
    inode, size = os.stat(path).st_ino, os.stat(path).st_size
    restarted = Segment.create(segment_name, CONFIG)  # the engine restarts: a new file
    assert os.stat(path).st_ino != inode
    wait_for(lambda: policy_in_force(restarted)[0].mode == "fixed", what="re-attach")
    assert sidecar.link.attach_count == 2
    sidecar.stop()
    assert os.stat(path).st_ino == restarted.inode and os.stat(path).st_size == size
    restarted.unlink()


def test_restarted_sidecar_adopts_the_policy_in_force(segment_name, engine, stub, sidecar):
    stub.SetPolicy(pb.SetPolicyRequest(policy=pb.Policy(mode=pb.MODE_FIXED, fixed_k=3)))
    # one writer per segment: a second sidecar is refused while the first runs
    with pytest.raises(ValueError, match=rf"another sidecar \(pid {os.getpid()}\) already writes"):
        Sidecar(SidecarConfig(segment=segment_name, grpc_address="127.0.0.1:0", metrics_address=""))
    sidecar.stop()
    second = Sidecar(SidecarConfig(segment=segment_name, grpc_address="127.0.0.1:0",
                                   metrics_address="")).start()
    try:
        wait_for(lambda: second.link.attached, what="second sidecar attached")
        with grpc.insecure_channel(f"127.0.0.1:{second.grpc_port}") as channel:
            state = pb_grpc.ControllerStub(channel).GetPolicy(pb.GetPolicyRequest())
        assert state.policy.mode == pb.MODE_FIXED and state.policy.fixed_k == 3
        assert state.source == pb.POLICY_SOURCE_MANUAL
    finally:
        second.stop()


def test_control_mode_switches_and_manual_set_ends_auto(stub, engine):
    state = stub.SetControlMode(pb.SetControlModeRequest(control_mode=pb.CONTROL_MODE_AUTO))
    assert state.control_mode == pb.CONTROL_MODE_AUTO
    assert stub.GetPolicy(pb.GetPolicyRequest()).control_mode == pb.CONTROL_MODE_AUTO
    state = stub.SetPolicy(pb.SetPolicyRequest(policy=pb.Policy(mode=pb.MODE_FIXED, fixed_k=2)))
    assert state.control_mode == pb.CONTROL_MODE_MANUAL
    with pytest.raises(grpc.RpcError) as error:
        stub.SetControlMode(pb.SetControlModeRequest())
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_watch_stats_streams(stub, engine):
    stream = stub.WatchStats(pb.WatchStatsRequest(interval_ms=50))
    updates = [next(stream) for _ in range(3)]
    stream.cancel()
    assert all(u.engine_attached for u in updates)
    assert updates[0].timestamp_unix < updates[2].timestamp_unix
    with pytest.raises(grpc.RpcError) as error:
        next(stub.WatchStats(pb.WatchStatsRequest(interval_ms=1)))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_token_required_beyond_loopback(segment_name, tmp_path):
    with pytest.raises(ValueError, match="listens beyond this machine"):
        Sidecar(SidecarConfig(segment=segment_name, grpc_address="0.0.0.0:0", metrics_address=""))
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token-0123456789\n")
    token_file.chmod(0o600)
    with pytest.raises(ValueError, match="the token travels in clear"):  # TLS required with a token
        Sidecar(SidecarConfig(segment=segment_name, grpc_address="0.0.0.0:0", metrics_address="",
                              auth_token_file=str(token_file)))
    server = Sidecar(SidecarConfig(segment=segment_name, grpc_address="0.0.0.0:0", metrics_address="",
                                   auth_token_file=str(token_file), allow_cleartext_token=True)).start()
    good = (("authorization", "Bearer s3cret-token-0123456789"),)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            stub = pb_grpc.ControllerStub(channel)
            with pytest.raises(grpc.RpcError) as error:  # beyond loopback reads need it too
                stub.GetPolicy(pb.GetPolicyRequest())
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
            stub.GetPolicy(pb.GetPolicyRequest(), metadata=good)
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
            assert health.status == health_pb2.HealthCheckResponse.SERVING  # health stays open
            request = pb.SetPolicyRequest(policy=pb.Policy(mode=pb.MODE_FIXED, fixed_k=2))
            for metadata in (None, (("authorization", "Bearer wrong"),)):
                with pytest.raises(grpc.RpcError) as error:
                    stub.SetPolicy(request, metadata=metadata)
                assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
            state = stub.SetPolicy(request, metadata=good)
            assert state.policy.fixed_k == 2
    finally:
        server.stop()
