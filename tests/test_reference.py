"""The reference rule against cases worked by hand from the original adapter's docstring."""

import numpy as np
import pytest

from vcap.engine_hook.reference import cap_accepted, dead_row_mask, distinct_experts, live_lengths, remap_dead_rows
from vcap.policy import Bucket, InvalidPolicy, Policy, default_policy, resolve, validate
from vcap.sidecar.vcapctl import parse_spec

STRIDE = 6
# per-position survival (not cumulative); running products in the comments
CONF = np.array([
    [0.9, 0.8, 0.5, 0.5, 0.9],   # 0.9 0.72 0.36 0.18 0.162
    [0.4, 0.9, 0.9, 0.9, 0.9],   # 0.4 0.36 0.324 0.2916 0.26244
    [1.0, 1.0, 1.0, 1.0, 1.0],   # 1 1 1 1 1
    [0.1, 1.0, 1.0, 1.0, 1.0],   # 0.1 ...
], dtype=np.float32)


def conf_policy(thresholds, k_min=1, k_max=5, buckets=None):
    return Policy("conf", 1, buckets or (Bucket(1, k_min, k_max, tuple(thresholds)),))


def test_fixed_k():
    for k in range(1, 6):
        live = live_lengths(CONF, Policy("fixed", k, default_policy(5).buckets), 4, STRIDE)
        assert live.tolist() == [1 + k] * 4


def test_off_missing_confidence_and_explore_are_all_live():
    policy = conf_policy([0.5] * 5)
    assert live_lengths(CONF, default_policy(5), 4, STRIDE).tolist() == [6] * 4
    assert live_lengths(None, policy, 4, STRIDE).tolist() == [6] * 4
    assert live_lengths(CONF, policy, 4, STRIDE, explore=True).tolist() == [6] * 4


def test_conf_single_threshold():
    # conf:0.3 -> drafts while the running product stays >= 0.3
    assert live_lengths(CONF, conf_policy([0.3] * 5), 4, STRIDE).tolist() == [1 + 3, 1 + 3, 6, 1 + 1]
    # conf:0.7: request 1 stops at once but k_min = 1 keeps one draft
    assert live_lengths(CONF, conf_policy([0.7] * 5), 4, STRIDE).tolist() == [3, 2, 6, 2]


def test_conf_per_position_thresholds_of_the_seed():
    # conf:0.25,0.25,0.03,0.06 -> thresholds 0, .25, .25, .03, .06 (draft 1 always verified)
    policy = conf_policy([0.0, 0.25, 0.25, 0.03, 0.06])
    assert live_lengths(CONF, policy, 4, STRIDE).tolist() == [6, 6, 6, 2]


def test_k_min_and_k_max_clamp():
    assert live_lengths(CONF, conf_policy([0.95] * 5, k_min=2), 4, STRIDE).tolist() == [3, 3, 6, 3]
    assert live_lengths(CONF, conf_policy([0.0] * 5, k_max=2), 4, STRIDE).tolist() == [3] * 4


def test_bucket_follows_real_batch_size():
    buckets = (Bucket(1, 1, 5, (0.0,) * 5), Bucket(3, 1, 5, (0.99,) * 5))
    policy = conf_policy(None, buckets=buckets)
    assert live_lengths(CONF, policy, 2, STRIDE).tolist() == [6, 6]
    assert live_lengths(CONF, policy, 4, STRIDE).tolist() == [2, 2, 6, 2]


def test_corrupt_policy_values_are_clamped():
    wild = Policy("fixed", 99, default_policy(5).buckets)
    assert live_lengths(CONF, wild, 4, STRIDE).tolist() == [6] * 4
    wild = conf_policy([0.0] * 5, k_min=-4, k_max=77)
    assert live_lengths(CONF, wild, 4, STRIDE).tolist() == [6] * 4
    nan_conf = CONF.copy()
    nan_conf[0, 1] = np.nan
    assert live_lengths(nan_conf, conf_policy([0.1] * 5), 4, STRIDE)[0] == 2


def test_dead_rows_drop_and_anchor():
    live = np.array([2, 6, 1])
    ids = np.arange(18 * 2).reshape(18, 2)
    weights = ids.astype(np.float32) / 10
    dead = dead_row_mask(live, STRIDE)
    assert np.flatnonzero(dead).tolist() == [2, 3, 4, 5, 13, 14, 15, 16, 17]
    dropped_ids, dropped_weights = remap_dead_rows(ids, weights, live, STRIDE, "drop")
    assert (dropped_ids[dead] == -1).all() and (dropped_weights[dead] == 0).all()
    assert (dropped_ids[~dead] == ids[~dead]).all()
    anchor_ids, anchor_weights = remap_dead_rows(ids, weights, live, STRIDE, "anchor")
    assert (anchor_ids[2:6] == ids[0]).all() and (anchor_ids[13:18] == ids[12]).all()
    assert (anchor_weights[13:18] == weights[12]).all()
    assert distinct_experts(dropped_ids) == distinct_experts(ids, ~dead)
    assert distinct_experts(anchor_ids) == distinct_experts(ids, ~dead)
    # padded requests beyond len(live): anchor only
    assert dead_row_mask(live, STRIDE, 24)[18:].tolist() == [False] + [True] * 5
    with pytest.raises(ValueError, match="strategy"):
        remap_dead_rows(ids, weights, live, STRIDE, "zero")


def test_accept_is_capped_at_the_live_drafts():
    assert cap_accepted(np.array([4, 0, 5]), np.array([2, 6, 6])).tolist() == [1, 0, 5]


def test_seed_spec_syntax():
    assert parse_spec("3", 5) == {"mode": "fixed", "fixed_k": 3}
    assert parse_spec("conf:0.25", 5) == {"mode": "conf", "thresholds": (0.25,)}
    assert parse_spec("conf:0.25,0.25,0.03,0.06", 5)["thresholds"] == (0.0, 0.25, 0.25, 0.03, 0.06)
    assert parse_spec("conf:0.2,0.1", 5)["thresholds"] == (0.0, 0.2, 0.1, 0.1, 0.1)
    with pytest.raises(InvalidPolicy, match="--spec"):
        parse_spec("conf:a,b", 5)


@pytest.mark.parametrize("policy, message", [
    (Policy("fast", 1, default_policy(5).buckets), "mode must be one of"),
    (Policy("fixed", 0, default_policy(5).buckets), "fixed k must be in 1..5"),
    (Policy("fixed", 6, default_policy(5).buckets), "fixed k must be in 1..5"),
    (Policy("conf", 1, ()), "1..8 buckets"),
    (Policy("conf", 1, (Bucket(2, 1, 5, (0.1,) * 5),)), "must start at batch size 1"),
    (Policy("conf", 1, (Bucket(1, 1, 5, (0.1,) * 5), Bucket(1, 1, 5, (0.1,) * 5))), "without overlap"),
    (Policy("conf", 1, (Bucket(1, 1, 5, (0.1,) * 5), Bucket(9, 1, 5, (0.1,) * 5),
                        Bucket(4, 1, 5, (0.1,) * 5))), "sorted by min_bs"),
    (Policy("conf", 1, (Bucket(1, 3, 2, (0.1,) * 5),)), "k_min <= k_max"),
    (Policy("conf", 1, (Bucket(1, 1, 6, (0.1,) * 5),)), "k_max <= 5"),
    (Policy("conf", 1, (Bucket(1, 1, 5, (0.1,) * 4),)), "4 thresholds given"),
    (Policy("conf", 1, (Bucket(1, 1, 5, (0.1, 0.1, float("nan"), 0.1, 0.1)),)), "draft 3 must be in"),
    (Policy("conf", 1, (Bucket(1, 1, 5, (0.1, 1.5, 0.1, 0.1, 0.1)),)), "draft 2 must be in"),
    (Policy("conf", 1, (Bucket(1, 1, 5, (0.1, -0.1, 0.1, 0.1, 0.1)),)), "draft 2 must be in"),
    (Policy("off", 1, default_policy(5).buckets, explore_period=-1), "explore period"),
])
def test_invalid_policies_are_named(policy, message):
    with pytest.raises(InvalidPolicy, match=message):
        validate(policy, 5)


def test_resolve_fills_in_engine_dimensions():
    policy = Policy("conf", 1, (Bucket(1, 1, 0, (0.3,)),))
    validate(policy, None)
    resolved = resolve(policy, 5)
    assert resolved.buckets[0] == Bucket(1, 1, 5, (0.3,) * 5)
    validate(resolved, 5)
