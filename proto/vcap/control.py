"""The control block: how a policy is written into the segment and read back, and the engine's
one lease rule (:class:`ControlReader`). Offsets and sizes are in :mod:`vcap.segment`'s docstring."""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from vcap.policy import Bucket, Policy

if TYPE_CHECKING:
    from vcap.segment import Layout, Segment

__all__ = [
    "MODE_OFF", "MODE_FIXED", "MODE_CONF", "MODE_CODES", "MODE_NAMES", "SOURCES",
    "CONTROL_SEQ", "CONTROL_GENERATION", "CONTROL_MODE", "CONTROL_FIXED_K", "CONTROL_NUM_BUCKETS",
    "CONTROL_EXPLORE_PERIOD", "CONTROL_SOURCE", "CONTROL_HEAD_WORDS", "BUCKET_MIN_BS", "BUCKET_K_MIN",
    "BUCKET_K_MAX", "BUCKET_THRESHOLDS", "CONTROL_LIVE", "CONTROL_HELD", "CONTROL_FALLBACK",
    "CONTROL_STATES", "encode_policy", "decode_policy", "ControlSnapshot", "ControlReader",
]

MODE_OFF, MODE_FIXED, MODE_CONF = 0, 1, 2
MODE_CODES = {"off": MODE_OFF, "fixed": MODE_FIXED, "conf": MODE_CONF}
MODE_NAMES = {code: name for name, code in MODE_CODES.items()}
SOURCES = ("engine", "manual", "auto", "file")

_CONTROL_HEAD = struct.Struct("<IIiiiiiI")
_BUCKET_HEAD = struct.Struct("<iiii")

# The control block as int32 words (how the engine's kernels load it): the head, then buckets.
(CONTROL_SEQ, CONTROL_GENERATION, CONTROL_MODE, CONTROL_FIXED_K, CONTROL_NUM_BUCKETS,
 CONTROL_EXPLORE_PERIOD, CONTROL_SOURCE) = range(7)
CONTROL_HEAD_WORDS = _CONTROL_HEAD.size // 4
BUCKET_MIN_BS, BUCKET_K_MIN, BUCKET_K_MAX, BUCKET_THRESHOLDS = 0, 1, 2, _BUCKET_HEAD.size // 4
# Which control block a step used (ControlReader.read, ControlSnapshot.state).
CONTROL_LIVE, CONTROL_HELD, CONTROL_FALLBACK = 0, 1, 2
CONTROL_STATES = ("live", "held", "fallback")


def encode_policy(policy: Policy, layout: Layout, generation: int, source: str) -> bytes:
    """The control block's bytes for ``policy``, with ``seq = 0``."""
    body = bytearray(layout.control_size)
    _CONTROL_HEAD.pack_into(body, 0, 0, generation, MODE_CODES[policy.mode], policy.fixed_k,
                            len(policy.buckets), policy.explore_period, SOURCES.index(source), 0)
    for i, bucket in enumerate(policy.buckets):
        offset = _CONTROL_HEAD.size + i * layout.bucket_size
        _BUCKET_HEAD.pack_into(body, offset, bucket.min_bs, bucket.k_min, bucket.k_max, 0)
        struct.pack_into(f"<{len(bucket.thresholds)}f", body, offset + 16, *bucket.thresholds)
    return bytes(body)


def decode_policy(body: bytes, layout: Layout) -> tuple[Policy, int, str]:
    """Inverse of :func:`encode_policy`: ``(policy, generation, source)``, values as found."""
    _, generation, mode, fixed_k, num_buckets, explore, source, _ = _CONTROL_HEAD.unpack_from(body, 0)
    num_drafts = layout.config.num_drafts
    buckets = []
    for i in range(max(0, min(num_buckets, layout.config.max_buckets))):
        offset = _CONTROL_HEAD.size + i * layout.bucket_size
        min_bs, k_min, k_max, _ = _BUCKET_HEAD.unpack_from(body, offset)
        thresholds = struct.unpack_from(f"<{num_drafts}f", body, offset + 16)
        buckets.append(Bucket(min_bs, k_min, k_max, tuple(float(t) for t in thresholds)))
    policy = Policy(mode=MODE_NAMES.get(mode, f"unknown({mode})"), fixed_k=fixed_k,
                    buckets=tuple(buckets), explore_period=explore)
    source_name = SOURCES[source] if 0 <= source < len(SOURCES) else f"unknown({source})"
    return policy, generation, source_name


@dataclass(frozen=True, slots=True)
class ControlSnapshot:
    """The policy the engine uses this step and why."""

    policy: Policy
    generation: int
    source: str
    state: str  # "live", "held" (write in flight: last good), "fallback" (lease expired)


class ControlReader:
    """The engine's read of the control block, once per step: the one lease rule.

    Keeps the last good block while a write is in flight (``held``), and switches to the
    fallback when the heartbeat has not moved, or the block stayed odd, for ``lease_ms`` of
    ``clock`` (the engine's own monotonic clock, in ns: no clock is shared with the sidecar).
    :meth:`read` gives the raw int32 words (what the GPU hook stages, nothing decoded);
    :meth:`snapshot` the decoded policy (what the simulated engine follows).
    """

    def __init__(self, segment: Segment, clock=time.monotonic_ns):
        self.segment, self.clock = segment, clock
        self.lease_ns = segment.config.lease_ms * 1_000_000
        self.fallback = np.frombuffer(segment.read_block(segment.layout.fallback_offset), dtype="<i4").copy()
        self.last_good = None
        now = clock()
        self._heartbeat, self._heartbeat_changed = segment.lease_heartbeat(), now
        self._odd_since = None
        self._decoded = (b"", None)

    def read(self) -> tuple[np.ndarray, int]:
        """The control block this step uses, as int32 words, and which one (a ``CONTROL_*``)."""
        now = self.clock()
        heartbeat = self.segment.lease_heartbeat()
        if heartbeat is not None and heartbeat != self._heartbeat:  # None: truncated under us
            self._heartbeat, self._heartbeat_changed = heartbeat, now
        body = self.segment.read_control_words()
        if body is None:
            if self._odd_since is None:
                self._odd_since = now
        else:
            self._odd_since = None
            self.last_good = body
        expired = (now - self._heartbeat_changed > self.lease_ns
                   or (self._odd_since is not None and now - self._odd_since > self.lease_ns))
        if expired or self.last_good is None:
            return self.fallback, CONTROL_FALLBACK
        return self.last_good, CONTROL_LIVE if body is not None else CONTROL_HELD

    def snapshot(self) -> ControlSnapshot:
        """:meth:`read`, decoded (only when the block changed)."""
        words, state = self.read()
        key = words.tobytes()
        if key != self._decoded[0]:
            self._decoded = (key, decode_policy(key, self.segment.layout))
        policy, generation, source = self._decoded[1]
        return ControlSnapshot(policy, generation, source, CONTROL_STATES[state])
