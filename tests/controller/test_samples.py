"""What the controller keeps of a batch of records (sidecar/controller/samples.py)."""

import numpy as np

from vcap.engine_hook.sim import SimConfig, SimulatedEngine
from vcap.policy import Bucket, Policy
from vcap.segment import FLAG_EXPLORE
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
