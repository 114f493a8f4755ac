"""The offline tuner on a SYNTHETIC seed-format log, and the recorder's round trip."""

import argparse

import numpy as np
import pytest

from vcap.engine_hook import reference
from vcap.engine_hook.sim import SimConfig, SimulatedEngine
from vcap.policy import Bucket, Policy
from vcap.segment import Layout
from vcap.sidecar import tune
from vcap.sidecar.recorder import Recorder, read_recording


def _seed_log(path, rng, rows=4000, capped=False):
    confidence = rng.random((rows, 5)).astype(np.float32)
    uncapped = np.cumprod(rng.random((rows, 5)) < confidence, axis=1).sum(axis=1)
    live = np.full(rows, 6)
    if capped:
        live = rng.integers(2, 7, rows)
    accepted = np.minimum(uncapped, live - 1)
    data = np.concatenate([confidence, live[:, None], accepted[:, None]], axis=1).astype("<f4")
    data.tofile(path)
    return confidence, live, accepted


def _args(path, **kw):
    return argparse.Namespace(file=str(path), stride=6, bs=kw.get("bs", "8,64"), max_tokens_given_up=0.1,
                              grid="coarse", plot=None)


def test_tuner_agrees_with_the_reference_rule_by_hand(tmp_path):
    path = tmp_path / "seed.bin"
    confidence, live, accepted = _seed_log(path, np.random.default_rng(0))
    result = tune.run(_args(path))
    assert result["kind"] == "seed" and result["rows"] == len(live)
    for row in (r for r in result["table"] if r["bs"] == 8):
        rule = row["rule"]
        policy = Policy("conf", 5, (Bucket(1, rule.k_min, rule.k_max, rule.thresholds),))
        by_hand = reference.live_lengths(confidence, policy, len(live), 6)
        tokens = np.minimum(accepted, by_hand - 1).mean() + 1
        assert row["tokens"] == pytest.approx(tokens, abs=1e-9)
        assert row["mean_live"] == pytest.approx(by_hand.mean(), abs=1e-9)
        assert row["given_up"] == pytest.approx(accepted.mean() + 1 - tokens, abs=1e-9)


def test_tuner_on_a_censored_log_is_exact_for_shorter_cuts(tmp_path):
    path = tmp_path / "seed.bin"
    confidence, live, accepted = _seed_log(path, np.random.default_rng(1), capped=True)
    result = tune.run(_args(path))
    k1 = next(r for r in result["table"] if r["rule"].k_max == 1 and r["bs"] == 8)
    assert k1["tokens"] == pytest.approx(np.minimum(accepted, 1).mean() + 1, abs=1e-9)


def test_vcapctl_tune_prints_a_recommendation_and_draws_the_front(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from vcap.sidecar import vcapctl
    path = tmp_path / "seed.bin"
    _seed_log(path, np.random.default_rng(2))
    png = tmp_path / "front.png"
    assert vcapctl.main(["tune", str(path), "--bs", "4,32", "--plot", str(png)]) == 0
    out = capsys.readouterr()
    assert "recommended" in out.out and "vcapctl set --bucket 1:" in out.out
    assert "MODELLED" in out.out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_recorder_round_trip_and_tune_reads_it(tmp_path):
    config = SimConfig(max_bs=16, mean_bs=8, num_moe_layers=4, seed=3)  # SYNTHETIC engine
    engine = SimulatedEngine(config)
    layout = Layout(config.segment_config())
    path = tmp_path / "trace.vcaprec"
    recorder = Recorder(str(path), layout)
    written = np.concatenate([engine.step() for _ in range(60)])
    recorder.write(written[:30])
    recorder.write(written[30:])
    recorder.close()
    with open(path, "ab") as f:
        f.write(b"\x01" * 17)  # a torn last record is ignored
    read_config, records = read_recording(str(path))
    assert read_config == config.segment_config()
    assert len(records) == len(written)
    for name in written.dtype.names:
        np.testing.assert_array_equal(records[name], written[name])
    result = tune.run(_args(path, bs="8"))
    assert result["kind"] == "recording" and "measured" in result["cost_source"]
    with pytest.raises(ValueError):
        Recorder(str(path), Layout(SimConfig(max_bs=32, num_moe_layers=4).segment_config()))
