"""``VerifyHook`` end to end on a real segment: the policy a sidecar writes reaches the live
lengths through the host's read (held while a write is in flight, the fallback once the lease
expires), the host's per-step decisions (explore, expert sampling, queue length) reach the
record, and ``flush`` publishes the last one."""
import os

import numpy as np
import pytest
import torch

from vcap.engine_hook import reference
from vcap.engine_hook.hook import VerifyHook
from vcap.engine_hook.buffers import INFO_CONTROL, INFO_FLAGS, INFO_GENERATION, STAGED_CONTROL, STAGED_HEAD
from vcap.policy import Bucket, Policy
from vcap.segment import (CONTROL_FALLBACK, CONTROL_HELD, CONTROL_LIVE, FLAG_EXPERTS_SAMPLED, FLAG_FALLBACK,
                          RingReader, Segment, SegmentConfig)

FIXED_2 = Policy("fixed", 2, (Bucket(1, 1, 5, (0.0,) * 5),))


class Clock:
    def __init__(self):
        self.ns = 10_000_000_000

    def __call__(self):
        return self.ns


class Rig:
    def __init__(self, name, max_bs, stride, layers=2, lease_ms=500, sample_period=0):
        self.segment = Segment.create(name, SegmentConfig(
            stride=stride, max_bs=max_bs, num_moe_layers=layers, ring_slots=4, lease_ms=lease_ms,
            num_experts=64, expert_sample_period=sample_period))
        self.clock = Clock()
        self.hook = VerifyHook(self.segment, clock=self.clock)
        self.hook.buffers.device_clock = False
        self.reader = RingReader(self.segment, 0)

    def step(self, confidence, bs, advance_ms=1, num_queued=0):
        self.clock.ns += advance_ms * 1_000_000
        self.hook.buffers.clock.fill_(self.clock.ns)
        self.hook.prepare(bs, confidence is not None, num_queued)
        live = self.hook.begin(confidence).cpu().numpy().copy()
        self.hook.end()
        if self.hook.device.type == "cuda":
            torch.cuda.synchronize()
        return live, self.hook.info.cpu().numpy().copy()

    def flush(self):
        """``VerifyHook.flush``, then the records: on a GPU they land when the publish kernel has run."""
        self.hook.flush()
        if self.hook.device.type == "cuda":
            torch.cuda.synchronize()
        return self.reader.read()

    def close(self):
        self.hook.close()
        self.segment.unlink()


@pytest.fixture
def rig(segment_name):
    rigs = []

    def make(*args, **kwargs):
        rigs.append(Rig(segment_name, *args, **kwargs))
        return rigs[-1]
    yield make
    for made in rigs:
        made.close()


def test_write_in_flight_keeps_last_good_then_lease_expires(rig, device):
    rig = rig(4, 6, lease_ms=50)
    confidence = torch.ones(4, 5, device=device)
    rig.segment.write_policy(FIXED_2, 3, "manual")
    live, info = rig.step(confidence, 4)
    assert live.tolist() == [3, 3, 3, 3] and info[INFO_CONTROL] == CONTROL_LIVE
    rig.segment.control_words[0] += 1  # a writer died mid-write: odd
    rig.segment.control_words[2] = 0  # garbage in the body
    live, info = rig.step(confidence, 4, advance_ms=10)
    assert live.tolist() == [3, 3, 3, 3] and info[INFO_CONTROL] == CONTROL_HELD and info[INFO_GENERATION] == 3
    live, info = rig.step(confidence, 4, advance_ms=100)
    assert live.tolist() == [6, 6, 6, 6] and info[INFO_CONTROL] == CONTROL_FALLBACK
    assert info[INFO_FLAGS] & FLAG_FALLBACK


def test_policy_explore_and_queue_reach_live_lengths_and_records(rig, device):
    rig = rig(3, 6)
    policy = Policy("conf", 1, (Bucket(1, 1, 5, (0.0, 0.5, 0.3, 0.2, 0.1)),), explore_period=3)
    rig.segment.write_policy(policy, 7, "auto")
    confidence = torch.rand(3, 5)
    seen = []
    for step in range(4):  # the ring has 4 slots
        rig.segment.heartbeat[0] += 1
        live, info = rig.step(confidence.to(device), 3, num_queued=10 + step)
        explore = step % 3 == 0
        np.testing.assert_array_equal(live, reference.live_lengths(confidence.numpy(), policy, 3, 6, explore))
        seen.append(info[INFO_GENERATION])
    records = rig.flush()
    assert seen == [7] * 4 and [int(r["num_queued"]) for r in records] == [10, 11, 12, 13]
    assert [int(r["step"]) for r in records] == [0, 1, 2, 3] and rig.reader.dropped == 0


def test_expert_counts_of_sampled_steps(rig, device):
    rig = rig(2, 4, layers=2, sample_period=2)
    logits = torch.randn(8, 64, device=device)
    bias = torch.zeros(64, device=device)
    for _ in range(3):
        rig.hook.prepare(2, True)
        rig.hook.begin(torch.ones(2, 3, device=device))
        _, ids = rig.hook.route(0, logits, bias, 6, num_expert_group=4, topk_group=2)
        rig.hook.route(1, logits, bias, 6, num_expert_group=4, topk_group=2)
        rig.hook.end()
    records = rig.flush()
    assert [bool(r["flags"] & FLAG_EXPERTS_SAMPLED) for r in records] == [True, False, True]
    want = reference.distinct_experts(ids.cpu().numpy())
    assert records[0]["experts_all"].tolist() == [want, want] and records[1]["experts_all"].tolist() == [0, 0]


def test_bad_arguments_are_refused(rig):
    rig = rig(2, 4)
    with pytest.raises(ValueError, match="bs must be in 0..2"):
        rig.hook.prepare(3)
    with pytest.raises(ValueError, match="confidence must be"):
        rig.hook.begin(torch.ones(2, 5))
    with pytest.raises(ValueError, match="strategy"):
        VerifyHook(rig.segment, strategy="zero")


def test_a_segment_truncated_by_another_process_falls_back_without_sigbus(rig, device):
    # `truncate -s 0` on the live segment by someone else: the host must not touch the lost pages
    # (SIGBUS would kill the engine; unguarded, this test dies with it).
    r = rig(4, 6)
    r.segment.write_policy(FIXED_2, 1, "manual")
    r.segment.heartbeat[0] += 1
    r.step(torch.ones(4, 5, device=device), 4)
    assert r.hook.host._slots[0][STAGED_CONTROL] == CONTROL_LIVE
    total = r.segment.layout.total_size
    os.truncate(r.segment.path, 0)
    try:
        r.hook.prepare(4, True)  # reads the control block on the host: would die of SIGBUS unguarded
        staged = r.hook.host._slots[1]
        assert staged[STAGED_CONTROL] == CONTROL_FALLBACK
        assert (staged[STAGED_HEAD:] == r.hook.host.control.fallback).all()
        assert r.hook.guard_tripped() is False
        # the step goes on without its record: on the CPU path publishing wrote the lost pages
        # and died of SIGBUS (found by an outside review)
        live = r.hook.begin(torch.ones(4, 5, device=device))
        r.hook.end()
        r.hook.flush()
        if device == "cuda":
            torch.cuda.synchronize()
        assert (live[:4].cpu().numpy() == 6).all()   # the fallback: every draft verified
    finally:
        os.truncate(r.segment.path, total)  # so the rig can close
