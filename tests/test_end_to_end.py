"""The README's main job, end to end: ``vcap-sidecar --simulate``, ``vcapctl set``, and a real
Prometheus scraping the sidecar. The engine is the simulated one (SYNTHETIC workload)."""

import json
import shutil
import subprocess
import sys
import urllib.parse
import urllib.request

import grpc
import pytest

from vcap.segment import RingReader, Segment
from vcap.v1 import controller_pb2 as pb
from vcap.v1 import controller_pb2_grpc as pb_grpc

from .utils import free_port, wait_until


def _query(port, expr):
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    reply = json.load(urllib.request.urlopen(url, timeout=5))
    return [float(r["value"][1]) for r in reply["data"]["result"]]


@pytest.fixture
def simulated(segment_name, tmp_path):
    grpc_port, metrics_port = free_port(), free_port()
    log = open(tmp_path / "sidecar.log", "w")
    process = subprocess.Popen(
        [sys.executable, "-m", "vcap.sidecar.cli", "--simulate", "--segment", segment_name,
         "--grpc", f"127.0.0.1:{grpc_port}", "--metrics", f"127.0.0.1:{metrics_port}",
         "--", "--time-scale", "0.05", "--mean-bs", "8", "--log-every", "0"],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        yield segment_name, grpc_port, metrics_port
    finally:
        process.terminate()
        process.wait(timeout=20)
        log.close()
        print((tmp_path / "sidecar.log").read_text()[-3000:])


@pytest.mark.prometheus
def test_threshold_change_reaches_engine_and_prometheus(simulated, tmp_path):
    segment_name, grpc_port, metrics_port = simulated
    prometheus_port = free_port()
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: vcap\n    static_configs: [{{targets: ['127.0.0.1:{metrics_port}']}}]\n")
    prometheus = subprocess.Popen(
        [shutil.which("prometheus"), f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prometheus_port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = pb_grpc.ControllerStub(channel)
            wait_until(lambda: stub.GetPolicy(pb.GetPolicyRequest()).engine_attached, 30, "engine attached",
                       ignore=(OSError, grpc.RpcError))
        engine = Segment.attach(segment_name)
        ring = RingReader(engine, 0)
        result = subprocess.run(
            [sys.executable, "-m", "vcap.sidecar.vcapctl", "--target", f"127.0.0.1:{grpc_port}",
             "set", "--threshold", "0.4", "--reason", "end-to-end test"],
            capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, result.stderr
        steps_at_write = int(engine.status_u64[0])  # the engine's step counter
        generation = int(result.stdout.split("generation:")[1].split()[0])
        assert generation >= 1 and engine.read_policy()[1] == generation

        # the engine's records carry the new generation within a few steps of the write
        first_new_step = []

        def new_generation_seen():
            records = ring.read()
            first_new_step.extend(records["step"][records["generation"] == generation].tolist())
            return first_new_step
        wait_until(new_generation_seen, 30, "records with the new generation")
        assert first_new_step[0] <= steps_at_write + 5

        wait_until(lambda: _query(prometheus_port, "vcap_experts_saved_total"), 30, "first scrape")
        first = _query(prometheus_port, "vcap_experts_saved_total")[0]
        wait_until(lambda: _query(prometheus_port, "vcap_experts_saved_total")[0] > first, 30,
              "vcap_experts_saved_total growing")
        assert _query(prometheus_port, "vcap_policy_generation") == [generation]
        assert _query(prometheus_port, 'vcap_verify_rows_total{state="dead"}')[0] > 0

        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics").read().decode()
        check = subprocess.run([shutil.which("promtool"), "check", "metrics"], input=text,
                               capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
    finally:
        prometheus.terminate()
        prometheus.wait(timeout=20)
