"""The step kernels (``kernels.py``) against ``reference.live_lengths``: live lengths and step
info from a staged control block, every value clamped. Under Triton's interpreter on a CPU,
natively on a GPU."""
import random

import numpy as np
import pytest
import torch

from vcap.engine_hook import reference
from vcap.engine_hook._writer import policy_for
from vcap.engine_hook.buffers import INFO_BS, INFO_CONTROL, INFO_FLAGS, INFO_GENERATION, INFO_MODE, STAGED_HEAD
from vcap.policy import Bucket, Policy
from vcap.segment import (CONTROL_FALLBACK, CONTROL_LIVE, CONTROL_MODE, FLAG_CONF_MISSING, FLAG_EXPLORE,
                          FLAG_FALLBACK, FLAG_GUARD_VIOLATION, MODE_OFF)

FIXED_1 = Policy("fixed", 1, (Bucket(1, 1, 5, (0.0,) * 5),))


@pytest.mark.parametrize("max_bs,stride", [(8, 6), (12, 6), (3, 4)])
def test_live_lengths_match_the_reference(step_rig, device, max_bs, stride):
    rig = step_rig(max_bs, stride)
    for generation in range(1, 12):
        policy = policy_for(generation, stride - 1, rig.segment.config.max_buckets)
        policy = Policy(policy.mode, policy.fixed_k, policy.buckets, 0)
        confidence = torch.rand(max_bs, stride - 1) ** random.choice([0.2, 1.0])
        confidence[0, 0] = float("nan")
        bs, present = random.randint(1, max_bs), generation % 5 != 0
        live, info = rig.step(rig.staged(policy, generation, bs, present), confidence.to(device) if present else None)
        want = reference.live_lengths(confidence.numpy() if present else None, policy, bs, stride)
        np.testing.assert_array_equal(live[:bs], want)
        assert (live[bs:] == 1).all()
        assert (info[INFO_GENERATION], info[INFO_BS], info[INFO_CONTROL]) == (generation, bs, CONTROL_LIVE)
        assert bool(info[INFO_FLAGS] & FLAG_CONF_MISSING) == (not present)


def test_corrupt_values_are_clamped(step_rig, device):
    rig = step_rig(5, 6)
    ones = torch.ones(5, 5, device=device)
    policy = Policy("conf", 99, (Bucket(-4, -3, 77, (0.0,) * 5),))
    live, _ = rig.step(rig.staged(policy, 1, 5), ones)
    np.testing.assert_array_equal(live, reference.live_lengths(np.ones((5, 5)), policy, 5, 6))
    live, _ = rig.step(rig.staged(Policy("fixed", 99, FIXED_1.buckets), 2, 2), ones)
    assert live.tolist() == [6, 6, 1, 1, 1]
    staged = rig.staged(FIXED_1, 3, 3)
    staged[STAGED_HEAD + CONTROL_MODE] = 7  # unknown mode: every row live
    live, info = rig.step(staged, ones)
    assert live.tolist() == [6, 6, 6, 1, 1] and info[INFO_MODE] == MODE_OFF
    live, info = rig.step(rig.staged(FIXED_1, 3, 99), ones)  # bs beyond max_bs
    assert info[INFO_BS] == 5 and live.tolist() == [2] * 5


def test_explore_and_fallback_steps(step_rig, device):
    rig = step_rig(2, 6)
    ones = torch.ones(2, 5, device=device)
    live, info = rig.step(rig.staged(FIXED_1, 1, 2, explore=True), ones)
    assert live.tolist() == [6, 6] and info[INFO_FLAGS] & FLAG_EXPLORE
    live, info = rig.step(rig.staged(FIXED_1, 0, 2, control=CONTROL_FALLBACK), ones)
    assert live.tolist() == [2, 2] and info[INFO_CONTROL] == CONTROL_FALLBACK and info[INFO_FLAGS] & FLAG_FALLBACK


def test_a_guard_violation_runs_every_later_step_all_live(step_rig, device):
    rig = step_rig(4, 6)
    ones = torch.ones(4, 5, device=device)
    too_many = torch.tensor([1, 3, 0, 0], dtype=torch.int32, device=device)
    live, _ = rig.step(rig.staged(FIXED_1, 1, 4), ones, accepted=too_many)
    assert live.tolist() == [2, 2, 2, 2]
    for _ in range(2):
        live, info = rig.step(rig.staged(FIXED_1, 1, 4), ones)
        assert live.tolist() == [6, 6, 6, 6] and info[INFO_FLAGS] & FLAG_GUARD_VIOLATION
