"""Issue 16, the segment and file side: a hostile or damaged segment, policy file or neighbour
must not crash the sidecar or the engine. Real segments in /dev/shm, real sidecars (in-process
or as processes), real simulated engines."""

import logging
import os
import signal
import subprocess
import sys

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from vcap.ring import RingWriter
from vcap.segment import (CONTROL_FIXED_K, CONTROL_HEAD_WORDS, CONTROL_MODE, CONTROL_NUM_BUCKETS, FLAG_EXPERTS_SAMPLED,
                          Segment, SegmentConfig, SegmentError, record_dtype)
from vcap.sidecar.app import Sidecar, SidecarConfig
from vcap.v1 import controller_pb2 as pb
from vcap.v1 import controller_pb2_grpc as pb_grpc

from ..utils import free_port
from ._helpers import start_sim, stop_process, wait_for

CONFIG = SegmentConfig(stride=6, max_bs=16, num_moe_layers=2, ring_slots=8, num_experts=64)


def _sidecar(segment_name, **config):
    sidecar = Sidecar(SidecarConfig(segment=segment_name, grpc_address="127.0.0.1:0", metrics_address="",
                                    **config)).start()
    return sidecar


def _stub(sidecar):
    return pb_grpc.ControllerStub(grpc.insecure_channel(f"127.0.0.1:{sidecar.grpc_port}"))


def _record(segment, **fields):
    record = np.zeros((), dtype=record_dtype(segment.layout))
    record["bs"], record["live"][:2], record["step_ns"] = 2, 3, 1_000_000
    record["confidence"][:2] = 0.5
    for name, value in fields.items():
        record[name] = value
    return record


def test_garbage_records_never_reach_the_totals(segment_name):
    """16.4: garbage records are rejected and counted; counters never go negative; a ring
    counter that jumps is followed without a drop count of 2^64; GetStats keeps answering."""
    engine = Segment.create(segment_name, CONFIG)
    sidecar = _sidecar(segment_name)
    try:
        wait_for(lambda: sidecar.link.attach_count, 10, "attach")
        writer = RingWriter(engine, 0)
        sampled = {"flags": FLAG_EXPERTS_SAMPLED, "experts_all": [10, 10], "experts_live": [5, 5]}
        garbage = [dict(sampled, experts_all=[-2**31, 10]), dict(step_ns=2**64 - 1), dict(bs=4_000_000_000),
                   dict(confidence=np.full((16, 5), np.nan, dtype=np.float32)), dict(sampled, experts_live=[2**31 - 1, 1])]
        for fields in garbage:
            writer.publish(_record(engine, **fields))
        writer.publish(_record(engine, **sampled))  # one good record
        wait_for(lambda: sidecar.link.records_rejected == len(garbage), 10, "garbage rejected")
        wait_for(lambda: (sidecar.link.totals_snapshot() or None) and sidecar.link.totals_snapshot().steps == 1,
                 10, "the good record counted")
        engine.write_u64(engine.layout.ring_offset(0), 2**50)  # the ring's counter jumps
        wait_for(lambda: sidecar.link.readers[0].resyncs, 10, "the jump followed")
        writer.publish(_record(engine, **sampled))
        wait_for(lambda: sidecar.link.totals_snapshot().steps == 2, 10, "the record after the jump")
        stats = _stub(sidecar).GetStats(pb.GetStatsRequest(), timeout=10)
        totals = sidecar.link.totals_snapshot()
        assert stats.verify_steps == 2 and stats.experts_streamed == 20 and stats.experts_saved == 20
        assert stats.telemetry_dropped < 2**32, stats.telemetry_dropped
        assert min(totals.rows_dead, totals.rows_live, int(totals.layer_saved.min()),
                   int(totals.layer_streamed.min())) >= 0
        text = sidecar.registry.get_sample_value("vcap_telemetry_records_rejected_total", {"dp_rank": "0"})
        assert text == len(garbage)
    finally:
        sidecar.stop()
        engine.unlink()


def test_hostile_header_and_control_block_do_not_kill_the_sidecar(segment_name):
    """16.5: engine_pid 0xFFFFFFFF and a control block with negative fields: the sidecar stays up,
    GetStats and GetPolicy answer (also after a restart)."""
    engine = Segment.create(segment_name, CONFIG)
    engine.buffer[56:60] = (0xFFFFFFFF).to_bytes(4, "little")
    words = engine.control_words.view("<i4")
    for block in (engine.layout.control_offset, engine.layout.fallback_offset):
        view = np.frombuffer(engine.buffer, dtype="<i4", count=engine.layout.control_size // 4, offset=block)
        view[CONTROL_MODE], view[CONTROL_FIXED_K], view[CONTROL_NUM_BUCKETS] = 1, -1, 1
        view[CONTROL_HEAD_WORDS] = -5  # min_bs of bucket 0
    assert words[CONTROL_FIXED_K] == -1
    for _ in range(2):  # and again after a restart
        sidecar = _sidecar(segment_name)
        try:
            wait_for(lambda: sidecar.link.attach_count, 10, "attach")
            stub = _stub(sidecar)
            stats = stub.GetStats(pb.GetStatsRequest(), timeout=10)
            assert stats.engine_pid == 0xFFFFFFFF and not stats.engine_alive
            state = stub.GetPolicy(pb.GetPolicyRequest(), timeout=10)
            assert state.engine_attached and state.policy.mode == pb.MODE_OFF  # the default, not garbage
            assert sidecar.link._thread.is_alive()
        finally:
            sidecar.stop()
    engine.unlink()


def test_second_sidecar_refused_naming_the_first(segment_name, tmp_path):
    """16.6: one writer per segment; the second sidecar exits naming the first one's pid."""
    engine = start_sim(segment_name, "--max-bs", "16", "--layers", "2")
    log = open(tmp_path / "first.log", "w")
    first = subprocess.Popen([sys.executable, "-m", "vcap.sidecar.cli", "--segment", segment_name,
                              "--grpc", f"127.0.0.1:{free_port()}", "--metrics", ""], stdout=log, stderr=log)
    try:
        wait_for(lambda: "attached to" in (tmp_path / "first.log").read_text(), 60, "first sidecar attached")
        second = subprocess.run([sys.executable, "-m", "vcap.sidecar.cli", "--segment", segment_name,
                                 "--grpc", "127.0.0.1:0", "--metrics", ""], capture_output=True, text=True, timeout=60)
        assert second.returncode == 2, second.stderr
        assert f"another sidecar (pid {first.pid}) already writes" in second.stderr
        assert "Traceback" not in second.stderr
    finally:
        stop_process(first)
        stop_process(engine)
        log.close()


def test_sidecar_started_before_the_engine_beside_another_changes_nothing(segment_name):
    """Two sidecars started on a segment that does not exist yet (the start-up check sees no
    holder): when the engine comes, one attaches; the other refuses changes, naming the first,
    instead of queueing them, and when the first stops it attaches and adopts the policy in
    force rather than overwriting it (found by an outside review)."""
    def sidecar():
        return Sidecar(SidecarConfig(segment=segment_name, grpc_address="127.0.0.1:0", metrics_address="")).start()
    sidecars = [sidecar(), sidecar()]
    engine = None
    try:
        engine = Segment.create(segment_name, CONFIG)
        wait_for(lambda: any(s.link.attached for s in sidecars), 30, "one sidecar attached")
        first, second = sidecars if sidecars[0].link.attached else sidecars[::-1]
        wait_for(lambda: second.control.driven_by_another, 30, "the other one sees the holder")

        def set_k(sidecar, k):
            with grpc.insecure_channel(f"127.0.0.1:{sidecar.grpc_port}") as channel:
                return pb_grpc.ControllerStub(channel).SetPolicy(
                    pb.SetPolicyRequest(policy=pb.Policy(mode=pb.MODE_FIXED, fixed_k=k)), timeout=30)
        generation = set_k(first, 2).generation
        with pytest.raises(grpc.RpcError) as error:
            set_k(second, 3)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        assert f"another sidecar (pid {os.getpid()}) already writes" in error.value.details()
        assert not second.control.state().pending
        first.stop()
        wait_for(lambda: second.link.attached, 30, "the second attached once the first stopped")
        state = second.control.state()
        assert (state.policy.fixed_k, state.generation) == (2, generation)
        assert engine.read_policy()[1] == generation and engine.read_policy()[0].fixed_k == 2
        assert set_k(second, 3).generation == generation + 1   # now it drives the segment
    finally:
        for s in sidecars:
            s.stop()
        if engine is not None:
            engine.unlink()


# Every host access of the engine's and the sidecar's paths, on a file truncated under them,
# in a process of its own: a load or store through the mapping there would be SIGBUS.
_TRUNCATED_ACCESSES = """
import os, sys
import numpy as np
from vcap.control import ControlReader
from vcap.policy import default_policy
from vcap.ring import RingReader, RingWriter
from vcap.segment import Segment, SegmentConfig, record_dtype
name, size = sys.argv[1], int(sys.argv[2])
engine = Segment.create(name, SegmentConfig(stride=6, max_bs=16, num_moe_layers=2, ring_slots=8))
sidecar = Segment.attach(name)
reader, control = RingReader(sidecar, 0), ControlReader(engine)
writer = RingWriter(engine, 0)
writer.publish(np.zeros((), dtype=record_dtype(engine.layout)))
os.truncate(engine.path, size)
assert not engine.intact() and not sidecar.intact()
writer.publish(np.zeros((), dtype=record_dtype(engine.layout)))       # the engine, mid-step
engine.write_status(5, 5, False)
words, state = control.read()
sidecar.write_policy(default_policy(5), 3, "manual")                  # the sidecar, mid-tick
sidecar.renew_lease()
records = reader.read()
print("pid", sidecar.engine_pid, "records", len(records), "state", state, "intact", engine.intact())
engine.restore()
assert engine.intact() and not sidecar.intact()   # a new creation time: the sidecar attaches again
assert Segment.attach(name).intact()
engine.unlink()
"""


@pytest.mark.parametrize("size", [0, 100, 600, 1100, 1200, 2000, 4096, 4700])  # of 4,800 bytes
def test_every_access_survives_a_truncation_between_check_and_use(segment_name, size):
    """The race a check before each pass cannot close: the file is cut after `intact()` said
    yes. The engine's writes, its control read, the sidecar's policy write, lease, status and
    ring reads all go through the file, so the process lives and reads back whole records only
    (of the two published, those the cut spared); the engine restores the file and the sidecar
    then sees another file."""
    done = subprocess.run([sys.executable, "-c", _TRUNCATED_ACCESSES, segment_name, str(size)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    fields = done.stdout.split()
    assert fields[fields.index("records") + 1] in ("0", "1", "2") and "intact False" in done.stdout, done.stdout


def test_truncations_kill_neither_process(segment_name, tmp_path):
    """16.11: `truncate -s` on the live segment, in a loop, at 4096 and at sizes of a seeded draw
    (inside the header, the control block, the lease, the rings), against an engine stepping flat
    out: the engine restores the file every time, the sidecar attaches again and writes its policy
    back (the restore put the engine's fallback there), and telemetry flows after."""
    engine_log = tmp_path / "engine.log"
    with open(engine_log, "w") as log:
        engine = start_sim(segment_name, "--max-bs", "64", "--layers", "8", "--time-scale", "0", log=log)
    sidecar_log = open(tmp_path / "sidecar.log", "w")
    port = free_port()
    sidecar = subprocess.Popen([sys.executable, "-m", "vcap.sidecar.cli", "--segment", segment_name,
                                "--grpc", f"127.0.0.1:{port}", "--metrics", ""], stdout=sidecar_log, stderr=sidecar_log)
    path = f"/dev/shm/{segment_name}"
    try:
        wait_for(lambda: "attached to" in (tmp_path / "sidecar.log").read_text(), 60, "sidecar attached")
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            pb_grpc.ControllerStub(channel).SetPolicy(
                pb.SetPolicyRequest(policy=pb.Policy(mode=pb.MODE_FIXED, fixed_k=2)), timeout=10)
        size = os.stat(path).st_size
        cuts = [4096, 0, 24, 600, 1100] + [int(x) for x in np.random.default_rng(7).integers(1, size, 8)]
        for number, cut in enumerate(cuts, start=1):
            os.truncate(path, cut)
            wait_for(lambda: engine_log.read_text().count("was truncated") >= number or engine.poll() is not None,
                     60, f"the engine restored cut {number} ({cut} bytes)")
            assert engine.poll() is None and sidecar.poll() is None, (number, cut)
        assert os.stat(path).st_size == size
        segment = Segment.attach(segment_name)
        wait_for(lambda: (lambda found: found and (found[0].mode, found[0].fixed_k) == ("fixed", 2))(
            segment.read_policy()), 60, "the sidecar's policy back in the restored file")
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.ControllerStub(channel)
            steps = stub.GetStats(pb.GetStatsRequest(), timeout=10).verify_steps
            wait_for(lambda: (lambda s: s.engine_alive and s.verify_steps > steps + 10)(
                stub.GetStats(pb.GetStatsRequest(), timeout=10)), 60, "telemetry again")
        assert engine.poll() is None and sidecar.poll() is None
    finally:
        stop_process(sidecar)
        stop_process(engine)
        sidecar_log.close()
        print((tmp_path / "sidecar.log").read_text()[-2000:], engine_log.read_text()[-1000:])


def test_segment_preallocated(segment_name):
    """16.11: the file's pages exist from creation (a full tmpfs fails there, not with SIGBUS)."""
    segment = Segment.create(segment_name, CONFIG)
    info = os.stat(segment.path)
    assert info.st_blocks * 512 >= segment.layout.total_size
    segment.unlink()


@pytest.mark.skipif(os.geteuid() != 0, reason="a file of another user needs root to chown")
def test_segment_name_taken_by_another_user_is_refused_naming_the_owner(segment_name):
    """16.12: a file or symlink planted at /dev/shm/<name> stops no engine silently."""
    path = f"/dev/shm/{segment_name}"
    with open(path, "w"):
        pass
    os.chown(path, 65534, 65534)
    with pytest.raises(SegmentError, match=r"owned by nobody \(uid 65534\).*choose a segment name"):
        Segment.create(segment_name, CONFIG)
    result = subprocess.run([sys.executable, "-m", "vcap.engine_hook.sim", "--segment", segment_name],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "owned by nobody" in result.stderr and "Traceback" not in result.stderr
    os.unlink(path)
    os.symlink("/tmp/elsewhere", path)
    try:
        with pytest.raises(SegmentError, match="already exists as a symlink"):
            Segment.create(segment_name, CONFIG)
    finally:
        os.unlink(path)


def test_attach_refuses_symlinks_and_warns_on_open_modes(segment_name, caplog):
    """16 (low): O_NOFOLLOW on attach; a segment chmod-ed to 0666 is attached with a warning."""
    segment = Segment.create(segment_name, CONFIG)
    link = f"/dev/shm/{segment_name}-link"
    os.symlink(segment.path, link)
    try:
        with pytest.raises(SegmentError, match="is a symlink"):
            Segment.attach(link)
    finally:
        os.unlink(link)
    os.chmod(segment.path, 0o666)
    with caplog.at_level(logging.WARNING, logger="vcap.sidecar"):
        sidecar = _sidecar(segment_name)
        try:
            wait_for(lambda: sidecar.link.attach_count, 10, "attach")
        finally:
            sidecar.stop()
    assert any("is mode 0666: any local user can change the policy" in r.getMessage() for r in caplog.records)
    segment.unlink()


def test_sidecar_in_the_engines_group_attaches(segment_name):
    """16 (low): a segment of another user shared 0660 with a group of ours is attached (the
    Kubernetes layout: engine root, sidecar non-root in the engine's group); 0600 is not."""
    if os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    segment = Segment.create(segment_name, CONFIG, group=os.getegid())
    os.chown(segment.path, 65534, -1)
    Segment.attach(segment_name).close()
    os.chmod(segment.path, 0o600)
    with pytest.raises(SegmentError, match="not shared with a group of this user"):
        Segment.attach(segment_name)
    segment.unlink()


def test_frozen_engine_is_not_serving(segment_name):
    """16 (low): a SIGSTOPped engine is NOT_SERVING (its pid exists but it does not run)."""
    engine = start_sim(segment_name, "--max-bs", "16", "--layers", "2")
    sidecar = _sidecar(segment_name)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{sidecar.grpc_port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)

            def status():
                return health.Check(health_pb2.HealthCheckRequest(service="vcap.engine"), timeout=10).status
            wait_for(lambda: status() == health_pb2.HealthCheckResponse.SERVING, 30, "engine serving")
            os.kill(engine.pid, signal.SIGSTOP)
            try:
                wait_for(lambda: status() == health_pb2.HealthCheckResponse.NOT_SERVING, 30, "frozen engine seen")
            finally:
                os.kill(engine.pid, signal.SIGCONT)
            wait_for(lambda: status() == health_pb2.HealthCheckResponse.SERVING, 30, "engine serving again")
    finally:
        sidecar.stop()
        stop_process(engine)
