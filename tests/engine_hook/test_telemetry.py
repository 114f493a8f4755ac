"""The record kernel: a record the sidecar's reader accepts, with this step's data, published
without a host sync; and the host path."""
import numpy as np
import pytest
import torch

from vcap.engine_hook.live_length import StepState
from vcap.engine_hook.mapping import MappedSegment
from vcap.engine_hook.telemetry import publish, publish_host
from vcap.segment import RingReader, RingWriter, Segment, SegmentConfig


@pytest.mark.parametrize("max_bs,stride,layers", [(8, 6, 4), (12, 6, 3), (3, 4, 1)])
def test_records_round_trip(segment_name, device, max_bs, stride, layers):
    segment = Segment.create(segment_name, SegmentConfig(stride=stride, max_bs=max_bs, num_moe_layers=layers,
                                                         ring_slots=2, num_experts=64))
    try:
        mapped = MappedSegment(segment)
        state = StepState(segment.layout.control_size // 4, max_bs, stride, device, mapped.fallback_words)
        reader = RingReader(segment, 0)
        bits = torch.zeros(layers, 2, 2, dtype=torch.int32, device=device)
        for n in range(3):  # wraps the 2-slot ring
            bs = max(1, max_bs - n)
            live = torch.randint(1, stride + 1, (max_bs,), dtype=torch.int32, device=device)
            live[bs:] = 1
            state.live.copy_(live)
            state.info.copy_(torch.tensor([40 + n, 2, 4 * (n % 2), bs, n % 2, 0, 0, 0], dtype=torch.int32))
            state.state[4] = 10 + n
            bits[:, 0, 0], bits[:, 1, 0] = 0b1111, 0b11  # 4 experts for all rows, 2 live
            confidence = torch.rand(max_bs, stride - 1, device=device)
            accepted = torch.minimum(live - 1, torch.ones_like(live))
            publish(mapped, state, confidence=confidence, accepted=accepted, expert_bits=bits)
            if device == "cuda":
                torch.cuda.synchronize()
            (record,) = reader.read()
            assert int(record["seq"]) == 2 * n + 2 and int(record["step"]) == 9 + n
            assert (int(record["bs"]), int(record["generation"]), int(record["mode"])) == (bs, 40 + n, 2)
            np.testing.assert_array_equal(record["live"], live.cpu().numpy())
            np.testing.assert_array_equal(record["accepted"][:bs], accepted[:bs].cpu().numpy())
            np.testing.assert_array_equal(record["confidence"][:bs], confidence[:bs].cpu().numpy())
            assert (record["confidence"][bs:] == 0).all()
            sampled = n % 2 == 1
            assert bool(record["flags"] & 4) == sampled
            assert record["experts_all"].tolist() == [4 if sampled else 0] * layers
            assert record["experts_live"].tolist() == [2 if sampled else 0] * layers
            assert (bits == 0).all()  # cleared for the next sampled step
            assert segment.ring_next_record(0) == n + 1
        assert int(segment.status_u64[0]) == 12 and reader.dropped == 0
        mapped.close()
    finally:
        segment.unlink()


def test_guard_violation_is_flagged(segment_name, device):
    segment = Segment.create(segment_name, SegmentConfig(stride=6, max_bs=4, num_moe_layers=1, ring_slots=4))
    try:
        mapped = MappedSegment(segment)
        state = StepState(segment.layout.control_size // 4, 4, 6, device, mapped.fallback_words)
        state.live.fill_(2)
        state.info[3] = 4
        reader = RingReader(segment, 0)
        publish(mapped, state, accepted=torch.tensor([1, 3, 0, 0], dtype=torch.int32, device=device))
        if device == "cuda":
            torch.cuda.synchronize()
        (record,) = reader.read()
        assert record["flags"] & 8 and record["flags"] & 16 == 0
        assert segment.status_u32[3] == 1 and int(segment.status_u64[2]) == 1
        assert int(state.state[6]) == 1  # the next live-length step runs every row live
    finally:
        segment.unlink()


def test_host_path(segment_name):
    segment = Segment.create(segment_name, SegmentConfig(stride=6, max_bs=4, num_moe_layers=2, ring_slots=4))
    try:
        reader = RingReader(segment, 0)
        publish_host(RingWriter(segment, 0), step=3, bs=2, generation=5, flags=1, mode=0,
                     live=np.array([6, 6]), accepted=np.array([4, 5]), experts_all=[9, 8], experts_live=[9, 8])
        (record,) = reader.read()
        assert (int(record["bs"]), int(record["generation"]), record["live"].tolist()) == (2, 5, [6, 6, 1, 1])
    finally:
        segment.unlink()
