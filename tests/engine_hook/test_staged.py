"""The staged path (host snapshot + deferred record): ``HostControl`` against
``vcap.segment.ControlReader``; live lengths against ``reference.live_lengths``; records published
one step late (and by ``flush``) with the step's own data."""
import random

import numpy as np
import pytest
import torch

from vcap.engine_hook import reference
from vcap.engine_hook._writer import policy_for
from vcap.engine_hook.host_snapshot import SOURCE_FALLBACK, SOURCE_HELD, SOURCE_LIVE, HostControl
from vcap.engine_hook.step import VerifyHook
from vcap.policy import Bucket, Policy
from vcap.segment import ControlReader, RingReader, Segment, SegmentConfig, encode_policy

STATES = {"live": SOURCE_LIVE, "held": SOURCE_HELD, "fallback": SOURCE_FALLBACK}


class Clock:
    def __init__(self):
        self.ns = 10_000_000_000

    def __call__(self):
        return self.ns


def test_host_control_follows_control_reader(segment_name):
    segment = Segment.create(segment_name, SegmentConfig(stride=6, max_bs=4, num_moe_layers=1, lease_ms=50))
    try:
        clock = Clock()
        ours = HostControl(segment, clock)
        theirs = ControlReader(segment, clock=lambda: clock.ns / 1e9)
        rng = random.Random(3)
        generation = 0
        for _ in range(400):
            event = rng.random()
            if event < 0.3:
                generation += 1
                segment.write_policy(policy_for(generation, 5, segment.config.max_buckets), generation, "auto")
            elif event < 0.4:
                segment._control_seq[0] |= 1  # a writer stuck mid-write
            elif event < 0.7:
                segment.heartbeat[0] += 1
            clock.ns += rng.choice([0, 3, 9, 21]) * 1_000_000
            block, source = ours.read()
            snap = theirs.snapshot()
            assert source == STATES[snap.state]
            want = np.frombuffer(encode_policy(snap.policy, segment.layout, snap.generation, snap.source), "<i4")
            np.testing.assert_array_equal(block[1:], want[1:])
    finally:
        segment.unlink()


class Rig:
    def __init__(self, name, max_bs, stride, layers=2, lease_ms=500, sample_period=0):
        self.segment = Segment.create(name, SegmentConfig(
            stride=stride, max_bs=max_bs, num_moe_layers=layers, ring_slots=4, lease_ms=lease_ms,
            num_experts=64, expert_sample_period=sample_period))
        self.clock = Clock()
        self.hook = VerifyHook(self.segment, clock=self.clock)
        self.hook.state.device_clock = False
        self.reader = RingReader(self.segment, 0)

    def step(self, confidence, bs, present=True, accepted=None, advance_ms=1, num_queued=0):
        self.clock.ns += advance_ms * 1_000_000
        self.hook.state.clock.fill_(self.clock.ns)
        self.hook.prepare(bs, present, num_queued)
        live = self.hook.begin(confidence if present else None).cpu().numpy().copy()
        self.hook.state.clock.fill_(self.clock.ns + 7_000)
        self.hook.end(accepted=accepted)
        if self.hook.device.type == "cuda":
            torch.cuda.synchronize()
        return live, self.hook.info.cpu().numpy().copy()

    def close(self):
        self.hook.close()
        self.segment.unlink()


@pytest.mark.parametrize("max_bs,stride", [(8, 6), (12, 6), (3, 4)])
def test_live_lengths_and_late_records_match_the_reference(segment_name, device, max_bs, stride):
    rig = Rig(segment_name, max_bs, stride)
    try:
        previous = None
        for generation in range(1, 8):
            policy = policy_for(generation, stride - 1, rig.segment.config.max_buckets)
            policy = Policy(policy.mode, policy.fixed_k, policy.buckets, 0)
            rig.segment.write_policy(policy, generation, "auto")
            rig.segment.heartbeat[0] += 1
            confidence = torch.rand(max_bs, stride - 1) ** random.choice([0.2, 1.0])
            bs = random.randint(1, max_bs)
            present = generation % 5 != 0
            accepted = torch.randint(0, stride, (max_bs,), dtype=torch.int32)
            live, info = rig.step(confidence.to(device), bs, present, accepted=None, num_queued=generation)
            want = reference.live_lengths(confidence.numpy() if present else None, policy, bs, stride)
            np.testing.assert_array_equal(live[:bs], want)
            assert (live[bs:] == 1).all()
            assert info[0] == generation and info[3] == bs and info[5] == SOURCE_LIVE
            assert bool(info[2] & 16) == (not present)
            records = rig.reader.read()
            if previous is None:
                assert len(records) == 0  # nothing before the first step
            else:
                (record,) = records
                check_record(record, previous, stride)
            previous = dict(generation=generation, bs=bs, live=live, step=generation - 1, num_queued=generation,
                            confidence=confidence.numpy() if present else None, ns=rig.clock.ns)
            del accepted
        rig.hook.flush()
        if device == "cuda":
            torch.cuda.synchronize()
        (record,) = rig.reader.read()
        check_record(record, previous, stride)
        rig.hook.flush()  # idempotent
        assert len(rig.reader.read()) == 0 and rig.reader.dropped == 0
        assert int(rig.segment.status_u64[0]) == 7
    finally:
        rig.close()


def check_record(record, want, stride):
    bs = want["bs"]
    assert (int(record["step"]), int(record["bs"]), int(record["generation"])) == (want["step"], bs, want["generation"])
    assert int(record["num_queued"]) == want["num_queued"]
    np.testing.assert_array_equal(record["live"], want["live"].astype(np.uint8))
    if want["confidence"] is None:
        assert (record["confidence"] == 0).all() and record["flags"] & 16
    else:
        np.testing.assert_array_equal(record["confidence"][:bs], want["confidence"][:bs])
        assert (record["confidence"][bs:] == 0).all()
    if record["step_ns"]:  # measured: end stamp minus start
        assert int(record["step_ns"]) == 7_000 and int(record["time_ns"]) == want["ns"] + 7_000


def test_write_in_flight_keeps_last_good_then_lease_expires(segment_name, device):
    rig = Rig(segment_name, 4, 6, lease_ms=50)
    try:
        confidence = torch.ones(4, 5, device=device)
        rig.segment.write_policy(Policy("fixed", 2, (Bucket(1, 1, 5, (0.0,) * 5),)), 3, "manual")
        live, info = rig.step(confidence, 4)
        assert live.tolist() == [3, 3, 3, 3] and info[5] == SOURCE_LIVE
        rig.segment._control_seq[0] += 1  # a writer died mid-write: odd
        rig.segment.control_words[2] = 0  # garbage in the body
        live, info = rig.step(confidence, 4, advance_ms=10)
        assert live.tolist() == [3, 3, 3, 3] and info[5] == SOURCE_HELD and info[0] == 3
        live, info = rig.step(confidence, 4, advance_ms=100)
        assert live.tolist() == [6, 6, 6, 6] and info[5] == SOURCE_FALLBACK and info[2] & 1
    finally:
        rig.close()


def test_corrupt_values_are_clamped_and_explore_follows_the_step(segment_name, device):
    rig = Rig(segment_name, 5, 6)
    try:
        policy = Policy("conf", 99, (Bucket(-4, -3, 77, (0.0,) * 5),))
        rig.segment.write_policy(policy, 1, "manual")
        live, _ = rig.step(torch.ones(5, 5, device=device), 5)
        np.testing.assert_array_equal(live, reference.live_lengths(np.ones((5, 5)), policy, 5, 6))
        rig.segment.control_words[2] = 7  # unknown mode: every row live
        live, _ = rig.step(torch.ones(5, 5, device=device), 3)
        assert live.tolist() == [6, 6, 6, 1, 1]
        rig.segment.write_policy(Policy("fixed", 1, (Bucket(1, 1, 5, (0.0,) * 5),), explore_period=3), 2, "auto")
        seen = [(int(rig.step(torch.ones(5, 5, device=device), 2)[0][0]), rig.hook.host.step - 1) for _ in range(4)]
        assert seen == [(6 if step % 3 == 0 else 2, step) for _, step in seen]
    finally:
        rig.close()


def test_guard_violation_runs_the_next_step_all_live_and_is_recorded(segment_name, device):
    rig = Rig(segment_name, 4, 6)
    try:
        rig.segment.write_policy(Policy("fixed", 1, (Bucket(1, 1, 5, (0.0,) * 5),)), 1, "manual")
        too_many = torch.tensor([1, 3, 0, 0], dtype=torch.int32, device=device)
        live, _ = rig.step(torch.ones(4, 5, device=device), 4, accepted=too_many)
        assert live.tolist() == [2, 2, 2, 2]
        live, info = rig.step(torch.ones(4, 5, device=device), 4)
        assert live.tolist() == [6, 6, 6, 6] and info[2] & 8
        (record,) = rig.reader.read()
        assert record["flags"] & 8 and record["accepted"].tolist() == [1, 3, 0, 0]
        assert rig.segment.status_u32[3] == 1 and int(rig.segment.status_u64[2]) == 1
    finally:
        rig.close()


def test_expert_counts_of_sampled_steps(segment_name, device):
    rig = Rig(segment_name, 2, 4, layers=2, sample_period=2)
    try:
        logits = torch.randn(8, 64, device=device)
        bias = torch.zeros(64, device=device)
        for _ in range(3):
            rig.hook.prepare(2, True)
            rig.hook.begin(torch.ones(2, 3, device=device))
            _, ids = rig.hook.route(0, logits, bias, 6, num_expert_group=4, topk_group=2)
            rig.hook.route(1, logits, bias, 6, num_expert_group=4, topk_group=2)
            rig.hook.end()
        rig.hook.flush()
        records = rig.reader.read()
        assert [bool(r["flags"] & 4) for r in records] == [True, False, True]
        want = reference.distinct_experts(ids.cpu().numpy())
        assert records[0]["experts_all"].tolist() == [want, want] and records[1]["experts_all"].tolist() == [0, 0]
    finally:
        rig.close()
