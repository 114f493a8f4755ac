"""Cost fit and expert-union curve on SYNTHETIC samples with known parameters."""

import numpy as np
import pytest

from vcap.engine_hook.workload import Router
from vcap.sidecar.controller.cost_model import ExpertCurve, StepCostFit


def test_step_cost_fit_recovers_a_plus_b_d():
    rng = np.random.default_rng(0)
    experts = rng.uniform(2000, 15000, 500)
    bs = rng.integers(1, 256, 500)
    step_ns = 3.0e6 + 11050.0 * experts + rng.normal(0, 2e4, 500)   # SYNTHETIC: a = 3 ms, b = 11.05 us
    fit = StepCostFit()
    fit.fit(experts, bs, step_ns)
    assert fit.ready and fit.identified
    assert fit.alpha == pytest.approx(3.0e6, rel=0.01)
    assert fit.beta == pytest.approx(11050.0, rel=0.005)
    assert fit.gamma == 0.0
    assert fit.r2 > 0.999


def test_step_cost_fit_without_spread_assumes_proportional_and_says_so():
    fit = StepCostFit()
    fit.fit(np.full(50, 10000.0), np.full(50, 32), np.full(50, 1.2e8))
    assert fit.ready and not fit.identified and fit.r2 == 0.0


# The Zipf-family curve approximates the router's top-k without replacement; at skew 1.5 and a
# handful of rows it underestimates the union by up to ~15% (the tolerance says so).
@pytest.mark.parametrize("skew, tolerance", [(0.0, 0.05), (1.0, 0.06), (1.5, 0.15)])
def test_expert_curve_recovers_the_synthetic_router_union(skew, tolerance):
    rng = np.random.default_rng(3)
    layers, experts = 4, 384
    router = Router(layers, experts, 6, skew, rng)
    rows = np.concatenate([rng.integers(1, 1536, 120)])
    counts = np.stack([router.distinct_per_layer(router.route(int(n), rng)) for n in rows])
    curve = ExpertCurve(layers, experts, 6, 1536)
    curve.fit(rows, counts)
    assert curve.r2 > 0.98
    for n in (6, 48, 192, 768):
        truth = np.mean([router.distinct_per_layer(router.route(n, rng)).sum() for _ in range(8)])
        assert curve.total(n) == pytest.approx(truth, rel=tolerance), n
