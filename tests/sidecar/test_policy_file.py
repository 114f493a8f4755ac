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
    try:
        with grpc.insecure_channel(f"127.0.0.1:{sidecar.grpc_port}") as channel:
            yield engine, policy_path, pb_grpc.ControllerStub(channel)
    finally:
        sidecar.stop()
        engine.unlink()


def test_file_applies_grpc_overrides_until_the_file_changes(stack):
    engine, policy_path, stub = stack
    wait_for(lambda: (engine.read_policy() or (None, 0, ""))[2] == "file", timeout=10, what="file policy")
    policy, _, _ = engine.read_policy()
    assert policy.mode == "conf" and [b.min_bs for b in policy.buckets] == [1, 32]
    assert policy.buckets[1].thresholds == pytest.approx((0.4,) * 5)
    assert stub.GetPolicy(pb.GetPolicyRequest()).source == pb.POLICY_SOURCE_FILE

    stub.SetPolicy(pb.SetPolicyRequest(policy=pb.Policy(mode=pb.MODE_FIXED, fixed_k=2)))
    time.sleep(1.5)  # the watcher polls; an unchanged file must not take the policy back
    assert engine.read_policy()[0].mode == "fixed"
    assert stub.GetPolicy(pb.GetPolicyRequest()).source == pb.POLICY_SOURCE_MANUAL

    _swap(policy_path, "mode: fixed\nfixed_k: 3\n")
    wait_for(lambda: engine.read_policy()[0].fixed_k == 3, timeout=10, what="changed file applied")
    assert engine.read_policy()[2] == "file"


def test_invalid_file_is_rejected_whole(stack):
    engine, policy_path, _ = stack
    wait_for(lambda: (engine.read_policy() or (None, 0, ""))[2] == "file", timeout=10, what="file policy")
    before = bytes(engine.buffer[engine.layout.control_offset:engine.layout.lease_offset])
    for text in ("mode: conf\nbuckets: [{min_bs: 1, thresholds: [1.5]}]\n", "mode: fast\n", "- not a mapping\n",
                 "mode: fixed\nfixed_k: 3\nextra: 1\n", "{{{"):
        _swap(policy_path, text)
        time.sleep(1.2)
        assert bytes(engine.buffer[engine.layout.control_offset:engine.layout.lease_offset]) == before, text
