"""Telemetry rings: the record layout (offsets in :mod:`vcap.segment`'s docstring), the host-side
writer (the simulated engine's) and the bulk reader (the sidecar's)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from vcap.layout import SegmentTruncated

if TYPE_CHECKING:
    from vcap.segment import Layout, Segment

__all__ = [
    "FLAG_FALLBACK", "FLAG_EXPLORE", "FLAG_EXPERTS_SAMPLED", "FLAG_GUARD_VIOLATION", "FLAG_CONF_MISSING",
    "RECORD_SEQ", "RECORD_STEP", "RECORD_TIME_NS", "RECORD_STEP_NS", "RECORD_BS", "RECORD_GENERATION",
    "RECORD_FLAGS", "RECORD_MODE", "RECORD_NUM_QUEUED", "record_dtype", "slot_offset", "RingWriter", "RingReader",
]

# record flags
FLAG_FALLBACK = 1
FLAG_EXPLORE = 2
FLAG_EXPERTS_SAMPLED = 4
FLAG_GUARD_VIOLATION = 8
FLAG_CONF_MISSING = 16

# Record header, byte offsets.
RECORD_SEQ, RECORD_STEP, RECORD_TIME_NS, RECORD_STEP_NS = 0, 8, 16, 24
RECORD_BS, RECORD_GENERATION, RECORD_FLAGS, RECORD_MODE, RECORD_NUM_QUEUED = 32, 36, 40, 44, 48


def record_dtype(layout: Layout) -> np.dtype:
    """A numpy structured dtype matching one record, for bulk reads and writes."""
    c = layout.config
    return np.dtype({
        "names": ["seq", "step", "time_ns", "step_ns", "bs", "generation", "flags", "mode",
                  "num_queued", "confidence", "live", "accepted", "experts_all", "experts_live"],
        "formats": ["<u8", "<u8", "<u8", "<u8", "<u4", "<u4", "<u4", "<u4", "<u4",
                    ("<f4", (c.max_bs, c.num_drafts)), ("u1", (c.max_bs,)), ("u1", (c.max_bs,)),
                    ("<i4", (c.num_moe_layers,)), ("<i4", (c.num_moe_layers,))],
        "offsets": [RECORD_SEQ, RECORD_STEP, RECORD_TIME_NS, RECORD_STEP_NS, RECORD_BS, RECORD_GENERATION,
                    RECORD_FLAGS, RECORD_MODE, RECORD_NUM_QUEUED, layout.conf_offset, layout.live_offset,
                    layout.accepted_offset, layout.experts_all_offset, layout.experts_live_offset],
        "itemsize": layout.record_size,
    })


def slot_offset(layout: Layout, ring: int, n: int) -> int:
    """Where record ``n`` of ``ring`` lives in the file."""
    return layout.ring_offset(ring) + 64 + (n % layout.config.ring_slots) * layout.record_size


class RingWriter:
    """Host-side publisher of records into one ring (the simulated engine's; the GPU hook
    publishes the same layout from the device). Every word goes through the file, in the
    publishing order, so a truncation under the engine never kills it."""

    def __init__(self, segment: Segment, ring: int):
        self.segment, self.ring = segment, ring
        layout = segment.layout
        self.dtype = record_dtype(layout)
        self._start = layout.ring_offset(ring)

    def publish(self, record: np.ndarray) -> int | None:
        """Write one record (a 0-d array of :func:`record_dtype`); returns its number, or None
        when the file was truncated under us (nothing written)."""
        try:
            n = self.segment.ring_next_record(self.ring)
        except SegmentTruncated:
            return None
        offset = slot_offset(self.segment.layout, self.ring, n)
        data = record.copy()
        data["seq"] = 2 * n + 1
        self.segment.write_u64(offset, 2 * n + 1)
        self.segment.write_at(offset, data.tobytes())
        self.segment.write_u64(offset, 2 * n + 2)
        self.segment.write_u64(self._start, n + 1)
        return n


# A ring counter that moves further than this between two reads is corrupt, not a burst of
# records (2^32 records would take a 1,000-steps/s engine 50 days).
MAX_RECORDS_BETWEEN_READS = 1 << 32


class RingReader:
    """Bulk reader of one ring: returns every complete new record once, counts drops, and
    counts (``resyncs``) the times its counter jumped implausibly far, which cost no drops.

    It reads through the file (a truncation under it gives no records, never SIGBUS): the
    counter, the new records in one or two reads, the counter again. A record published before
    the copy began is whole in it unless the writer had begun its next lap on that slot by the
    second read of the counter (the writer bumps the counter only after a record is complete, and
    x86-64 keeps its stores in order). The one slot the writer may be inside then has its seq
    word read once more; each record's seq must also read ``2n+2``.
    """

    def __init__(self, segment: Segment, ring: int, from_start: bool = False):
        self.segment, self.ring = segment, ring
        self.dtype = record_dtype(segment.layout)
        self.slots = segment.config.ring_slots
        self._copied = np.zeros(self.slots, dtype=self.dtype)  # reused: no fresh pages per read
        self.position = 0 if from_start else self._published()
        self.dropped = 0
        self.resyncs = 0

    def _published(self) -> int:
        try:
            return self.segment.ring_next_record(self.ring)
        except SegmentTruncated:
            return 0

    def read(self, max_records: int | None = None) -> np.ndarray:
        """New complete records, oldest first, as a structured array (a copy); none while the
        file is truncated under us."""
        try:
            return self._read(max_records)
        except SegmentTruncated:
            return np.zeros(0, dtype=self.dtype)

    def _read(self, max_records: int | None) -> np.ndarray:
        published = self.segment.ring_next_record(self.ring)
        if published < self.position:  # the ring was reset under us: start over
            self.position = published
        if published - self.position > MAX_RECORDS_BETWEEN_READS:  # a corrupt counter: follow it
            self.resyncs += 1
            self.position = published
        if published - self.position > self.slots:
            self.dropped += published - self.position - self.slots
            self.position = published - self.slots
        count = published - self.position
        if max_records is not None:
            count = min(count, max_records)
        if count <= 0:
            return np.zeros(0, dtype=self.dtype)
        data = self._copy(self.position, count)
        published_after = self.segment.ring_next_record(self.ring)
        numbers = np.arange(self.position, self.position + count, dtype=np.uint64)
        good = (numbers + np.uint64(self.slots) > np.uint64(published_after)) & (data["seq"] == 2 * numbers + 2)
        # the writer may be inside record published_after, in record `boundary`'s slot: whole
        # only if that slot's seq still reads 2n+2 after the copy (the writer makes it odd first)
        boundary = published_after - self.slots
        if self.position <= boundary < self.position + count and data["seq"][boundary - self.position] == 2 * boundary + 2:
            good[boundary - self.position] = self.segment.read_u64(self._slot(boundary)) == 2 * boundary + 2
        self.dropped += int(count - good.sum())
        self.position += count
        return data[good]

    def _copy(self, first: int, count: int) -> np.ndarray:
        """Records ``first .. first + count - 1`` as the slots hold them now, in ring order
        (one or two reads: the stretch may wrap)."""
        head = min(count, self.slots - first % self.slots)
        self.segment.read_into(self._slot(first), self._copied[:head])
        if head < count:
            self.segment.read_into(self._slot(0), self._copied[head:count])
        return self._copied[:count]

    def _slot(self, n: int) -> int:
        return slot_offset(self.segment.layout, self.ring, n)
