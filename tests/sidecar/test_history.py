"""Policy history and rollback (issue 14.10): kept by a real ``vcap-sidecar`` across its restart and
an engine's, bounded on disk, rolled back through SetPolicy's validation and audit; the last
rejected policy reported, Envoy-style, while the last good one stays in force."""

import json
import os
import shutil
import signal
import subprocess

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from vcap.policy import Bucket, Policy
from vcap.segment import Segment, SegmentConfig
from vcap.sidecar import vcapctl
from vcap.sidecar.app import Sidecar, SidecarConfig
from vcap.sidecar.history import HistoryEntry, PolicyHistory
from vcap.v1 import controller_pb2 as pb
from vcap.v1 import controller_pb2_grpc as pb_grpc

from tests.utils import free_port, policy_in_force, wait_until

CONFIG = SegmentConfig(stride=6, max_bs=32, num_moe_layers=2, ring_slots=8, lease_ms=300)


def _policy(k: int) -> Policy:
    return Policy("fixed", k, (Bucket(1, 1, 0, (0.0,)),))


def _entry(generation: int) -> HistoryEntry:
    return HistoryEntry(generation, "manual", "tester", f"change {generation}", 1.5e9 + generation, _policy(1 + generation % 5))


def _ctl(port: int, capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = vcapctl.main(["--target", f"127.0.0.1:{port}", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _start_sidecar(segment_name: str, state_dir, port: int, log, *flags: str) -> subprocess.Popen:
    process = subprocess.Popen(["vcap-sidecar", "--segment", segment_name, "--grpc", f"127.0.0.1:{port}",
                                "--metrics", "", "--state-dir", str(state_dir), *flags],
                               stdout=log, stderr=subprocess.STDOUT)

    def attached():
        assert process.poll() is None, "vcap-sidecar exited"
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="vcap.engine"), timeout=2)
        return health.status == health_pb2.HealthCheckResponse.SERVING
    wait_until(attached, 60, "vcap-sidecar serving and attached", ignore=(grpc.RpcError,))
    return process


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)


@pytest.mark.skipif(not shutil.which("vcap-sidecar"), reason="needs vcap-sidecar on PATH")
def test_history_survives_restarts_and_rollback_reapplies_through_the_validated_path(
        segment_name, tmp_path, capsys):
    port = free_port()
    engine = Segment.create(segment_name, CONFIG)
    log = open(tmp_path / "sidecar.log", "w")
    sidecar = _start_sidecar(segment_name, tmp_path, port, log)
    try:
        for flags in (["--k", "3"], ["--threshold", "0.3"], ["--k", "2", "--reason", "tighter"]):
            assert _ctl(port, capsys, "set", *flags)[0] == 0
        _stop(sidecar)
        # the engine restarts too: a new segment starts at generation 0, the history does not
        engine.unlink()
        engine = Segment.create(segment_name, CONFIG)
        sidecar = _start_sidecar(segment_name, tmp_path, port, log)

        rc, out, _ = _ctl(port, capsys, "history")
        assert rc == 0, out
        lines = out.splitlines()
        assert f"in {tmp_path / segment_name}.history" in lines[0]
        # no entry is marked in force (*): the new engine runs its own policy
        assert [line.split()[0] for line in lines[1::2]] == ["3", "2", "1"]
        assert "manual" in lines[1] and "ipv4:127.0.0.1:" in lines[1] and "(tighter)" in lines[1]
        assert lines[2].split() == ["fixed", "k=2"] and "conf | bs>=1 k 1..5 t 0.3" in lines[4]

        # generations are not reused after the restart of both
        rc, out, _ = _ctl(port, capsys, "set", "--k", "4")
        assert rc == 0 and "generation: 4" in out
        assert engine.read_policy()[1] == 4

        # rollback without a generation: the policy before the one in force
        rc, out, _ = _ctl(port, capsys, "rollback", "--reason", "k 4 was worse")
        assert rc == 0, out
        assert "generation: 5" in out and "k=2" in out
        policy, generation, source = engine.read_policy()
        assert (policy.mode, policy.fixed_k, generation, source) == ("fixed", 2, 5, "manual")
        # a named generation, then one the history does not hold
        rc, out, _ = _ctl(port, capsys, "rollback", "2")
        assert rc == 0 and "mode:       conf" in out and engine.read_policy()[1] == 6
        rc, _, err = _ctl(port, capsys, "rollback", "99")
        assert rc == 1 and "NOT_FOUND: generation 99 is not in the policy history (it keeps generations 1..6)" in err
        # a stale expected generation is refused as SetPolicy's is
        rc, _, err = _ctl(port, capsys, "rollback", "1", "--expected-generation", "3")
        assert rc == 1 and "FAILED_PRECONDITION" in err

        rc, out, _ = _ctl(port, capsys, "history", "--limit", "3")
        lines = out.splitlines()
        assert lines[1].startswith("*     6") and "(rollback to generation 2)" in lines[1]
        assert "(rollback to generation 3: k 4 was worse)" in lines[3]
        with open(tmp_path / f"{segment_name}.history") as file:
            entries = [json.loads(line) for line in file]
        assert [(e["generation"], e["rollback_of"]) for e in entries] == [(1, 0), (2, 0), (3, 0), (4, 0), (5, 3), (6, 2)]
        assert os.stat(tmp_path / f"{segment_name}.history").st_mode & 0o777 == 0o600
    finally:
        _stop(sidecar)
        log.close()
        engine.unlink()
    audit = (tmp_path / "sidecar.log").read_text()
    assert "generation 4 -> 5 (rollback to generation 3: k 4 was worse)" in audit


def test_rollback_to_a_policy_that_no_longer_fits_is_refused_and_reported(segment_name, tmp_path):
    history_file = tmp_path / "history"
    history = PolicyHistory(str(history_file))
    history.append(HistoryEntry(7, "manual", "tester", "", 1.5e9, _policy(5)))   # k=5 of 5 drafts
    small = SegmentConfig(stride=4, max_bs=32, num_moe_layers=2, ring_slots=8)     # 3 drafts now
    engine = Segment.create(segment_name, small)
    sidecar = Sidecar(SidecarConfig(segment=segment_name, grpc_address="127.0.0.1:0", metrics_address="",
                                    history_file=str(history_file))).start()
    try:
        wait_until(lambda: sidecar.link.attached, 10, "attach")
        with grpc.insecure_channel(f"127.0.0.1:{sidecar.grpc_port}") as channel:
            stub = pb_grpc.ControllerStub(channel)
            assert stub.GetPolicy(pb.GetPolicyRequest(), timeout=10).generation == 7
            with pytest.raises(grpc.RpcError) as refused:
                stub.Rollback(pb.RollbackRequest(generation=7), timeout=10)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "fixed k must be in 1..3, got 5" in refused.value.details()
            state = stub.GetPolicy(pb.GetPolicyRequest(), timeout=10)
            assert state.HasField("last_rejected") and state.last_rejected.generation == 7
            assert state.last_rejected.source == pb.POLICY_SOURCE_MANUAL
            assert state.last_rejected.reason.startswith("Rollback: fixed k must be in 1..3")
            assert engine.read_policy()[1:] == (0, "engine")   # nothing written
    finally:
        sidecar.stop()
        engine.unlink()


def test_rejected_policies_reported_while_the_last_good_stays(segment_name, tmp_path, capsys):
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text("mode: fixed\nfixed_k: 2\n")
    engine = Segment.create(segment_name, CONFIG)
    sidecar = Sidecar(SidecarConfig(segment=segment_name, grpc_address="127.0.0.1:0", metrics_address="127.0.0.1:0",
                                    policy_file=str(policy_file))).start()
    try:
        wait_until(lambda: policy_in_force(engine)[2] == "file", 10, "the file's policy written")
        good = engine.read_policy()[1]
        with grpc.insecure_channel(f"127.0.0.1:{sidecar.grpc_port}") as channel:
            stub = pb_grpc.ControllerStub(channel)
            assert not stub.GetPolicy(pb.GetPolicyRequest(), timeout=10).HasField("last_rejected")
            assert not next(stub.WatchStats(pb.WatchStatsRequest(), timeout=10)).HasField("last_rejected")
            with pytest.raises(grpc.RpcError) as refused:
                stub.SetPolicy(pb.SetPolicyRequest(policy=pb.Policy(mode=pb.MODE_FIXED, fixed_k=9)), timeout=10)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            state = stub.GetPolicy(pb.GetPolicyRequest(), timeout=10)
            assert (state.generation, state.policy.fixed_k, state.source) == (good, 2, pb.POLICY_SOURCE_FILE)
            rejection = state.last_rejected
            assert (rejection.generation, rejection.source) == (good, pb.POLICY_SOURCE_MANUAL)
            assert "SetPolicy: fixed k must be in 1..5, got 9" == rejection.reason
            assert rejection.who.startswith("ipv4:127.0.0.1:") and rejection.time_unix > 1.5e9
            # malformed bytes from a caller are a rejected SetPolicy too
            with pytest.raises(grpc.RpcError):
                channel.unary_unary("/vcap.v1.Controller/SetPolicy")(b"\xff\xff\xff", timeout=10)
            assert "malformed request" in stub.GetPolicy(pb.GetPolicyRequest(), timeout=10).last_rejected.reason

            policy_file.write_text("mode: fixed\nfixed_k: [1, 2]\n")
            wait_until(lambda: sidecar.control.rejections_by_source["file"], 10, "the bad file rejected")
            state = stub.GetPolicy(pb.GetPolicyRequest(), timeout=10)
            assert state.generation == good and state.policy.fixed_k == 2   # the last good policy
            assert state.last_rejected.source == pb.POLICY_SOURCE_FILE
            assert state.last_rejected.who == f"policy file {policy_file}"
            assert "malformed policy file" in state.last_rejected.reason
            stats = next(stub.WatchStats(pb.WatchStatsRequest(), timeout=10))
            assert stats.last_rejected == state.last_rejected and stats.policy_generation == good

        rc, out, _ = _ctl(sidecar.grpc_port, capsys, "get")
        assert rc == 0 and "rejected:" in out and "via file by policy file" in out
        assert f"(generation {good} stayed in force)" in out
        rc, out, _ = _ctl(sidecar.grpc_port, capsys, "watch", "--count", "1")
        assert rc == 0 and "REJECTED" in out and f"via file (gen {good} kept)" in out
        registry = sidecar.registry
        assert registry.get_sample_value("vcap_policy_rejections_total", {"source": "manual"}) == 2
        assert registry.get_sample_value("vcap_policy_rejections_total", {"source": "file"}) == 1
        assert registry.get_sample_value("vcap_policy_last_rejection_timestamp_seconds") == \
            pytest.approx(sidecar.control.last_rejected.time_unix)
    finally:
        sidecar.stop()
        engine.unlink()


def test_history_file_is_bounded_and_skips_what_is_not_an_entry(tmp_path):
    path = tmp_path / "history"
    history = PolicyHistory(str(path), max_entries=10)
    for generation in range(1, 251):
        history.append(_entry(generation))
        assert len(path.read_text().splitlines()) < 20
    assert [e.generation for e in history.newest(3)] == [250, 249, 248]
    with open(path, "a") as file:
        file.write('{"generation": 251, "source": "man')   # a write cut by a crash
    reloaded = PolicyHistory(str(path), max_entries=10)
    assert [e.generation for e in reloaded.newest()] == list(range(250, 240, -1))
    assert reloaded.newest()[0] == history.newest()[0]
    assert reloaded.before(250, _policy(1 + 250 % 5)).generation == 249

    # bounded in bytes too: long reasons are cut, the file stays under max_bytes
    wide = PolicyHistory(str(tmp_path / "wide"), max_entries=1000, max_bytes=64 * 1024)
    for generation in range(1, 400):
        wide.append(HistoryEntry(generation, "manual", "x" * 5000, "y" * 5000, 1.5e9, _policy(2)))
        assert os.path.getsize(tmp_path / "wide") <= 64 * 1024 + 3000


def test_history_file_planted_by_another_name_is_not_followed(tmp_path, caplog):
    target = tmp_path / "elsewhere"
    target.write_text("")
    link = tmp_path / "history"
    link.symlink_to(target)
    history = PolicyHistory(str(link))
    assert history.path is None   # in memory only, said once
    history.append(_entry(1))
    assert target.read_text() == "" and [e.generation for e in history.newest()] == [1]
    assert "keeping it in memory only" in caplog.text


@pytest.mark.skipif(not shutil.which("vcap-sidecar"), reason="needs vcap-sidecar on PATH")
def test_a_restart_keeps_a_manual_change_over_an_unchanged_policy_file_and_resumes_auto(
        segment_name, tmp_path, capsys):
    # found by an outside review: with --policy-file (the systemd unit and the manifests), a
    # restart put the file's policy back over an incident-time `vcapctl set`, and auto mode ended
    port, policy_file = free_port(), tmp_path / "policy.yaml"
    policy_file.write_text("mode: conf\nbuckets:\n  - {min_bs: 1, thresholds: [0.3]}\n")
    engine = Segment.create(segment_name, CONFIG)
    log = open(tmp_path / "sidecar.log", "w")
    sidecar = _start_sidecar(segment_name, tmp_path, port, log, "--policy-file", str(policy_file))
    try:
        wait_until(lambda: policy_in_force(engine)[2] == "file", 30, "the file's policy in force")
        assert _ctl(port, capsys, "set", "--k", "2", "--reason", "incident")[0] == 0
        assert _ctl(port, capsys, "set", "--mode", "auto")[0] == 0
        _stop(sidecar)
        sidecar = _start_sidecar(segment_name, tmp_path, port, log, "--policy-file", str(policy_file))
        rc, out, _ = _ctl(port, capsys, "get")
        assert rc == 0 and "control: auto" in out, out
        policy, generation, source = engine.read_policy()
        assert (policy.mode, policy.fixed_k, source) == ("fixed", 2, "manual")

        # the file edited while the sidecar was down applies at its start
        _stop(sidecar)
        policy_file.write_text("mode: conf\nbuckets:\n  - {min_bs: 1, thresholds: [0.4]}\n")
        sidecar = _start_sidecar(segment_name, tmp_path, port, log, "--policy-file", str(policy_file))
        wait_until(lambda: policy_in_force(engine)[2] == "file", 30, "the edited file's policy in force")
        assert engine.read_policy()[0].buckets[0].thresholds[0] == pytest.approx(0.4)

        # a new engine's segment holds no policy: the unchanged file applies there
        _stop(sidecar)
        engine.unlink()
        engine = Segment.create(segment_name, CONFIG)
        sidecar = _start_sidecar(segment_name, tmp_path, port, log, "--policy-file", str(policy_file))
        wait_until(lambda: policy_in_force(engine)[2] == "file", 30, "the file's policy on the new engine")

        # back to manual: a restart stays manual
        assert _ctl(port, capsys, "set", "--mode", "manual")[0] == 0
        _stop(sidecar)
        sidecar = _start_sidecar(segment_name, tmp_path, port, log)
        rc, out, _ = _ctl(port, capsys, "get")
        assert rc == 0 and "control: manual" in out, out
    finally:
        _stop(sidecar)
        log.close()
        engine.unlink()
    assert "unchanged since it was applied: keeping the policy in force" in (tmp_path / "sidecar.log").read_text()
