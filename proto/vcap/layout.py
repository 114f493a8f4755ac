"""The segment's geometry: the header's constants, :class:`SegmentConfig` (what the engine says of
itself) and :class:`Layout` (every region's offset and size, as :mod:`vcap.segment`'s docstring
gives them), and the checked read of a header."""

import os
import struct
from dataclasses import dataclass

from vcap.control import CONTROL_HEAD_WORDS

__all__ = ["MAGIC", "ABI_VERSION", "HEADER_SIZE", "RECORD_HEADER_SIZE", "MAX_STRIDE", "MAX_BUCKETS",
           "SegmentError", "SegmentTruncated", "SegmentConfig", "Layout", "read_layout", "dp_segment_name"]

MAGIC = b"VCAPSHM\x00"
ABI_VERSION = 1
HEADER_SIZE = 128
RECORD_HEADER_SIZE = 64

_HEADER = struct.Struct("<8sIIQIIIIIIIIIIQQIII")
# Fields added after ABI 1's first header, in its zero tail: an older engine leaves them 0, which
# means "not stated", so the ABI number stays.
_HEADER_TAIL = struct.Struct("<I")   # at _HEADER.size (92): dispatch_row_bytes
# Largest dimensions a header may give (SegmentConfig's checks); a request to the sidecar never
# needs more than a policy of these dimensions.
MAX_STRIDE = 255
MAX_BUCKETS = 64


def _align(value: int, to: int) -> int:
    return (value + to - 1) // to * to


class SegmentError(RuntimeError):
    """A file that is not a vcap segment this code can use; the message says why."""


class SegmentTruncated(SegmentError):
    """The file ended before the bytes asked for: another process truncated it under us."""


@dataclass(frozen=True, slots=True)
class SegmentConfig:
    """What the engine tells the sidecar about itself, written into the header."""

    stride: int
    max_bs: int
    num_moe_layers: int
    num_rings: int = 1
    ring_slots: int = 1024
    max_buckets: int = 8
    lease_ms: int = 500
    num_experts: int = 384
    top_k: int = 6
    expert_bytes: int = 0
    expert_sample_period: int = 1
    dispatch_row_bytes: int = 0   # bytes one row sends in the MoE's all-to-all dispatch (0: none, or unknown)

    def __post_init__(self):
        checks = [
            (2 <= self.stride <= MAX_STRIDE, f"stride must be in 2..{MAX_STRIDE}, got {self.stride}"),
            (1 <= self.max_bs <= 65536, f"max_bs must be in 1..65536, got {self.max_bs}"),
            (0 <= self.num_moe_layers <= 4096, f"num_moe_layers must be in 0..4096, got {self.num_moe_layers}"),
            (1 <= self.num_rings <= 1024, f"num_rings must be in 1..1024, got {self.num_rings}"),
            (2 <= self.ring_slots <= 1 << 20, f"ring_slots must be in 2..2^20, got {self.ring_slots}"),
            (1 <= self.max_buckets <= MAX_BUCKETS, f"max_buckets must be in 1..{MAX_BUCKETS}, got {self.max_buckets}"),
            (1 <= self.lease_ms <= 3_600_000, f"lease_ms must be in 1..3600000, got {self.lease_ms}"),
            (self.expert_sample_period >= 0, "expert_sample_period must be >= 0"),
            (self.expert_bytes >= 0, "expert_bytes must be >= 0"),
            (0 <= self.dispatch_row_bytes < 1 << 32, "dispatch_row_bytes must be in 0..2^32-1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def num_drafts(self) -> int:
        return self.stride - 1


class Layout:
    """Offsets and sizes of every region, derived from a :class:`SegmentConfig`."""

    def __init__(self, config: SegmentConfig):
        self.config = config
        num_drafts, max_bs, layers = config.num_drafts, config.max_bs, config.num_moe_layers
        self.bucket_size = _align(16 + 4 * num_drafts, 16)
        self.control_size = _align(CONTROL_HEAD_WORDS * 4 + config.max_buckets * self.bucket_size, 64)
        self.fallback_offset = HEADER_SIZE
        self.control_offset = self.fallback_offset + self.control_size
        self.lease_offset = self.control_offset + self.control_size
        self.status_offset = self.lease_offset + 64
        self.rings_offset = self.status_offset + 64
        self.conf_offset = RECORD_HEADER_SIZE
        self.live_offset = self.conf_offset + 4 * max_bs * num_drafts
        self.accepted_offset = self.live_offset + max_bs
        self.experts_all_offset = _align(self.accepted_offset + max_bs, 8)
        self.experts_live_offset = self.experts_all_offset + 4 * layers
        self.record_size = _align(self.experts_live_offset + 4 * layers, 64)
        self.ring_size = 64 + config.ring_slots * self.record_size
        self.total_size = self.rings_offset + config.num_rings * self.ring_size

    def ring_offset(self, ring: int) -> int:
        return self.rings_offset + ring * self.ring_size

    def slot_offset(self, ring: int, slot: int) -> int:
        return self.ring_offset(ring) + 64 + slot * self.record_size


def dp_segment_name(base: str, dp_rank: int) -> str:
    """The segment of attention-DP rank ``dp_rank`` (each rank creates its own): rank 0 keeps
    ``base``, rank ``r`` uses ``<base>-dp<r>`` (the engine hook names its segment with it)."""
    return base if dp_rank == 0 else f"{base}-dp{dp_rank}"


def read_layout(path: str, fd: int, file_size: int) -> Layout:
    """The layout a segment file's header describes, checked against the file; SegmentError says what is wrong."""
    if file_size < HEADER_SIZE:
        raise SegmentError(f"{path}: truncated: {file_size} bytes, smaller than the {HEADER_SIZE}-byte header")
    raw = os.pread(fd, _HEADER.size, 0)
    (magic, abi, header_size, total_size, stride, max_bs, layers, rings, slots, record_size,
     max_buckets, control_size, _pid, lease_ms, _created, expert_bytes, num_experts, top_k,
     sample_period) = _HEADER.unpack(raw)
    (dispatch_row_bytes,) = _HEADER_TAIL.unpack(os.pread(fd, _HEADER_TAIL.size, _HEADER.size))
    if magic != MAGIC:
        raise SegmentError(f"{path}: not a vcap segment (magic {magic!r}, expected {MAGIC!r})")
    if abi != ABI_VERSION:
        raise SegmentError(f"{path}: ABI version {abi}, this vcap speaks version {ABI_VERSION}")
    if header_size != HEADER_SIZE:
        raise SegmentError(f"{path}: header size {header_size}, expected {HEADER_SIZE}")
    try:
        config = SegmentConfig(stride=stride, max_bs=max_bs, num_moe_layers=layers, num_rings=rings,
                               ring_slots=slots, max_buckets=max_buckets, lease_ms=lease_ms,
                               num_experts=num_experts, top_k=top_k, expert_bytes=expert_bytes,
                               expert_sample_period=sample_period, dispatch_row_bytes=dispatch_row_bytes)
    except ValueError as error:
        raise SegmentError(f"{path}: corrupt header: {error}") from None
    layout = Layout(config)
    if (layout.record_size, layout.control_size) != (record_size, control_size):
        raise SegmentError(
            f"{path}: corrupt header: record/control sizes {record_size}/{control_size} do not "
            f"follow from its dimensions ({layout.record_size}/{layout.control_size})")
    if total_size != layout.total_size:
        raise SegmentError(f"{path}: corrupt header: total size {total_size}, its dimensions give {layout.total_size}")
    if file_size < total_size:
        raise SegmentError(f"{path}: truncated: {file_size} bytes, the header says {total_size}")
    return layout
