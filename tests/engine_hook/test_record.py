"""The telemetry record (``record.py``): staged at the next step's begin, published on the side
stream into a ring the sidecar's reader accepts, with the step's own data and the engine status."""
import random

import numpy as np
import pytest
import torch

from vcap.policy import Bucket, Policy
from vcap.segment import (CONTROL_FALLBACK, FLAG_CONF_MISSING, FLAG_EXPERTS_SAMPLED, FLAG_EXPLORE, FLAG_FALLBACK,
                          FLAG_GUARD_VIOLATION, STATUS_ENGINE_HEARTBEAT, STATUS_FALLBACK_ACTIVE,
                          STATUS_GUARD_TRIPPED, STATUS_GUARD_VIOLATIONS, STATUS_STEPS)

FIXED_1 = Policy("fixed", 1, (Bucket(1, 1, 5, (0.0,) * 5),))


@pytest.mark.parametrize("max_bs,stride", [(8, 6), (3, 4)])
def test_each_record_carries_its_steps_data_one_step_late(step_rig, device, max_bs, stride):
    rig = step_rig(max_bs, stride)
    policy = Policy("fixed", 1, (Bucket(1, 1, stride - 1, (0.0,) * (stride - 1)),))
    previous = None
    for n in range(6):
        bs, present = random.randint(1, max_bs), n % 4 != 3
        confidence = torch.rand(max_bs, stride - 1)
        accepted = torch.randint(0, 2, (max_bs,), dtype=torch.int32)
        live, _ = rig.step(rig.staged(policy, 10 + n, bs, present, num_queued=n), confidence.to(device) if present
                           else None, accepted=accepted.to(device))
        records = rig.reader.read()
        assert len(records) == (0 if previous is None else 1)  # nothing before the first step
        if previous is not None:
            check_record(records[0], previous)
        previous = dict(step=n, bs=bs, generation=10 + n, num_queued=n, live=live, accepted=accepted.numpy(),
                        confidence=confidence.numpy() if present else None, ns=rig.clock_ns)
    (record,) = rig.flush(rig.staged(policy, 0, 1))
    check_record(record, previous)
    assert len(rig.flush(rig.staged(policy, 0, 1))) == 0 and rig.reader.dropped == 0  # idempotent
    assert int(rig.segment.status_u64[STATUS_STEPS]) == 6 == int(rig.segment.status_u64[STATUS_ENGINE_HEARTBEAT])


def check_record(record, want):
    bs = want["bs"]
    assert (int(record["step"]), int(record["bs"]), int(record["generation"])) == (want["step"], bs, want["generation"])
    assert int(record["num_queued"]) == want["num_queued"]
    np.testing.assert_array_equal(record["live"], want["live"].astype(np.uint8))
    np.testing.assert_array_equal(record["accepted"][:bs], want["accepted"][:bs])
    assert (record["accepted"][bs:] == 0).all()
    if want["confidence"] is None:
        assert (record["confidence"] == 0).all() and record["flags"] & FLAG_CONF_MISSING
    else:
        np.testing.assert_array_equal(record["confidence"][:bs], want["confidence"][:bs])
        assert (record["confidence"][bs:] == 0).all()
    assert int(record["step_ns"]) == 7_000 and int(record["time_ns"]) == want["ns"] + 7_000


def test_records_flag_explore_and_fallback(step_rig, device):
    rig = step_rig(2, 6)
    ones = torch.ones(2, 5, device=device)
    rig.step(rig.staged(FIXED_1, 1, 2, explore=True), ones)
    rig.step(rig.staged(FIXED_1, 0, 2, control=CONTROL_FALLBACK), ones)
    records = rig.flush(rig.staged(FIXED_1, 0, 2))
    assert [int(r["flags"]) & (FLAG_EXPLORE | FLAG_FALLBACK) for r in records] == [FLAG_EXPLORE, FLAG_FALLBACK]
    assert rig.segment.status_u32[STATUS_FALLBACK_ACTIVE] == 1


def test_expert_counts_of_sampled_steps_then_cleared(step_rig, device):
    rig = step_rig(4, 6, layers=3)
    bits = torch.zeros(3, 2, 2, dtype=torch.int32, device=device)
    for sampled in (True, False):
        bits[:, 0, 0], bits[:, 1, 0] = 0b1111, 0b11  # 4 experts for all rows, 2 live
        rig.step(rig.staged(FIXED_1, 1, 4, sampled=sampled), torch.ones(4, 5, device=device), expert_bits=bits)
        (record,) = rig.flush(rig.staged(FIXED_1, 1, 4), expert_bits=bits)
        assert bool(record["flags"] & FLAG_EXPERTS_SAMPLED) == sampled
        assert record["experts_all"].tolist() == [4 if sampled else 0] * 3
        assert record["experts_live"].tolist() == [2 if sampled else 0] * 3
        assert (bits == 0).all()  # cleared for the next sampled step


def test_guard_violation_is_recorded_with_the_status(step_rig, device):
    rig = step_rig(4, 6)
    ones = torch.ones(4, 5, device=device)
    too_many = torch.tensor([1, 3, 0, 0], dtype=torch.int32, device=device)
    rig.step(rig.staged(FIXED_1, 1, 4), ones, accepted=too_many)
    (record,) = rig.flush(rig.staged(FIXED_1, 1, 4))
    assert record["flags"] & FLAG_GUARD_VIOLATION and record["accepted"].tolist() == [1, 3, 0, 0]
    assert rig.segment.status_u32[STATUS_GUARD_TRIPPED] == 1
    assert int(rig.segment.status_u64[STATUS_GUARD_VIOLATIONS]) == 1
