import torch

from vcap.engine_hook.mapping import MappedSegment
from vcap.policy import Bucket, Policy
from vcap.segment import Segment, SegmentConfig


def test_views_alias_the_segment(segment_name, device):
    segment = Segment.create(segment_name, SegmentConfig(stride=6, max_bs=5, num_moe_layers=3, ring_slots=4))
    try:
        mapped = MappedSegment(segment)
        segment.write_policy(Policy("fixed", 2, (Bucket(1, 1, 5, (0.5,) * 5),)), 9, "manual")
        assert int(mapped.control_words[1]) == 9 and int(mapped.control_words[2]) == 1
        assert int(mapped.fallback_words[2]) == 0
        segment.heartbeat[0] = 123
        assert int(mapped.heartbeat[0]) == 123
        mapped.ring_header[0] = 7  # a device-side write lands in the host pages
        if device == "cuda":
            torch.cuda.synchronize()
        assert segment.ring_next_record(0) == 7
        assert mapped.ring_u8.numel() == 4 * segment.layout.record_size
        assert mapped.control_words.device.type == device
        mapped.close()
    finally:
        segment.unlink()


def test_bad_ring_is_refused(segment_name):
    segment = Segment.create(segment_name, SegmentConfig(stride=3, max_bs=2, num_moe_layers=1))
    try:
        import pytest
        with pytest.raises(ValueError, match="ring"):
            MappedSegment(segment, ring=1)
    finally:
        segment.unlink()
