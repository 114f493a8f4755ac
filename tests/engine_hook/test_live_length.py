"""The snapshot + live-length kernel against ``reference.live_lengths`` (the PyTorch-free rule),
under Triton's interpreter on a CPU, natively on a GPU."""
import random

import numpy as np
import pytest
import torch

from vcap.engine_hook import reference
from vcap.engine_hook._writer import policy_for
from vcap.engine_hook.live_length import StepState, live_lengths
from vcap.engine_hook.mapping import MappedSegment
from vcap.policy import Bucket, Policy
from vcap.segment import Segment, SegmentConfig


class Rig:
    def __init__(self, name, max_bs, stride, lease_ms=500):
        self.segment = Segment.create(name, SegmentConfig(stride=stride, max_bs=max_bs, num_moe_layers=2,
                                                          ring_slots=4, lease_ms=lease_ms))
        self.mapped = MappedSegment(self.segment)
        self.layout = self.segment.layout
        self.state = StepState(self.layout.control_size // 4, max_bs, stride, self.mapped.device,
                               self.mapped.fallback_words)
        self.state.device_clock = False  # the lease is judged by self.clock_ns
        self.clock_ns = 1_000_000

    def step(self, confidence, bs, present=True, advance_ms=1):
        self.clock_ns += advance_ms * 1_000_000
        self.state.clock.fill_(self.clock_ns)
        self.state.set_step(bs, present)
        live = live_lengths(self.state, self.mapped.control_words, self.mapped.heartbeat,
                            confidence if present else None, self.segment.config.lease_ms,
                            self.segment.config.max_buckets, self.layout.bucket_size // 4)
        return live.cpu().numpy(), self.state.info.cpu().numpy()

    def close(self):
        self.mapped.close()
        self.segment.unlink()


@pytest.mark.parametrize("max_bs,stride", [(8, 6), (12, 6), (3, 4)])
def test_matches_reference_on_random_policies(segment_name, device, max_bs, stride):
    rig = Rig(segment_name, max_bs, stride)
    try:
        for generation in range(1, 7):
            policy = policy_for(generation, stride - 1, rig.segment.config.max_buckets)
            policy = Policy(policy.mode, policy.fixed_k, policy.buckets, 0)
            rig.segment.write_policy(policy, generation, "auto")
            rig.segment.heartbeat[0] += 1
            confidence = torch.rand(max_bs, stride - 1) ** random.choice([0.2, 1.0])
            confidence[0, 0] = float("nan")
            bs = random.randint(1, max_bs)
            present = generation % 5 != 0
            live, info = rig.step(confidence.to(device), bs, present)
            want = reference.live_lengths(confidence.numpy() if present else None, policy, bs, stride)
            np.testing.assert_array_equal(live[:bs], want)
            assert (live[bs:] == 1).all()
            assert info[0] == generation and info[3] == bs and info[5] == 0
            assert bool(info[2] & 16) == (not present)
    finally:
        rig.close()


def test_write_in_flight_keeps_last_good_then_lease_expires(segment_name, device):
    rig = Rig(segment_name, 4, 6, lease_ms=50)
    try:
        confidence = torch.ones(4, 5, device=device)
        rig.segment.write_policy(Policy("fixed", 2, (Bucket(1, 1, 5, (0.0,) * 5),)), 3, "manual")
        live, info = rig.step(confidence, 4)
        assert live.tolist() == [3, 3, 3, 3] and info[5] == 0
        seq = rig.segment._control_seq
        seq[0] += 1  # a writer died mid-write: odd
        rig.mapped.control_words[2] = 0  # garbage in the body
        live, info = rig.step(confidence, 4, advance_ms=10)
        assert live.tolist() == [3, 3, 3, 3] and info[5] == 1 and info[0] == 3  # held
        live, info = rig.step(confidence, 4, advance_ms=100)
        assert live.tolist() == [6, 6, 6, 6] and info[5] == 2 and info[2] & 1  # fallback: off
    finally:
        rig.close()


def test_corrupt_values_are_clamped(segment_name, device):
    rig = Rig(segment_name, 5, 6)
    try:
        policy = Policy("conf", 99, (Bucket(-4, -3, 77, (0.0,) * 5),))
        rig.segment.write_policy(policy, 1, "manual")
        live, _ = rig.step(torch.ones(5, 5, device=device), 5)
        np.testing.assert_array_equal(live, reference.live_lengths(np.ones((5, 5)), policy, 5, 6))
        rig.segment.write_policy(Policy("fixed", 99, (Bucket(1, 1, 5, (0.0,) * 5),)), 2, "manual")
        rig.segment.heartbeat[0] += 1
        live, _ = rig.step(torch.ones(5, 5, device=device), 2)
        assert live.tolist() == [6, 6, 1, 1, 1]
        words = rig.segment.control_words
        words[2] = 7  # unknown mode: every row live
        rig.segment.heartbeat[0] += 1
        live, _ = rig.step(torch.ones(5, 5, device=device), 3)
        assert live.tolist() == [6, 6, 6, 1, 1]
    finally:
        rig.close()


def test_explore_every_period_th_step(segment_name, device):
    rig = Rig(segment_name, 2, 6)
    try:
        rig.segment.write_policy(Policy("fixed", 1, (Bucket(1, 1, 5, (0.0,) * 5),), explore_period=3), 1, "auto")
        seen = []
        for _ in range(6):
            rig.segment.heartbeat[0] += 1
            live, info = rig.step(torch.ones(2, 5, device=device), 2)
            seen.append((int(live[0]), bool(info[2] & 2)))
        assert seen == [(6, True), (2, False), (2, False), (6, True), (2, False), (2, False)]
    finally:
        rig.close()
