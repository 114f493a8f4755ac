"""The step kernels (``kernels.py``) against ``reference.py``: live lengths from a staged control
block, and the record of each step published one step late (or by a stage-only begin) with that
step's own data. Under Triton's interpreter on a CPU, natively on a GPU."""
import random

import numpy as np
import pytest
import torch

from vcap.engine_hook import reference
from vcap.engine_hook._writer import policy_for
from vcap.engine_hook.kernels import (INFO_BS, INFO_CONTROL, INFO_GENERATION, STAGED_BS, STAGED_CONF_PRESENT,
                                      STAGED_CONTROL, STAGED_EXPLORE, STAGED_HEAD, STAGED_NUM_QUEUED,
                                      STAGED_STEP64, StepBuffers, begin_step, end_step, publish_record)
from vcap.engine_hook.mapping import MappedSegment
from vcap.policy import Bucket, Policy
from vcap.segment import (CONTROL_FALLBACK, CONTROL_LIVE, CONTROL_MODE, FLAG_CONF_MISSING, FLAG_EXPLORE,
                          FLAG_FALLBACK, FLAG_GUARD_VIOLATION, STATUS_GUARD_TRIPPED, STATUS_GUARD_VIOLATIONS,
                          STATUS_STEPS, RingReader, Segment, SegmentConfig, encode_policy)

ALL_DRAFTS_FIXED = Policy("fixed", 1, (Bucket(1, 1, 5, (0.0,) * 5),))


class Rig:
    """The kernels on a real segment, with the staged words written by the test (no host reader)."""

    def __init__(self, name, device, max_bs, stride, layers=2):
        self.segment = Segment.create(name, SegmentConfig(stride=stride, max_bs=max_bs, num_moe_layers=layers,
                                                          ring_slots=4, num_experts=64))
        self.mapped = MappedSegment(self.segment, device=device)
        self.buffers = StepBuffers(self.segment.layout, device)
        self.buffers.device_clock = False  # the kernels read self.buffers.clock
        self.reader = RingReader(self.segment, 0)
        self.device, self.step_number, self.clock_ns = device, 0, 1_000_000

    def staged(self, policy, generation, bs, present=True, explore=False, control=CONTROL_LIVE, num_queued=0):
        layout = self.segment.layout
        words = np.zeros(STAGED_HEAD + layout.control_size // 4, dtype=np.int32)
        words[STAGED_HEAD:] = np.frombuffer(encode_policy(policy, layout, generation, "auto"), dtype="<i4")
        for index, value in ((STAGED_BS, bs), (STAGED_CONF_PRESENT, present), (STAGED_EXPLORE, explore),
                             (STAGED_CONTROL, control), (STAGED_NUM_QUEUED, num_queued)):
            words[index] = value
        words.view(np.int64)[STAGED_STEP64] = self.step_number
        return torch.from_numpy(words).to(self.device)

    def step(self, staged, confidence, accepted=None):
        """One verify step: begin (and the previous record's publish), then end 7 us later."""
        self.clock_ns += 1_000_000
        self.buffers.clock.fill_(self.clock_ns)
        live = begin_step(self.buffers, staged, confidence, None)
        publish_record(self.buffers, self.mapped)
        self.buffers.clock.fill_(self.clock_ns + 7_000)
        end_step(self.buffers, accepted)
        self.step_number += 1
        return live.cpu().numpy().copy(), self.buffers.info.cpu().numpy().copy()

    def flush(self, staged):
        begin_step(self.buffers, staged, None, None, stage_only=True)
        publish_record(self.buffers, self.mapped)
        return self.reader.read()

    def close(self):
        self.mapped.close()
        self.segment.unlink()


@pytest.fixture
def rig(segment_name, device):
    rigs = []

    def make(max_bs, stride, layers=2):
        rigs.append(Rig(segment_name, device, max_bs, stride, layers))
        return rigs[-1]
    yield make
    for made in rigs:
        made.close()


@pytest.mark.parametrize("max_bs,stride", [(8, 6), (12, 6), (3, 4)])
def test_live_lengths_and_late_records_match_the_reference(rig, device, max_bs, stride):
    rig = rig(max_bs, stride)
    previous = None
    for generation in range(1, 8):
        policy = policy_for(generation, stride - 1, rig.segment.config.max_buckets)
        policy = Policy(policy.mode, policy.fixed_k, policy.buckets, 0)
        confidence = torch.rand(max_bs, stride - 1) ** random.choice([0.2, 1.0])
        confidence[0, 0] = float("nan")
        bs, present = random.randint(1, max_bs), generation % 5 != 0
        staged = rig.staged(policy, generation, bs, present, num_queued=generation)
        live, info = rig.step(staged, confidence.to(device) if present else None)
        want = reference.live_lengths(confidence.numpy() if present else None, policy, bs, stride)
        np.testing.assert_array_equal(live[:bs], want)
        assert (live[bs:] == 1).all()
        assert (info[INFO_GENERATION], info[INFO_BS], info[INFO_CONTROL]) == (generation, bs, CONTROL_LIVE)
        assert bool(info[2] & FLAG_CONF_MISSING) == (not present)
        records = rig.reader.read()
        if previous is None:
            assert len(records) == 0  # nothing before the first step
        else:
            (record,) = records
            check_record(record, previous)
        previous = dict(generation=generation, bs=bs, live=live, step=generation - 1, num_queued=generation,
                        confidence=confidence.numpy() if present else None, ns=rig.clock_ns)
    (record,) = rig.flush(staged)
    check_record(record, previous)
    assert len(rig.flush(staged)) == 0 and rig.reader.dropped == 0  # idempotent
    assert int(rig.segment.status_u64[STATUS_STEPS]) == 7


def check_record(record, want):
    bs = want["bs"]
    assert (int(record["step"]), int(record["bs"]), int(record["generation"])) == (want["step"], bs, want["generation"])
    assert int(record["num_queued"]) == want["num_queued"]
    np.testing.assert_array_equal(record["live"], want["live"].astype(np.uint8))
    if want["confidence"] is None:
        assert (record["confidence"] == 0).all() and record["flags"] & FLAG_CONF_MISSING
    else:
        np.testing.assert_array_equal(record["confidence"][:bs], want["confidence"][:bs])
        assert (record["confidence"][bs:] == 0).all()
    if record["step_ns"]:  # measured: end stamp minus start
        assert int(record["step_ns"]) == 7_000 and int(record["time_ns"]) == want["ns"] + 7_000


def test_corrupt_values_are_clamped(rig, device):
    rig = rig(5, 6)
    ones = torch.ones(5, 5, device=device)
    policy = Policy("conf", 99, (Bucket(-4, -3, 77, (0.0,) * 5),))
    live, _ = rig.step(rig.staged(policy, 1, 5), ones)
    np.testing.assert_array_equal(live, reference.live_lengths(np.ones((5, 5)), policy, 5, 6))
    live, _ = rig.step(rig.staged(Policy("fixed", 99, ALL_DRAFTS_FIXED.buckets), 2, 2), ones)
    assert live.tolist() == [6, 6, 1, 1, 1]
    staged = rig.staged(ALL_DRAFTS_FIXED, 3, 3)
    staged[STAGED_HEAD + CONTROL_MODE] = 7  # unknown mode: every row live
    live, info = rig.step(staged, ones)
    assert live.tolist() == [6, 6, 6, 1, 1] and info[1] == 0
    live, info = rig.step(rig.staged(ALL_DRAFTS_FIXED, 3, 99), ones)  # bs beyond max_bs
    assert info[INFO_BS] == 5 and live.tolist() == [2] * 5


def test_explore_and_fallback_steps(rig, device):
    rig = rig(2, 6)
    ones = torch.ones(2, 5, device=device)
    live, info = rig.step(rig.staged(ALL_DRAFTS_FIXED, 1, 2, explore=True), ones)
    assert live.tolist() == [6, 6] and info[2] & FLAG_EXPLORE
    live, info = rig.step(rig.staged(ALL_DRAFTS_FIXED, 0, 2, control=CONTROL_FALLBACK), ones)
    assert live.tolist() == [2, 2] and info[2] & FLAG_FALLBACK and info[INFO_CONTROL] == CONTROL_FALLBACK
    records = rig.flush(rig.staged(ALL_DRAFTS_FIXED, 0, 2))
    assert [int(r["flags"]) & (FLAG_EXPLORE | FLAG_FALLBACK) for r in records] == [FLAG_EXPLORE, FLAG_FALLBACK]


def test_guard_violation_runs_every_later_step_all_live_and_is_recorded(rig, device):
    rig = rig(4, 6)
    ones = torch.ones(4, 5, device=device)
    too_many = torch.tensor([1, 3, 0, 0], dtype=torch.int32, device=device)
    live, _ = rig.step(rig.staged(ALL_DRAFTS_FIXED, 1, 4), ones, accepted=too_many)
    assert live.tolist() == [2, 2, 2, 2]
    for _ in range(2):
        live, info = rig.step(rig.staged(ALL_DRAFTS_FIXED, 1, 4), ones)
        assert live.tolist() == [6, 6, 6, 6] and info[2] & FLAG_GUARD_VIOLATION
    record = rig.reader.read()[0]
    assert record["flags"] & FLAG_GUARD_VIOLATION and record["accepted"].tolist() == [1, 3, 0, 0]
    status = rig.segment
    assert status.status_u32[STATUS_GUARD_TRIPPED] == 1 and int(status.status_u64[STATUS_GUARD_VIOLATIONS]) == 1
