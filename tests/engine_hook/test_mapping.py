"""``MappedSegment``: device views that alias the segment's pages (CPU views without CUDA)."""
import pytest
import torch

from vcap.engine_hook.mapping import MappedSegment
from vcap.segment import STATUS_STEPS, Segment, SegmentConfig


def test_views_alias_the_segment(segment_name, device):
    segment = Segment.create(segment_name, SegmentConfig(stride=6, max_bs=5, num_moe_layers=3, ring_slots=4))
    try:
        mapped = MappedSegment(segment)
        mapped.ring_header[0] = 7  # a device-side write lands in the host pages
        mapped.status_u64[STATUS_STEPS] = 11
        mapped.ring_i32[segment.layout.record_size // 4] = 5  # record 1's seq, low word
        if device == "cuda":
            torch.cuda.synchronize()
        assert segment.ring_next_record(0) == 7 and int(segment.status_u64[STATUS_STEPS]) == 11
        assert int(mapped.ring_i64[segment.layout.record_size // 8]) == 5
        assert mapped.ring_i32.numel() == 4 * segment.layout.record_size // 4
        assert mapped.ring_header.device.type == device
        mapped.close()
    finally:
        segment.unlink()


def test_bad_ring_is_refused(segment_name):
    segment = Segment.create(segment_name, SegmentConfig(stride=3, max_bs=2, num_moe_layers=1))
    try:
        with pytest.raises(ValueError, match="ring"):
            MappedSegment(segment, ring=1)
    finally:
        segment.unlink()
