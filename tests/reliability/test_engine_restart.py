"""Issue 7.2: the engine dies (SIGKILL, its segment left behind) and a new one starts. The
sidecar notices (ring stops, pid gone), says so in health (``vcap.engine`` NOT_SERVING) and
metrics (``vcap_engine_alive 0``), and re-attaches to the new engine's segment, writing the
policy it holds into it."""

import os
import signal
import urllib.request

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from vcap.segment import RingReader, Segment
from vcap.sidecar.app import ENGINE_HEALTH_SERVICE, Sidecar, SidecarConfig
from vcap.v1 import controller_pb2 as pb
from vcap.v1 import controller_pb2_grpc as pb_grpc

from ._helpers import start_sim, stop_process, wait_for

SIM_ARGS = ("--max-bs", "16", "--mean-bs", "8", "--layers", "4", "--sample-period", "2",
            "--time-scale", "0.2", "--lease-ms", "300")


def _metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exposed")


def test_engine_killed_and_restarted(segment_name):
    sidecar = Sidecar(SidecarConfig(segment=segment_name, grpc_address="127.0.0.1:0",
                                    metrics_address="127.0.0.1:0")).start()
    engines = []
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{sidecar.grpc_port}")
        health = health_pb2_grpc.HealthStub(channel)
        stub = pb_grpc.ControllerStub(channel)

        def engine_health():
            return health.Check(health_pb2.HealthCheckRequest(service=ENGINE_HEALTH_SERVICE),
                                timeout=10).status

        engines.append(start_sim(segment_name, *SIM_ARGS))
        wait_for(lambda: sidecar.link.attach_count == 1, 20, "first attach")
        bucket = pb.Bucket(min_bs=1, k_min=1, k_max=2, thresholds=[0.3])
        state = stub.SetPolicy(pb.SetPolicyRequest(policy=pb.Policy(mode=pb.MODE_CONF, buckets=[bucket])),
                               timeout=10)
        wait_for(lambda: engine_health() == health_pb2.HealthCheckResponse.SERVING, 20, "engine SERVING")
        assert _metric(sidecar.metrics_port, "vcap_engine_alive") == 1
        wait_for(lambda: sidecar.link.records_by_ring[0] > 50, 20, "records flowing")

        first_inode = sidecar.link.segment.inode
        os.kill(engines[0].pid, signal.SIGKILL)
        engines[0].wait(timeout=20)
        assert os.path.exists(f"/dev/shm/{segment_name}")  # a crash leaves the segment behind
        wait_for(lambda: engine_health() == health_pb2.HealthCheckResponse.NOT_SERVING, 10,
                 "engine NOT_SERVING after the kill")
        assert _metric(sidecar.metrics_port, "vcap_engine_alive") == 0
        stats = stub.GetStats(pb.GetStatsRequest(), timeout=10)
        assert not stats.engine_alive
        records = sidecar.link.records_by_ring[0]
        wait_for(lambda: sidecar.stats().steps_per_second == 0, 15, "the step rate to drop to 0")
        assert sidecar.link.records_by_ring[0] == records  # the ring stopped
        # the sidecar keeps serving while the engine is away
        assert stub.GetPolicy(pb.GetPolicyRequest(), timeout=10).generation == state.generation

        engines.append(start_sim(segment_name, *SIM_ARGS, "--seed", "1"))
        wait_for(lambda: sidecar.link.attach_count == 2, 20, "re-attach to the new engine")
        assert sidecar.link.segment.inode != first_inode
        wait_for(lambda: engine_health() == health_pb2.HealthCheckResponse.SERVING, 20, "engine SERVING again")
        assert _metric(sidecar.metrics_port, "vcap_engine_alive") == 1
        assert _metric(sidecar.metrics_port, "vcap_engine_attaches_total") == 2
        # the policy it held is written into the new engine's control block, a new generation
        new_segment = Segment.attach(segment_name)
        policy, generation, source = new_segment.read_policy()
        assert (policy.mode, source) == ("conf", "manual") and generation > state.generation
        assert policy.buckets[0].thresholds == (float(np.float32(0.3)),) * 5 and policy.buckets[0].k_max == 2
        ring = RingReader(new_segment, 0)
        wait_for(lambda: (ring.read()["generation"] == generation).any(), 20,
                 "the new engine's records carrying the policy")
        channel.close()
    finally:
        sidecar.stop()
        for engine in engines:
            stop_process(engine)
