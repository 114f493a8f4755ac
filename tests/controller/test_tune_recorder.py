"""The offline tuner on a SYNTHETIC seed-format log, and the recorder's round trip, size and rotation."""

import argparse
import os

import numpy as np
import pytest

from vcap.engine_hook import reference
from vcap.engine_hook.sim import SimConfig, SimulatedEngine
from vcap.policy import Bucket, Policy
from vcap.segment import FLAG_EXPERTS_SAMPLED, Layout
from vcap.sidecar import tune
from vcap.sidecar.recorder import Recorder, encode_chunk, read_recording, recording_files


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
    assert "recommended" in out.out and "vcapctl set --mode conf --explore-period 0 --bucket 1:" in out.out
    assert "MODELLED" in out.out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def _sim_records(steps, seed=3, **kw):
    config = SimConfig(**{"max_bs": 16, "mean_bs": 8, "num_moe_layers": 4, "seed": seed, **kw})  # SYNTHETIC engine
    engine = SimulatedEngine(config)
    return config, Layout(config.segment_config()), np.concatenate([engine.step() for _ in range(steps)])


def _assert_same_readings(records, written):
    """Equal in every field tune and the controller read: rows past bs and unsampled expert counts
    are not kept."""
    for name in ("step", "time_ns", "step_ns", "bs", "generation", "flags", "mode", "num_queued"):
        np.testing.assert_array_equal(records[name], written[name])
    real = np.arange(written["confidence"].shape[1])[None, :] < written["bs"][:, None].astype(np.int64)
    for name in ("confidence", "live", "accepted"):
        np.testing.assert_array_equal(records[name][real], written[name][real])
    sampled = (written["flags"] & FLAG_EXPERTS_SAMPLED) != 0
    assert sampled.any()
    for name in ("experts_all", "experts_live"):
        np.testing.assert_array_equal(records[name][sampled], written[name][sampled])


def test_recorder_round_trip_and_tune_reads_it(tmp_path):
    config, layout, written = _sim_records(1500)
    path = tmp_path / "trace.vcaprec"
    recorder = Recorder(str(path), layout)
    recorder.write(written[:1100])   # one chunk written, the rest buffered
    recorder.write(written[1100:])
    recorder.close()
    with open(path, "ab") as f:
        f.write(b"VCH2" + b"\x01" * 17)  # a torn last chunk is ignored
    read_config, records = read_recording(str(path))
    assert read_config == config.segment_config()
    assert len(records) == len(written)
    _assert_same_readings(records, written)
    result = tune.run(_args(path, bs="8"))
    assert result["kind"] == "recording" and "measured" in result["cost_source"]
    assert result["rows"] == int(written["bs"].sum())
    with pytest.raises(ValueError):
        Recorder(str(path), Layout(SimConfig(max_bs=32, num_moe_layers=4).segment_config()))


def test_a_slow_engine_s_steps_reach_the_file_without_waiting_for_a_full_chunk(tmp_path):
    # found by an outside review: at low load nothing reached the file for minutes (1,024-step
    # chunks), and `vcapctl tune` said "no records". flush_s 0: every write is a chunk
    config, layout, written = _sim_records(40)
    path = tmp_path / "trace.vcaprec"
    recorder = Recorder(str(path), layout, flush_s=0.0)
    recorder.write(written[:25])
    _assert_same_readings(read_recording(str(path))[1], written[:25])   # before close
    recorder.write(written[25:])
    assert len(read_recording(str(path))[1]) == 40
    recorder.close()
    buffered = Recorder(str(tmp_path / "default.vcaprec"), layout)   # 10 s: the same writes stay buffered
    buffered.write(written)
    assert buffered.records_written == 0
    buffered.close()
    assert buffered.records_written == 40


def test_recording_bytes_per_step_are_bounded(tmp_path):
    # The ring record is sized for max_bs = 256 rows; a step keeps only its real rows, compressed.
    config, layout, written = _sim_records(2048, max_bs=256, mean_bs=32, num_moe_layers=43)
    path = tmp_path / "trace.vcaprec"
    recorder = Recorder(str(path), layout)
    recorder.write(written)
    recorder.close()
    per_step = os.path.getsize(path) / len(written)
    per_request = 22  # float32 confidence of 5 drafts, live and accepted: before compression
    assert per_step < 64 + per_request * written["bs"].mean()
    assert per_step < layout.record_size / 6
    _assert_same_readings(read_recording(str(path))[1], written)


def test_recording_rotates_by_size_and_tune_reads_every_file(tmp_path):
    config, layout, written = _sim_records(8 * 1024, seed=5)
    max_bytes = int(2.5 * len(encode_chunk(written[:1024])))   # two chunks of 1,024 steps per file
    path = tmp_path / "trace.vcaprec"
    recorder = Recorder(str(path), layout, max_bytes=max_bytes, keep=2)
    for start in range(0, len(written), 512):
        recorder.write(written[start:start + 512])
    recorder.close()
    assert recorder.rotations >= 3
    files = recording_files(str(path))
    assert files == [f"{path}.2", f"{path}.1", str(path)]
    assert not os.path.exists(f"{path}.3")   # keep=2: the oldest is deleted
    assert all(os.path.getsize(f) <= max_bytes for f in files)
    kept = np.concatenate([read_recording(f)[1] for f in files])
    _assert_same_readings(kept, written[-len(kept):])   # the newest steps, in order
    result = tune.run(_args(path, bs="8"))
    assert result["files"] == files
    assert result["rows"] == int(kept["bs"].clip(max=16).sum())


def test_tune_keeps_an_explicit_bound_and_the_controllers_modelled_cost(tmp_path, monkeypatch):
    from vcap.sidecar.controller import ControllerConfig
    from vcap.sidecar.controller import cost_model
    # the live controller has a model-error guardrail and no bound by default; the tuner has
    # no such test and keeps 0.1
    assert ControllerConfig().max_tokens_given_up == float("inf")
    assert tune.build_parser().parse_args(["x"]).max_tokens_given_up == 0.1
    assert tune.MODELLED_COST is cost_model.MODELLED_COST and tune.MODELLED_ROW_US == cost_model.MODELLED_ROW_US
    curve, cost, source = tune._cost_model({"kind": "seed", "config": None}, 6)
    a, b, other = cost_model.MODELLED_COST
    assert cost.alpha == pytest.approx((43 * a + other * 1e3) * 1e3) and cost.beta == pytest.approx(b * 1e3)
    assert cost.delta == pytest.approx(cost_model.MODELLED_ROW_US * 43 * 1e3) and "MODELLED" in source
    monkeypatch.setattr(tune, "MODELLED_COST", (10.0, 5.0, 1.0))
    _, cost, _ = tune._cost_model({"kind": "seed", "config": None}, 6)
    assert cost.beta == pytest.approx(5e3)


def test_tune_on_a_recording_measures_the_live_rows_cost(tmp_path):
    # SYNTHETIC engine with a per-live-row MoE cost, a capping policy with exploration steps
    config = SimConfig(max_bs=16, mean_bs=16, num_moe_layers=4, num_experts=16, top_k=4, seed=5,
                       moe_row_us=50.0, expert_sample_period=1)
    engine = SimulatedEngine(config)
    engine.set_policy(Policy("conf", 5, (Bucket(1, 1, 5, (0.3,) * 5),), explore_period=4))
    records = np.concatenate([engine.step() for _ in range(400)])
    path = tmp_path / "rec.vcap"
    recorder = Recorder(str(path), Layout(config.segment_config()))
    recorder.write(records)
    recorder.close()
    curve, cost, source = tune._cost_model(tune.load_trace(str(path)), 6)
    assert cost.rows_identified and cost.delta == pytest.approx(50.0 * 4 * 1e3, rel=0.05), source
    assert "live rows" in source
