"""Bulk aggregation of telemetry records and the Prometheus exposition built from it."""

import shutil
import subprocess
import time
import urllib.request
from dataclasses import replace

import grpc
import numpy as np
import pytest

from vcap.segment import (FLAG_EXPERTS_SAMPLED, FLAG_EXPLORE, Layout, RingWriter, Segment,
                          SegmentConfig, record_dtype)
from vcap.sidecar.app import Sidecar, SidecarConfig
from vcap.sidecar.metrics import METRIC_NAMES
from vcap.sidecar.telemetry import TelemetryTotals, Totals, unpack
from vcap.v1 import controller_pb2 as pb
from vcap.v1 import controller_pb2_grpc as pb_grpc

CONFIG = SegmentConfig(stride=6, max_bs=16, num_moe_layers=4)


def synthetic_records(count, rng):
    """SYNTHETIC records with random batch sizes, live lengths and accepted drafts."""
    records = np.zeros(count, dtype=record_dtype(Layout(CONFIG)))
    records["step"] = np.arange(count)
    records["bs"] = rng.integers(1, 17, count)
    records["live"] = rng.integers(1, 7, (count, 16))
    records["accepted"] = rng.integers(0, 6, (count, 16))
    records["flags"] = np.where(rng.random(count) < 0.5, FLAG_EXPERTS_SAMPLED, 0) | np.where(
        rng.random(count) < 0.1, FLAG_EXPLORE, 0)
    records["experts_all"] = rng.integers(50, 100, (count, 4))
    records["experts_live"] = rng.integers(0, 60, (count, 4))
    records["step_ns"] = rng.integers(1_000_000, 100_000_000, count)
    return records


def test_totals_equal_a_per_request_loop():
    rng = np.random.default_rng(1)
    records = synthetic_records(200, rng)
    telemetry = TelemetryTotals(6, 4)
    telemetry.add(unpack(records[:77]))
    telemetry.add(unpack(records[77:]))
    totals = telemetry.snapshot()
    live_rows = dead_rows = accepted_sum = at_cap = 0
    verified, accepted_at = np.zeros(5, int), np.zeros(5, int)
    saved = np.zeros(4, int)
    for record in records:
        for b in range(record["bs"]):
            live, accepted = int(record["live"][b]), min(int(record["accepted"][b]), int(record["live"][b]) - 1)
            live_rows += live
            dead_rows += 6 - live
            accepted_sum += accepted
            at_cap += live < 6 and accepted == live - 1
            for position in range(1, 6):
                verified[position - 1] += live > position and accepted >= position - 1
                accepted_at[position - 1] += accepted >= position
        if record["flags"] & FLAG_EXPERTS_SAMPLED:
            saved += record["experts_all"] - np.minimum(record["experts_live"], record["experts_all"])
    assert (totals.rows_live, totals.rows_dead) == (live_rows, dead_rows)
    assert totals.drafts_accepted == accepted_sum and totals.accepts_at_cap == at_cap
    assert totals.position_verified.tolist() == verified.tolist()
    assert totals.position_accepted.tolist() == accepted_at.tolist()
    assert totals.layer_saved.tolist() == saved.tolist()
    assert totals.explore_steps == int(((records["flags"] & FLAG_EXPLORE) != 0).sum())
    assert totals.live_counts.sum() == records["bs"].sum()


def test_dispatch_saved_counts_dead_rows_per_layer_only_with_a_row_size():
    rng = np.random.default_rng(3)
    records = synthetic_records(120, rng)
    dead = sum(int((6 - records["live"][i, :records["bs"][i]].clip(1, 6)).sum()) for i in range(120))
    counted = TelemetryTotals(6, 4, dispatch_row_bytes=7296)
    counted.add(unpack(records[:50]))
    counted.add(unpack(records[50:]))
    totals = counted.snapshot()
    assert totals.rows_dead == dead and dead > 0
    assert (totals.dispatch_rows_saved, totals.dispatch_bytes_saved) == (dead * 4, dead * 4 * 7296)
    uncounted = TelemetryTotals(6, 4)   # a TP MoE, or a row size nobody stated: nothing claimed
    uncounted.add(unpack(records))
    assert (uncounted.snapshot().dispatch_rows_saved, uncounted.snapshot().dispatch_bytes_saved) == (0, 0)


def test_node_totals_add_the_ranks_up():
    rng = np.random.default_rng(4)
    first, second = synthetic_records(40, rng), synthetic_records(30, rng)
    second["generation"], first["generation"] = 3, 5
    ranks = [Totals.of(unpack(first), 4, 100), Totals.of(unpack(second), 4, 100)]
    node = Totals.of_ranks(ranks)
    both = Totals.of(unpack(np.concatenate([first, second])), 4, 100)
    for name in ("steps", "requests", "rows_live", "rows_dead", "drafts_accepted", "dispatch_rows_saved",
                 "dispatch_bytes_saved"):
        assert getattr(node, name) == getattr(both, name), name
    assert node.layer_saved.tolist() == both.layer_saved.tolist()
    assert node.last_bs == int(first["bs"][-1]) + int(second["bs"][-1])   # the node's batch
    assert node.last_generation == 3   # the oldest generation a rank still runs


@pytest.mark.prometheus
def test_real_sidecar_exposition_passes_promtool(segment_name):
    """A real sidecar attached to a real segment, fed SYNTHETIC records through the ring."""
    sidecar = Sidecar(SidecarConfig(segment=segment_name, grpc_address="127.0.0.1:0",
                                    metrics_address="127.0.0.1:0")).start()
    segment = Segment.create(segment_name, replace(CONFIG, dispatch_row_bytes=7296))
    records = synthetic_records(50, np.random.default_rng(2))
    try:
        deadline = time.monotonic() + 5
        while not sidecar.link.attached and time.monotonic() < deadline:
            time.sleep(0.01)
        writer = RingWriter(segment, 0)
        for record in records:
            writer.publish(record)
        while (sidecar.link.totals is None or sidecar.link.totals_snapshot().steps < 50) and time.monotonic() < deadline:
            time.sleep(0.01)
        # the calibration metrics need the controller to have folded rows in (its tick, every 0.5 s)
        model = lambda: sidecar.controller.model   # noqa: E731
        while (model() is None or not model().window.count) and time.monotonic() < deadline + 10:
            time.sleep(0.01)
        # the last rejection's time needs one refused policy
        with grpc.insecure_channel(f"127.0.0.1:{sidecar.grpc_port}") as channel:
            with pytest.raises(grpc.RpcError):
                pb_grpc.ControllerStub(channel).SetPolicy(
                    pb.SetPolicyRequest(policy=pb.Policy(mode=pb.MODE_FIXED, fixed_k=99)), timeout=10)
        text = urllib.request.urlopen(f"http://127.0.0.1:{sidecar.metrics_port}/metrics").read().decode()
    finally:
        sidecar.stop()
        segment.unlink()
    result = subprocess.run([shutil.which("promtool"), "check", "metrics"], input=text,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    families = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
    exported = {name for name in families if name.startswith("vcap_")}
    listed = {name.removesuffix("_total") if name.removesuffix("_total") in exported else
              name.removesuffix("_info") if name.removesuffix("_info") in exported else name
              for name in METRIC_NAMES}
    assert exported == listed, exported ^ listed
    assert 'vcap_verify_steps_total{dp_rank="0"} 50.0' in text
    # every dead row of every step is a row not dispatched, in each of the 4 MoE layers
    bs = records["bs"].astype(int)
    dead = sum(int((6 - records["live"][i, :bs[i]].clip(1, 6)).sum()) for i in range(50))
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vcap_dispatch")}
    assert samples == {'vcap_dispatch_rows_saved_total{dp_rank="0"}': dead * 4,
                       'vcap_dispatch_bytes_saved_total{dp_rank="0"}': dead * 4 * 7296,
                       'vcap_dispatch_row_bytes{dp_rank="0"}': 7296}


def test_the_heads_calibration_error_is_over_bins_of_its_own_confidence():
    """A head whose draft-2 confidence (0.5) is right on average is calibrated there, although
    the running product splits its rows into a cell that always accepts and one that never does."""
    from types import SimpleNamespace

    from vcap.sidecar.controller.calibration import AcceptanceCalibration
    from vcap.sidecar.controller.samples import SampleRing
    from vcap.sidecar.metrics import calibration_report

    rows, drafts = 400, 2
    confidence = np.full((rows, drafts), 0.5, dtype=np.float32)
    confidence[:, 0] = np.where(np.arange(rows) % 2 == 0, 0.95, 0.35)
    accepted = np.where(np.arange(rows) % 2 == 0, 2, 1)       # draft 1 always, draft 2 on the first half
    live = np.full(rows, drafts + 1)
    window = SampleRing(1000, ((drafts,), np.float32), ((), np.int64), ((), np.int64), ((), np.int64))
    window.add(confidence, live, accepted, np.zeros(rows, dtype=np.int64))
    calibration = AcceptanceCalibration(drafts, num_bins=10)
    calibration.update(confidence, live, accepted)
    report = calibration_report(SimpleNamespace(model=SimpleNamespace(calibration=calibration, window=window)))
    # position 1: confidence 0.95 and 0.35 against acceptance 1: 0.05 and 0.65, half the drafts each;
    # position 2: one cell of confidence 0.5 with acceptance 0.5
    assert report["head_error"] == pytest.approx((200 * 0.05 + 200 * 0.65 + 400 * 0.0) / 800, abs=1e-6)
    # the controller's own cells split position 2 by the running product and predict both right
    assert report["error"] < 0.05


def test_calibration_predicted_observed_and_error_by_their_definition():
    """Issue 14.11: on a window of known rows, observed is the share of observed drafts accepted,
    predicted the calibration's mean for them, the errors the draft-weighted |predicted - observed|
    over the calibration's cells (error) and over (position, bin of the head's confidence)
    (head_error)."""
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry

    from vcap.sidecar.controller.calibration import AcceptanceCalibration
    from vcap.sidecar.controller.samples import SampleRing
    from vcap.sidecar.metrics import CALIBRATION_METRICS, SourceCollector, calibration_report

    rows, drafts = 400, 3
    confidence = np.full((rows, drafts), 0.9, dtype=np.float32)
    confidence[rows // 2:, 0] = 0.2                      # two confidence bins at position 1
    live = np.full(rows, drafts + 1)
    live[:100] = 2                                       # capped at one draft: 2 and 3 unobserved
    accepted = np.tile([0, 1, 2, 3], rows // 4)          # 0..3 accepted, then capped by live
    calibration = AcceptanceCalibration(drafts, num_bins=10)
    controller = SimpleNamespace(model=None)
    assert calibration_report(controller) is None
    window = SampleRing(1000, ((drafts,), np.float32), ((), np.int64), ((), np.int64), ((), np.int64))
    window.add(confidence, live, accepted, np.zeros(rows, dtype=np.int64))
    calibration.update(confidence, live, accepted)
    controller.model = SimpleNamespace(calibration=calibration, window=window)
    report = calibration_report(controller)

    capped = np.minimum(accepted, live - 1)
    for position in (1, 2, 3):
        observed = (live - 1 >= position) & (capped >= position - 1)
        success = observed & (capped >= position)
        assert report["drafts"][position] == observed.sum()
        assert report["observed"][position] == pytest.approx(success.sum() / observed.sum())
        assert 0.0 <= report["predicted"][position] <= 1.0
        assert report["head"][position] == pytest.approx(confidence[observed, position - 1].mean())
    # SYNTHETIC rows: the head says 0.9 at positions 2 and 3, the rows accept far less
    assert report["head"][2] > report["observed"][2] + 0.2
    # a calibration fit on these very rows predicts them closely; the raw 0.9 does not
    assert report["error"] < 0.05
    head = 0.0
    for position in (1, 2, 3):
        observed = (live - 1 >= position) & (capped >= position - 1)
        success = observed & (capped >= position)
        for value in np.unique(confidence[:, position - 1]):
            cell = observed & (confidence[:, position - 1] == value)
            if cell.any():
                head += cell.sum() * abs(float(value) - success[cell].mean())
    total = sum(report["drafts"].values())
    assert report["head_error"] == pytest.approx(head / total, rel=1e-6)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(SourceCollector(CALIBRATION_METRICS, lambda: calibration_report(controller)))
    assert registry.get_sample_value("vcap_controller_acceptance_observed", {"position": "2"}) == \
        pytest.approx(report["observed"][2])
    assert registry.get_sample_value("vcap_controller_confidence_mean", {"position": "1"}) == \
        pytest.approx(report["head"][1])
    assert registry.get_sample_value("vcap_controller_calibration_observed_drafts", {"position": "1"}) == \
        report["drafts"][1]
    assert registry.get_sample_value("vcap_controller_calibration_error") == pytest.approx(report["error"])
    assert registry.get_sample_value("vcap_controller_confidence_calibration_error") == \
        pytest.approx(report["head_error"])
