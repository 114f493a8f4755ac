"""What the controller keeps of a batch of records (sidecar/controller/samples.py)."""

import numpy as np
import pytest

from vcap.engine_hook.sim import SimConfig, SimulatedEngine
from vcap.policy import Bucket, Policy
from vcap.segment import FLAG_EXPLORE
from vcap.sidecar.controller.config import ControllerConfig
from vcap.sidecar.controller.goodput import evaluate_rules
from vcap.sidecar.controller.load import BUSY_SHARE, BucketLoad
from vcap.sidecar.controller.model import EngineModel
from vcap.sidecar.controller.samples import observe
from vcap.sidecar.telemetry import unpack


def test_every_row_of_an_exploration_step_reaches_the_calibration_and_the_window_keeps_its_sample():
    # SYNTHETIC: bs 64 under a threshold rule with every 4th step verifying every row
    engine = SimulatedEngine(SimConfig(max_bs=64, mean_bs=64, load_noise=0.0, num_moe_layers=4, num_experts=64,
                                       top_k=4, seed=2))
    engine.set_policy(Policy("conf", 5, (Bucket(1, 1, 5, (0.5,) * 5),), explore_period=4))
    batch = unpack(np.concatenate([engine.step() for _ in range(40)]))
    explore_steps = batch.flagged(FLAG_EXPLORE)
    assert explore_steps.sum() == 10 and (batch.bs == 64).all()
    o = observe(0, batch, rows_per_record=8, rng=np.random.default_rng(0))
    assert o.row_explore.sum() == 10 * 64                       # all of them
    assert (~o.row_explore).sum() == 30 * 8                     # 8 per other record
    assert (o.live[o.row_explore] == 6).all() and (o.live[~o.row_explore] < 6).mean() > 0.5
    # the window: the same 8 per record, exploration steps included
    assert o.row_in_window[~o.row_explore].all() and o.row_in_window[o.row_explore].sum() == 10 * 8
    # a record's rows are a sample of that record, not always its first slots
    kept = observe(0, batch, rows_per_record=8, rng=np.random.default_rng(1))
    assert not np.array_equal(kept.confidence[~kept.row_explore], o.confidence[~o.row_explore])


def _rows_at(mean_bs: int, accept_first: float, steps: int, after_ns: int = 0) -> np.ndarray:
    """SYNTHETIC records of ``steps`` steps at ``mean_bs``, stamped from ``after_ns`` + 1 s on."""
    engine = SimulatedEngine(SimConfig(max_bs=64, mean_bs=mean_bs, load_noise=0.0, num_moe_layers=4, num_experts=64,
                                       top_k=4, accept_first=accept_first, seed=mean_bs))
    engine.set_policy(Policy("conf", 5, (Bucket(1, 1, 5, (0.3,) * 5),), explore_period=8))
    records = np.concatenate([engine.step() for _ in range(steps)])
    records["time_ns"] += after_ns + 10**9
    return records


def _model(config: ControllerConfig, *batches: np.ndarray) -> EngineModel:
    model = EngineModel(SimConfig(max_bs=64, num_moe_layers=4, num_experts=64, top_k=4).segment_config(), config)
    for records in batches:
        model.fold(observe(0, unpack(records), config.rows_per_record, np.random.default_rng(0)))
    return model


def _load(share: float, bs: float) -> BucketLoad:
    return BucketLoad(np.array([bs]), np.array([1.0]), share)


def test_after_the_load_moved_a_bucket_is_judged_on_its_recent_rows_at_its_load():
    # SYNTHETIC: a drain at bs 48, its survivors at bs 4 (first draft accepted less often), then
    # bs 4 with new requests
    drain = _rows_at(48, 0.55, 20)
    survivors = _rows_at(4, 0.55, 100, after_ns=int(drain["time_ns"].max()))
    renewed = _rows_at(4, 0.9, 150, after_ns=int(survivors["time_ns"].max()))
    since = int(renewed["time_ns"].min())
    recent_s = (int(renewed["time_ns"].max()) - since) / 1e9 + 1e-6
    config = ControllerConfig(bucket_rows=400, moved_window_s=recent_s)
    model = _model(config, drain, survivors, renewed)
    confidence, live, accepted, time_ns, bs = model.window_rows()
    assert set(np.unique(bs)) == {4, 48} and (bs == 48).mean() > 1 - config.settled_share   # the load moved
    rules = model.rules

    def on(rows):
        return evaluate_rules(confidence[rows], live[rows], accepted[rows], model.calibration, rules)

    whole, renewed_rows, survivor_rows = on(bs > 0), on(time_ns >= since), on((bs == 4) & (time_ns < since))
    assert (time_ns >= since).sum() >= 400
    k2 = next(i for i, r in enumerate(rules) if (r.k_min, r.k_max) == (2, 2))
    assert renewed_rows.tokens[k2] > whole.tokens[k2] + 0.05 and renewed_rows.tokens[k2] > survivor_rows.tokens[k2] + 0.1

    buckets = dict(zip(model.edges, range(len(model.edges))))
    loads = [_load(0.0, 1.0)] * len(model.edges)
    loads[buckets[4]], loads[buckets[32]] = _load(0.9, 4.0), _load(0.1, 48.0)
    evaluations = model.evaluate_buckets(rules, loads)
    np.testing.assert_array_equal(evaluations[buckets[4]].tokens, renewed_rows.tokens)   # its load, since renewed
    np.testing.assert_array_equal(evaluations[buckets[1]].tokens, whole.tokens)          # idle: the whole window
    np.testing.assert_array_equal(evaluations[buckets[32]].tokens, whole.tokens)         # none of its load lately
    assert model.buckets_on_recent_rows == 1   # the gauge vcap_controller_judged_on_recent_rows
    # the same load on a bucket under BUSY_SHARE of the steps (idle): the whole window
    idle = list(loads)
    idle[buckets[4]] = _load(BUSY_SHARE / 2, 4.0)
    model.evaluate_buckets(rules, idle, recent=True)   # exploration's second reading: not the plan's
    assert model.buckets_on_recent_rows == 1
    np.testing.assert_array_equal(model.evaluate_buckets(rules, idle)[buckets[4]].tokens, whole.tokens)
    assert model.buckets_on_recent_rows == 0
    # too few rows of its own: the whole window
    model.config = ControllerConfig(bucket_rows=int((time_ns >= since).sum()) + 1, moved_window_s=recent_s)
    np.testing.assert_array_equal(model.evaluate_buckets(rules, loads)[buckets[4]].tokens, whole.tokens)


def test_at_a_steady_load_a_bucket_is_judged_on_the_whole_window():
    # SYNTHETIC: bs 4 throughout, its requests renewed: the window's last seconds alone would
    # follow a few requests (and their noise)
    older = _rows_at(4, 0.55, 100)
    newer = _rows_at(4, 0.9, 150, after_ns=int(older["time_ns"].max()))
    recent_s = (int(newer["time_ns"].max()) - int(newer["time_ns"].min())) / 1e9
    model = _model(ControllerConfig(bucket_rows=128, moved_window_s=recent_s), older, newer)
    buckets = dict(zip(model.edges, range(len(model.edges))))
    loads = [_load(0.0, 1.0)] * len(model.edges)
    loads[buckets[4]] = _load(1.0, 4.0)
    whole = model.evaluate(model.rules)
    np.testing.assert_array_equal(model.evaluate_buckets(model.rules, loads)[buckets[4]].tokens, whole.tokens)
    assert model.buckets_on_recent_rows == 0


@pytest.mark.parametrize("field, value", [("bucket_rows", 127), ("settled_share", 1.5), ("moved_window_s", 0.0)])
def test_the_moved_load_settings_are_checked(field, value):
    with pytest.raises(ValueError):
        ControllerConfig(**{field: value})
