"""Issue 15: one sidecar serves a node whose engine runs attention DP, one segment per DP rank
(``<segment>``, ``<segment>-dp<r>``). Real simulated engines (one process per DP rank, as SGLang's
schedulers are), real shared memory: a DP rank missing at first, late, and restarted; one policy
in every segment; every rank's rings counted under its own ``dp_rank`` label."""

import os
import signal
import subprocess
import sys
import threading
import urllib.request

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from vcap.layout import dp_segment_name
from vcap.policy import Bucket, Policy
from vcap.segment import STATUS_FALLBACK_ACTIVE, RingReader, Segment, SegmentConfig, SegmentError
from vcap.sidecar.app import ENGINE_HEALTH_SERVICE, Sidecar, SidecarConfig
from vcap.sidecar.policy_control import PolicyControl
from vcap.v1 import controller_pb2 as pb
from vcap.v1 import controller_pb2_grpc as pb_grpc

from ._helpers import start_sim, stop_process, wait_for

SIM_ARGS = ("--max-bs", "16", "--mean-bs", "8", "--layers", "4", "--sample-period", "2",
            "--time-scale", "0.2", "--lease-ms", "300", "--dispatch-row-bytes", "1000")
DP_SIZE = 3


@pytest.fixture
def node(segment_name):
    """The base name; every DP rank's segment (and a sidecar's history) is removed after."""
    yield segment_name
    for rank in range(1, DP_SIZE + 1):
        path = f"/dev/shm/{dp_segment_name(segment_name, rank)}"
        if os.path.exists(path):
            os.unlink(path)


def _samples(port: int | str, name: str) -> dict[str, float]:
    """``{labels: value}`` of one family, from the sidecar's exposition (a scrape now, or ``port``
    the text of one)."""
    text = port if isinstance(port, str) else \
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {line[len(name):].rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith(name + "{")}


def _policies(node: str) -> list[tuple]:
    """(policy, generation, source) in force in each DP rank's segment, as its engine reads it."""
    found = []
    for rank in range(DP_SIZE):
        segment = Segment.attach(dp_segment_name(node, rank))
        found.append(segment.read_policy())
        segment.close()
    return found


def test_a_node_with_a_dp_rank_missing_late_and_restarted(node):
    sidecar = Sidecar(SidecarConfig(segment=node, grpc_address="127.0.0.1:0", metrics_address="127.0.0.1:0",
                                    dp_size=DP_SIZE)).start()
    engines = {}
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{sidecar.grpc_port}")
        stub, health = pb_grpc.ControllerStub(channel), health_pb2_grpc.HealthStub(channel)

        def engine_health():
            return health.Check(health_pb2.HealthCheckRequest(service=ENGINE_HEALTH_SERVICE), timeout=10).status

        # DP ranks 0 and 2 start; rank 1 is missing
        for rank in (0, 2):
            engines[rank] = start_sim(dp_segment_name(node, rank), *SIM_ARGS, "--seed", str(rank))
        wait_for(lambda: sidecar.link.ranks[0].attach_count and sidecar.link.ranks[2].attach_count, 20,
                 "ranks 0 and 2 attached")
        assert not sidecar.link.ranks[1].attach_count
        state = stub.GetPolicy(pb.GetPolicyRequest(), timeout=10)
        assert not state.engine_attached   # the node is not whole
        assert engine_health() == health_pb2.HealthCheckResponse.NOT_SERVING
        assert _samples(sidecar.metrics_port, "vcap_engine_attached") == {
            '{dp_rank="0"}': 1, '{dp_rank="1"}': 0, '{dp_rank="2"}': 1}

        # a policy set now is in force in every attached segment, one generation, and pending for rank 1
        bucket = pb.Bucket(min_bs=1, k_min=1, k_max=2, thresholds=[0.3])
        written = stub.SetPolicy(pb.SetPolicyRequest(policy=pb.Policy(mode=pb.MODE_CONF, buckets=[bucket])),
                                 timeout=10)
        assert written.pending and not written.engine_attached
        shown = subprocess.run([sys.executable, "-m", "vcap.sidecar.vcapctl", "--target",
                                f"127.0.0.1:{sidecar.grpc_port}", "get"], capture_output=True, text=True, timeout=60)
        assert "not every DP rank's segment attached" in shown.stdout and "pending" in shown.stdout, shown.stdout
        for rank in (0, 2):
            policy, generation, source = Segment.attach(dp_segment_name(node, rank)).read_policy()
            assert (policy.mode, policy.buckets[0].k_max, generation, source) == ("conf", 2, written.generation,
                                                                                   "manual")
        readers = {rank: RingReader(Segment.attach(dp_segment_name(node, rank)), 0) for rank in (0, 2)}
        for rank, reader in readers.items():
            wait_for(lambda: (reader.read()["generation"] == written.generation).any(), 20,
                     f"rank {rank}'s records carrying the policy")

        # rank 1 starts late: it gets the node's policy, and the node is whole
        engines[1] = start_sim(dp_segment_name(node, 1), *SIM_ARGS, "--seed", "1")
        wait_for(lambda: sidecar.link.attached, 20, "rank 1 attached")
        wait_for(lambda: engine_health() == health_pb2.HealthCheckResponse.SERVING, 20, "engine SERVING")
        state = stub.GetPolicy(pb.GetPolicyRequest(), timeout=10)
        assert state.engine_attached and not state.pending
        in_force = _policies(node)
        assert {(p.mode, p.buckets[0].k_max, g, s) for p, g, s in in_force} == {("conf", 2, state.generation,
                                                                                  "manual")}

        # rank 1's engine dies and restarts: the others keep serving, the new one gets the policy
        first_inode = sidecar.link.ranks[1].segment.inode
        os.kill(engines[1].pid, signal.SIGKILL)
        engines[1].wait(timeout=20)
        wait_for(lambda: engine_health() == health_pb2.HealthCheckResponse.NOT_SERVING, 10, "NOT_SERVING")
        assert _samples(sidecar.metrics_port, "vcap_engine_alive") == {
            '{dp_rank="0"}': 1, '{dp_rank="1"}': 0, '{dp_rank="2"}': 1}
        engines[1] = start_sim(dp_segment_name(node, 1), *SIM_ARGS, "--seed", "11")
        wait_for(lambda: sidecar.link.ranks[1].attach_count == 2, 20, "rank 1 re-attached")
        assert sidecar.link.ranks[1].segment.inode != first_inode
        wait_for(lambda: engine_health() == health_pb2.HealthCheckResponse.SERVING, 20, "SERVING again")
        state = stub.GetPolicy(pb.GetPolicyRequest(), timeout=10)
        in_force = _policies(node)
        assert {(p.mode, p.buckets[0].k_max, g) for p, g, _ in in_force} == {("conf", 2, state.generation)}
        assert state.generation > written.generation   # never reused: rank 1's records tell them apart

        # every rank's telemetry, under its own label; the node's stats add them up
        metrics = sidecar.metrics_port
        wait_for(lambda: all(_samples(metrics, "vcap_dispatch_rows_saved_total").get(f'{{dp_rank="{r}"}}', 0) > 0
                             for r in range(DP_SIZE)), 20, "dispatch savings on every rank")
        assert _samples(metrics, "vcap_engine_attaches_total") == {
            '{dp_rank="0"}': 1, '{dp_rank="1"}': 2, '{dp_rank="2"}': 1}
        scrape = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10).read().decode()
        records = _samples(scrape, "vcap_telemetry_records_total")
        assert set(records) == {f'{{dp_rank="{r}",ring="0"}}' for r in range(DP_SIZE)}
        rows = _samples(scrape, "vcap_dispatch_rows_saved_total")
        saved = _samples(scrape, "vcap_dispatch_bytes_saved_total")
        dead = _samples(scrape, "vcap_verify_rows_total")
        assert set(dead) == {f'{{dp_rank="{r}",state="{s}"}}' for r in range(DP_SIZE) for s in ("live", "dead")}
        for rank in range(DP_SIZE):   # a scrape reads one snapshot per rank: rows and bytes agree
            label = f'{{dp_rank="{rank}"}}'
            assert saved[label] == rows[label] * 1000 and rows[label] > 0
            # a dead row is a row not dispatched in each of the 4 MoE layers
            assert rows[label] == dead[f'{{dp_rank="{rank}",state="dead"}}'] * 4
        totals = {rank: link.totals_snapshot() for rank, link in enumerate(sidecar.link.ranks)}
        stats = stub.GetStats(pb.GetStatsRequest(), timeout=10)
        assert stats.verify_steps >= sum(t.steps for t in totals.values()) > 0
        assert stats.engine_attached and stats.engine_alive
        channel.close()
    finally:
        sidecar.stop()
        for engine in engines.values():
            stop_process(engine)


def _create(node: str, rank: int, config: SegmentConfig) -> Segment:
    return Segment.create(dp_segment_name(node, rank), config)


CONFIG = SegmentConfig(stride=6, max_bs=16, num_moe_layers=2, lease_ms=60_000)


def _policy(threshold: float) -> Policy:
    return Policy(mode="conf", fixed_k=0, buckets=(Bucket(1, 1, 5, (threshold,) * 5),))


def test_a_policy_every_segment_cannot_take_is_written_to_none(node):
    """A truncated DP segment refuses the whole change (UNAVAILABLE at the API): no rank runs a
    policy the others do not."""
    engines = [_create(node, rank, CONFIG) for rank in range(2)]
    control = PolicyControl(node, dp_size=2)
    try:
        for rank, engine in enumerate(engines):
            control.attach(Segment.attach(engine.path), rank)
        first = control.set_policy(_policy(0.2), "manual", "test")
        os.truncate(engines[1].path, 4096)
        with pytest.raises(SegmentError, match="truncated"):
            control.set_policy(_policy(0.7), "manual", "test")
        policy, generation, _ = engines[0].read_policy()
        assert generation == first.generation and policy.buckets[0].thresholds[0] == pytest.approx(0.2)
        assert control.state().generation == first.generation
    finally:
        for engine in engines:
            engine.unlink()


def test_a_reader_of_one_segment_never_sees_a_torn_policy_while_the_node_is_written(node):
    """Each segment is written under its own seqlock: while the write into rank 1 is in flight,
    rank 0's engine reads the new policy whole and rank 1's engine reads none (it keeps its last)."""
    engines = [_create(node, rank, CONFIG) for rank in range(2)]
    entered, release = threading.Event(), threading.Event()
    calls = []

    def pause():
        calls.append(1)
        if len(calls) == 2:   # inside the second segment's write
            entered.set()
            release.wait(10)

    control = PolicyControl(node, write_pause=pause, dp_size=2)
    try:
        for rank, engine in enumerate(engines):
            control.attach(Segment.attach(engine.path), rank)
        writer = threading.Thread(target=control.set_policy, args=(_policy(0.4), "manual", "test"))
        writer.start()
        assert entered.wait(10)
        policy, generation, _ = engines[0].read_policy()
        assert policy.buckets[0].thresholds[0] == pytest.approx(0.4) and generation == 1
        assert engines[1].read_policy() is None   # in flight: the engine keeps its last snapshot
        release.set()
        writer.join(10)
        assert engines[1].read_policy()[1] == 1
    finally:
        release.set()
        for engine in engines:
            engine.unlink()


def test_a_dp_segment_of_another_geometry_is_refused_naming_both(node):
    engines = [_create(node, 0, CONFIG), _create(node, 1, SegmentConfig(stride=6, max_bs=32, num_moe_layers=2))]
    sidecar = Sidecar(SidecarConfig(segment=node, grpc_address="127.0.0.1:0", metrics_address="",
                                    dp_size=2)).start()
    try:
        wait_for(lambda: "differs from DP rank" in sidecar.link.last_error, 10, "the refusal")
        assert sidecar.link.ranks[0].segment is not None or sidecar.link.ranks[1].segment is not None
        assert not sidecar.link.attached
        assert engines[1].path in sidecar.link.last_error or engines[0].path in sidecar.link.last_error
    finally:
        sidecar.stop()
        for engine in engines:
            engine.unlink()


def _sidecar_process(node: str, port: int, log, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "vcap.sidecar.cli", "--segment", node, "--dp-size", "2",
                             "--grpc", f"127.0.0.1:{port}", "--metrics", "", "--state-dir", "", *args],
                            stdout=log, stderr=subprocess.STDOUT)


def test_a_restarted_sidecar_adopts_the_node_policy_in_every_segment(node, tmp_path):
    """A real ``vcap-sidecar --dp-size 2`` beside a two-rank engine is SIGKILLed: every rank's lease
    expires and its engine falls back; the next sidecar adopts the policy in force and every rank
    runs it again, under one generation never used before."""
    from tests.utils import free_port

    engine = start_sim(node, *SIM_ARGS, "--dp-size", "2")
    wait_for(lambda: os.path.exists(f"/dev/shm/{dp_segment_name(node, 1)}"), 20, "rank 1's segment")
    segments = [Segment.attach(dp_segment_name(node, rank)) for rank in range(2)]
    port, log = free_port(), open(tmp_path / "sidecar.log", "w")
    sidecars = [_sidecar_process(node, port, log)]
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.ControllerStub(channel)

            def state():
                try:
                    return stub.GetPolicy(pb.GetPolicyRequest(), timeout=5)
                except grpc.RpcError:
                    return None
            wait_for(lambda: (s := state()) and s.engine_attached, 60, "the node attached", interval=0.1)
            bucket = pb.Bucket(min_bs=1, k_min=1, k_max=3, thresholds=[0.5])
            first = stub.SetPolicy(pb.SetPolicyRequest(policy=pb.Policy(mode=pb.MODE_CONF, buckets=[bucket])),
                                   timeout=10)
            assert [segment.read_policy()[1] for segment in segments] == [first.generation] * 2

            sidecars[0].kill()
            sidecars[0].wait(timeout=20)
            wait_for(lambda: all(s.status_u32[STATUS_FALLBACK_ACTIVE] for s in segments), 20,
                     "every rank on its fallback once the lease expired")

            sidecars.append(_sidecar_process(node, port, log))
            wait_for(lambda: (s := state()) and s.engine_attached, 60, "the node attached again", interval=0.1)
            adopted = state()
            assert (adopted.policy.mode, adopted.source, adopted.policy.buckets[0].k_max) == (
                pb.MODE_CONF, pb.POLICY_SOURCE_MANUAL, 3)
            assert adopted.generation > first.generation
            wait_for(lambda: not any(s.status_u32[STATUS_FALLBACK_ACTIVE] for s in segments), 20,
                     "every rank off its fallback")
            in_force = [segment.read_policy() for segment in segments]
            assert [(p.buckets[0].k_max, g) for p, g, _ in in_force] == [(3, adopted.generation)] * 2
    finally:
        for sidecar in sidecars:
            stop_process(sidecar)
        stop_process(engine)
        log.close()
        print((tmp_path / "sidecar.log").read_text()[-3000:])


def test_every_ranks_records_go_to_the_controller_and_the_recording_and_an_extra_rank_is_reported(node, tmp_path, caplog):
    from vcap.segment import RingWriter, record_dtype
    from vcap.sidecar.recorder import read_recording

    engines = [_create(node, rank, CONFIG) for rank in range(3)]   # rank 2 is beyond --dp-size 2
    sidecar = Sidecar(SidecarConfig(segment=node, grpc_address="127.0.0.1:0", metrics_address="", dp_size=2,
                                    record_file=str(tmp_path / "node.vcaprec")))
    observed = []   # what the controller is fed: (node-wide ring, records)
    observe = sidecar.controller.observe
    sidecar.controller.observe = lambda ring, batch: (observed.append((ring, len(batch))), observe(ring, batch))
    sidecar.start()
    try:
        wait_for(lambda: sidecar.link.attached, 10, "both ranks attached")
        for rank, count in ((0, 7), (1, 5)):
            writer = RingWriter(engines[rank], 0)
            for step in range(count):
                record = np.zeros((), dtype=record_dtype(engines[rank].layout))
                record["step"], record["bs"], record["live"][:1], record["generation"] = step, 1, 6, 10 + rank
                writer.publish(record)
        wait_for(lambda: sidecar.link.records_by_ring == [7, 5], 10, "every record read")
        # rank r's ring 0 is the controller's ring r
        wait_for(lambda: {ring: sum(n for r, n in observed if r == ring) for ring, _ in observed} == {0: 7, 1: 5},
                 10, "every record fed to the controller")
        wait_for(lambda: "runs its fallback policy; give --dp-size" in caplog.text, 10, "the extra rank reported")
    finally:
        sidecar.stop()
        for engine in engines:
            engine.unlink()
    _, records = read_recording(str(tmp_path / "node.vcaprec"))
    assert sorted(records["generation"].tolist()) == [10] * 7 + [11] * 5


def test_a_node_of_a_multi_node_engine_serves_its_slice_of_dp_ranks(node):
    """``--dp-first-rank 2 --dp-size 2``: the second node of a two-node engine with four DP ranks
    serves ``-dp2`` and ``-dp3`` only, and labels them with their global DP rank."""
    engines = [_create(node, rank, CONFIG) for rank in (1, 2, 3)]   # rank 1 is the other node's
    sidecar = Sidecar(SidecarConfig(segment=node, grpc_address="127.0.0.1:0", metrics_address="", dp_size=2,
                                    dp_first_rank=2)).start()
    try:
        wait_for(lambda: sidecar.link.attached, 10, "ranks 2 and 3 attached")
        state = sidecar.control.set_policy(_policy(0.6), "manual", "test")
        assert [engine.read_policy()[1] for engine in engines] == [0, state.generation, state.generation]
        assert engines[0].sidecar_pid[0] == 0   # the other node's rank is not ours
        registry = sidecar.registry
        assert [registry.get_sample_value("vcap_engine_attached", {"dp_rank": str(r)}) for r in (1, 2, 3)] == \
            [None, 1, 1]
    finally:
        sidecar.stop()
        for engine in engines:
            engine.unlink()


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_a_sidecar_that_died_mid_write_leaves_the_node_on_the_newest_policy(node, order):
    """A sidecar killed between two segments' writes left rank 0 a generation ahead; the next one
    adopts the newest policy, whichever rank attaches first, and writes it into both."""
    engines = [_create(node, rank, CONFIG) for rank in range(2)]
    engines[0].write_policy(_policy(0.8), 6, "manual")   # the write the dead sidecar finished
    engines[1].write_policy(_policy(0.1), 5, "manual")   # the one it did not reach
    control = PolicyControl(node, dp_size=2)
    try:
        for rank in order:
            control.attach(Segment.attach(engines[rank].path), rank)
        state = control.state()
        assert state.policy.buckets[0].thresholds[0] == pytest.approx(0.8) and state.generation == 7
        assert [engine.read_policy()[1] for engine in engines] == [7, 7]
        assert [engine.read_policy()[0].buckets[0].thresholds[0] for engine in engines] == pytest.approx([0.8, 0.8])
    finally:
        for engine in engines:
            engine.unlink()
