"""--policy-file: one policy for a fleet (a mounted ConfigMap). The file applies at start and
whenever its content changes; a gRPC change overrides it until the file changes again."""

import os
import time

import grpc
import pytest

from vcap.segment import Segment, SegmentConfig
from vcap.sidecar.app import Sidecar, SidecarConfig
from vcap.v1 import controller_pb2 as pb
from vcap.v1 import controller_pb2_grpc as pb_grpc

from tests.utils import policy_in_force
from .test_grpc import wait_for

CONF_FILE = """
mode: conf
buckets:
  - {min_bs: 1, k_min: 1, k_max: 5, thresholds: [0.0, 0.5, 0.3, 0.2, 0.1]}
  - {min_bs: 32, thresholds: [0.4]}
"""


def _swap(path, text):
    """Replace the file the way Kubernetes updates a ConfigMap volume: a new file, renamed over."""
    temporary = f"{path}.new"
    with open(temporary, "w") as file:
        file.write(text)
    os.replace(temporary, path)


@pytest.fixture
def stack(segment_name, tmp_path):
    policy_path = tmp_path / "policy.yaml"
    policy_path.write_text(CONF_FILE)
    engine = Segment.create(segment_name, SegmentConfig(stride=6, max_bs=64, num_moe_layers=2))
    sidecar = Sidecar(SidecarConfig(segment=segment_name, grpc_address="127.0.0.1:0", metrics_address="",
                                    policy_file=str(policy_path))).start()
    _SIDECARS[str(policy_path)] = sidecar
    try:
        with grpc.insecure_channel(f"127.0.0.1:{sidecar.grpc_port}") as channel:
            yield engine, policy_path, pb_grpc.ControllerStub(channel)
    finally:
        _SIDECARS.pop(str(policy_path), None)
        sidecar.stop()
        engine.unlink()


def test_file_applies_grpc_overrides_until_the_file_changes(stack):
    engine, policy_path, stub = stack
    wait_for(lambda: policy_in_force(engine)[2] == "file", timeout=10, what="file policy")
    policy, _, _ = policy_in_force(engine)
    assert policy.mode == "conf" and [b.min_bs for b in policy.buckets] == [1, 32]
    assert policy.buckets[1].thresholds == pytest.approx((0.4,) * 5)
    assert stub.GetPolicy(pb.GetPolicyRequest()).source == pb.POLICY_SOURCE_FILE

    stub.SetPolicy(pb.SetPolicyRequest(policy=pb.Policy(mode=pb.MODE_FIXED, fixed_k=2)))
    time.sleep(1.5)  # the watcher polls; an unchanged file must not take the policy back
    assert policy_in_force(engine)[0].mode == "fixed"
    assert stub.GetPolicy(pb.GetPolicyRequest()).source == pb.POLICY_SOURCE_MANUAL

    _swap(policy_path, "mode: fixed\nfixed_k: 3\n")
    wait_for(lambda: policy_in_force(engine)[0].fixed_k == 3, timeout=10, what="changed file applied")
    assert policy_in_force(engine)[2] == "file"


def test_invalid_file_is_rejected_whole(stack):
    engine, policy_path, _ = stack
    wait_for(lambda: policy_in_force(engine)[2] == "file", timeout=10, what="file policy")
    before = bytes(engine.buffer[engine.layout.control_offset:engine.layout.lease_offset])
    for text in ("mode: conf\nbuckets: [{min_bs: 1, thresholds: [1.5]}]\n", "mode: fast\n", "- not a mapping\n",
                 "mode: fixed\nfixed_k: 3\nextra: 1\n", "{{{"):
        _swap(policy_path, text)
        time.sleep(1.2)
        assert bytes(engine.buffer[engine.layout.control_offset:engine.layout.lease_offset]) == before, text


HOSTILE_FILES = {
    "float beyond float32": "mode: conf\nbuckets: [{min_bs: 1, thresholds: [1e39]}]\n",
    "infinite min_bs": "mode: conf\nbuckets: [{min_bs: .inf, thresholds: [0.5]}]\n",
    "5,000-digit integer": "mode: fixed\nfixed_k: " + "9" * 5000 + "\n",
    "nested 2,000 deep": "mode: conf\nbuckets: " + "[" * 2000 + "]" * 2000 + "\n",
    "too big": "mode: off\n" + "# padding\n" * 40_000,
}


def test_hostile_files_rejected_whole_sidecar_stays_up(stack):
    """Issue 16.3: files that once crashed the sidecar on every start are rejected whole, counted,
    logged; the last good policy stays in force and the sidecar keeps serving."""
    engine, policy_path, stub = stack
    wait_for(lambda: policy_in_force(engine)[2] == "file", timeout=10, what="file policy")
    before = bytes(engine.buffer[engine.layout.control_offset:engine.layout.lease_offset])
    control = stub  # the sidecar answers throughout
    for count, (what, text) in enumerate(HOSTILE_FILES.items(), start=1):
        _swap(policy_path, text)
        sidecar_control = stub.GetPolicy(pb.GetPolicyRequest(), timeout=10)
        assert sidecar_control.source == pb.POLICY_SOURCE_FILE, what
        wait_for(lambda: _rejections(policy_path) >= count, timeout=20, what=f"{what} rejected")
        assert bytes(engine.buffer[engine.layout.control_offset:engine.layout.lease_offset]) == before, what
    assert control.GetPolicy(pb.GetPolicyRequest(), timeout=10).policy.mode == pb.MODE_CONF


_SIDECARS = {}


def _rejections(policy_path) -> int:
    return _SIDECARS[str(policy_path)].control.rejections_by_source["file"]


def test_hostile_file_at_start_does_not_stop_the_sidecar(segment_name, tmp_path):
    """Issue 16.3: a sidecar that starts with a hostile file serves, on the engine's policy."""
    engine = Segment.create(segment_name, SegmentConfig(stride=6, max_bs=64, num_moe_layers=2))
    for what, text in HOSTILE_FILES.items():
        path = tmp_path / "policy.yaml"
        path.write_text(text)
        sidecar = Sidecar(SidecarConfig(segment=segment_name, grpc_address="127.0.0.1:0", metrics_address="",
                                        policy_file=str(path))).start()
        try:
            wait_for(lambda: sidecar.control.rejections_by_source["file"] == 1, timeout=20, what=f"{what} rejected at start")
            with grpc.insecure_channel(f"127.0.0.1:{sidecar.grpc_port}") as channel:
                state = pb_grpc.ControllerStub(channel).GetPolicy(pb.GetPolicyRequest(), timeout=10)
            assert state.source == pb.POLICY_SOURCE_ENGINE, what
            assert sidecar.registry.get_sample_value("vcap_policy_rejections_total", {"source": "file"}) == 1
        finally:
            sidecar.stop()
    engine.unlink()
