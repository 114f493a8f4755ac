"""The simulator's SYNTHETIC tiled per-row MoE cost (moe_row_tile), which the controller's
held-out trace sat-bs256-tiles-uniform uses."""

import numpy as np

from vcap.engine_hook.sim import SimConfig, SimulatedEngine
from vcap.policy import Bucket, Policy, default_policy


def _mean_step_ms(k: int, tile: int, steps: int = 12) -> float:
    engine = SimulatedEngine(SimConfig(max_bs=256, mean_bs=256, load_noise=0.0, router_skew=0.0, moe_row_us=1.7,
                                       moe_row_tile=tile, num_moe_layers=4, seed=3))
    engine.set_policy(default_policy(5) if k == 5 else Policy("fixed", k, (Bucket(1, 1, 5, (0.0,) * 5),)))
    return float(np.mean([engine.step()[0]["step_ns"] for _ in range(steps)])) / 1e6


def test_a_tile_of_one_pair_is_the_linear_row_cost():
    assert abs(_mean_step_ms(2, 1) - _mean_step_ms(2, 0)) < 1e-3


def test_tiles_make_the_row_cost_flat_below_a_tile_and_never_cheaper_than_linear():
    linear = {k: _mean_step_ms(k, 0) for k in (1, 2, 5)}
    tiled = {k: _mean_step_ms(k, 16) for k in (1, 2, 5)}
    assert all(tiled[k] >= linear[k] - 1e-6 for k in linear)
    # at bs 256 over 384 experts k=1 and k=2 both fill about one tile per expert: nearly the same cost
    assert tiled[2] - tiled[1] < 0.5 * (linear[2] - linear[1])
