"""Bulk aggregation of telemetry records and the Prometheus exposition built from it."""

import shutil
import subprocess
import time
import urllib.request

import numpy as np
import pytest

from vcap.segment import (FLAG_EXPERTS_SAMPLED, FLAG_EXPLORE, Layout, RingWriter, Segment,
                          SegmentConfig, record_dtype)
from vcap.sidecar.app import Sidecar, SidecarConfig
from vcap.sidecar.metrics import METRIC_NAMES
from vcap.sidecar.telemetry import TelemetryTotals, unpack

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


@pytest.mark.prometheus
def test_real_sidecar_exposition_passes_promtool(segment_name):
    """A real sidecar attached to a real segment, fed SYNTHETIC records through the ring."""
    sidecar = Sidecar(SidecarConfig(segment=segment_name, grpc_address="127.0.0.1:0",
                                    metrics_address="127.0.0.1:0")).start()
    segment = Segment.create(segment_name, CONFIG)
    try:
        deadline = time.monotonic() + 5
        while not sidecar.link.attached and time.monotonic() < deadline:
            time.sleep(0.01)
        writer = RingWriter(segment, 0)
        for record in synthetic_records(50, np.random.default_rng(2)):
            writer.publish(record)
        while (sidecar.link.totals is None or sidecar.link.totals_snapshot().steps < 50) and time.monotonic() < deadline:
            time.sleep(0.01)
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
    assert "vcap_verify_steps_total 50.0" in text
