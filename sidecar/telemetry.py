"""Telemetry records unpacked once, and the running totals the sidecar keeps of them.

:func:`unpack` is the one place that reads a batch of ring records (``vcap.segment.record_dtype``):
the link's totals, the controller and ``vcapctl tune`` all take its :class:`RecordBatch`. Totals
grow by one numpy pass per batch, never one call per request: at 1,000 steps/s with bs=256 that is
256,000 requests a second.
"""

import threading
import time
from collections import deque
from dataclasses import dataclass, fields, replace

import numpy as np

from vcap.segment import (FLAG_EXPERTS_SAMPLED, FLAG_EXPLORE, FLAG_FALLBACK,
                          FLAG_GUARD_VIOLATION)

__all__ = ["RecordBatch", "unpack", "valid_records", "Totals", "TelemetryTotals", "STEP_SECONDS_BUCKETS"]

STEP_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


# A verify step longer than this is a corrupt record, not a slow step.
MAX_STEP_NS = 3600 * 10**9
# Expert counts above this are corrupt when the segment does not say how many experts there are.
MAX_EXPERTS = 1 << 20


@dataclass(frozen=True, slots=True)
class RecordBatch:
    """Records of one ring read that passed validation (:func:`unpack`), with their request rows
    clamped as the engine clamps them. Padding rows (``>= bs``) hold 0; ``rejected`` counts the
    records left out."""

    records: np.ndarray       # as read from the ring (the recorder keeps them byte for byte)
    stride: int
    bs: np.ndarray            # [steps] real batch size, at most max_bs
    real: np.ndarray          # [steps, max_bs] rows of real requests
    live: np.ndarray          # [steps, max_bs] live length L in 1..stride
    accepted: np.ndarray      # [steps, max_bs] accepted drafts, at most L - 1
    sampled: np.ndarray       # [steps] steps whose expert counts were sampled
    experts_all: np.ndarray   # [sampled steps, layers] distinct experts of every row
    experts_live: np.ndarray  # [sampled steps, layers] of the live rows, at most experts_all
    rejected: int = 0         # records of the read that failed validation

    def __len__(self) -> int:
        return len(self.records)

    def field(self, name: str) -> np.ndarray:
        """A per-step field of the records (``step_ns``, ``time_ns``, ``num_queued``...) as int64."""
        return self.records[name].astype(np.int64)

    def flagged(self, flag: int) -> np.ndarray:
        return (self.records["flags"] & flag) != 0

    @property
    def live_rows(self) -> np.ndarray:
        """[steps] live rows verified."""
        return self.live.sum(axis=1)

    @property
    def tokens(self) -> np.ndarray:
        """[steps] committed tokens: accepted drafts plus one per request."""
        return self.accepted.sum(axis=1) + self.bs

    def rows(self, index=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(confidence, live, accepted)`` of the real request rows, or of the ``(steps, requests)``
        pairs ``index`` names."""
        index = self.real if index is None else index
        return self.records["confidence"][index], self.live[index], self.accepted[index]


def valid_records(records: np.ndarray, num_experts: int | None = None) -> np.ndarray:
    """[records] True where a record fits the segment's geometry: ``bs <= max_bs``, a step time
    under an hour, finite confidences in its real rows, and on sampled steps expert counts in
    ``0..num_experts``. A record that fails is garbage (a damaged or hostile segment), and must
    not reach any total: one such record once made counters negative for good."""
    max_bs = records["confidence"].shape[1]
    bs = records["bs"].astype(np.int64)
    good = (bs <= max_bs) & (records["step_ns"] <= MAX_STEP_NS)
    real = np.arange(max_bs)[None, :] < np.minimum(bs, max_bs)[:, None]
    finite = np.isfinite(records["confidence"]).all(axis=2)
    good &= (finite | ~real).all(axis=1)
    sampled = (records["flags"] & FLAG_EXPERTS_SAMPLED) != 0
    if records["experts_all"].shape[1]:
        limit = MAX_EXPERTS if not num_experts else num_experts
        experts = np.concatenate([records["experts_all"], records["experts_live"]], axis=1)
        counts_ok = ((experts >= 0) & (experts <= limit)).all(axis=1)
        good &= counts_ok | ~sampled
    return good


def unpack(records: np.ndarray, num_experts: int | None = None) -> RecordBatch:
    """The one reading of a batch of records (``vcap.segment.record_dtype``): records that fail
    :func:`valid_records` are left out and counted in ``rejected``."""
    good = valid_records(records, num_experts)
    rejected = int(len(records) - good.sum())
    if rejected:
        records = records[good]
    max_bs, num_drafts = records["confidence"].shape[1:]
    stride = num_drafts + 1
    bs = np.minimum(records["bs"].astype(np.int64), max_bs)
    real = np.arange(max_bs)[None, :] < bs[:, None]
    live = np.where(real, np.clip(records["live"].astype(np.int64), 1, stride), 0)
    accepted = np.where(real, np.minimum(records["accepted"].astype(np.int64), live - 1), 0)
    sampled = (records["flags"] & FLAG_EXPERTS_SAMPLED) != 0
    experts_all = records["experts_all"][sampled].astype(np.int64)
    experts_live = np.minimum(records["experts_live"][sampled].astype(np.int64), experts_all)
    return RecordBatch(records, stride, bs, real, live, accepted, sampled, experts_all, experts_live, rejected)


@dataclass(slots=True)
class Totals:
    """Counts over telemetry records for one engine geometry. ``merge`` adds another's counts
    and takes its ``last_*`` values."""

    stride: int
    num_layers: int
    steps: int = 0
    requests: int = 0
    rows_live: int = 0
    rows_dead: int = 0
    drafts_accepted: int = 0
    accepts_at_cap: int = 0
    sampled_steps: int = 0
    explore_steps: int = 0
    fallback_steps: int = 0
    guard_violations: int = 0
    dispatch_rows_saved: int = 0          # dead rows x MoE layers, while the row size is known
    dispatch_bytes_saved: int = 0
    live_counts: np.ndarray = None        # [stride + 1] requests by live length L
    accepted_counts: np.ndarray = None    # [stride] requests by accepted drafts
    position_verified: np.ndarray = None  # [drafts] draft i live, and every draft before it accepted
    position_accepted: np.ndarray = None  # [drafts]
    layer_streamed: np.ndarray = None     # [layers] distinct experts of the live rows, sampled steps
    layer_saved: np.ndarray = None        # [layers] distinct experts only dead rows would have added
    step_seconds_counts: np.ndarray = None  # [len(STEP_SECONDS_BUCKETS) + 1]
    step_seconds_sum: float = 0.0
    last_bs: int = 0
    last_queued: int = 0
    last_generation: int = 0
    last_dispatch_row_bytes: int = 0
    last_record_monotonic: float | None = None

    def __post_init__(self):
        zeros = {"live_counts": self.stride + 1, "accepted_counts": self.stride,
                 "position_verified": self.stride - 1, "position_accepted": self.stride - 1,
                 "layer_streamed": self.num_layers, "layer_saved": self.num_layers,
                 "step_seconds_counts": len(STEP_SECONDS_BUCKETS) + 1}
        for name, size in zeros.items():
            if getattr(self, name) is None:
                setattr(self, name, np.zeros(size, dtype=np.int64))

    @classmethod
    def of(cls, batch: RecordBatch, num_layers: int, dispatch_row_bytes: int = 0) -> "Totals":
        """The counts of one batch. With ``dispatch_row_bytes`` (an all-to-all MoE), every dead
        row is a row not dispatched in each MoE layer (its expert ids are -1)."""
        stride, real = batch.stride, batch.real
        live, accepted = batch.live[real], batch.accepted[real]
        positions = np.arange(1, stride)
        step_ns = batch.records["step_ns"]
        step_seconds = step_ns[step_ns > 0] / 1e9
        newest = batch.records[np.argmax(batch.records["step"])]
        rows_dead = int(batch.bs.sum()) * stride - int(live.sum())
        dispatch_rows = rows_dead * num_layers if dispatch_row_bytes else 0
        return cls(
            stride, num_layers, steps=len(batch), requests=int(batch.bs.sum()),
            rows_live=int(live.sum()), rows_dead=rows_dead,
            dispatch_rows_saved=dispatch_rows, dispatch_bytes_saved=dispatch_rows * dispatch_row_bytes,
            drafts_accepted=int(accepted.sum()),
            accepts_at_cap=int(((accepted == live - 1) & (live < stride)).sum()),
            sampled_steps=int(batch.sampled.sum()),
            explore_steps=int(batch.flagged(FLAG_EXPLORE).sum()),
            fallback_steps=int(batch.flagged(FLAG_FALLBACK).sum()),
            guard_violations=int(batch.flagged(FLAG_GUARD_VIOLATION).sum()),
            live_counts=np.bincount(live, minlength=stride + 1),
            accepted_counts=np.bincount(accepted, minlength=stride),
            position_verified=((live[:, None] > positions) & (accepted[:, None] >= positions - 1)).sum(axis=0),
            position_accepted=(accepted[:, None] >= positions).sum(axis=0),
            layer_streamed=batch.experts_live.sum(axis=0),
            layer_saved=(batch.experts_all - batch.experts_live).sum(axis=0),
            step_seconds_counts=np.bincount(np.searchsorted(STEP_SECONDS_BUCKETS, step_seconds, side="left"),
                                            minlength=len(STEP_SECONDS_BUCKETS) + 1),
            step_seconds_sum=float(step_seconds.sum()),
            last_bs=int(newest["bs"]), last_queued=int(newest["num_queued"]),
            last_generation=int(newest["generation"]), last_dispatch_row_bytes=dispatch_row_bytes)

    def merge(self, other: "Totals") -> None:
        for item in fields(self):
            name = item.name
            if name.startswith("last_"):
                setattr(self, name, getattr(other, name))
            elif name not in ("stride", "num_layers"):
                setattr(self, name, getattr(self, name) + getattr(other, name))

    @classmethod
    def of_ranks(cls, ranks: list["Totals"]) -> "Totals":
        """One node's totals from its DP ranks' (one geometry): counts add up, and so do the
        newest batch and queue (the node's); the generation is the oldest any rank still runs."""
        node = ranks[0].copy()
        for other in ranks[1:]:
            node.merge(other)
        node.last_bs = sum(rank.last_bs for rank in ranks)
        node.last_queued = sum(rank.last_queued for rank in ranks)
        node.last_generation = min(rank.last_generation for rank in [r for r in ranks if r.steps] or ranks)
        seen = [rank.last_record_monotonic for rank in ranks if rank.last_record_monotonic is not None]
        node.last_record_monotonic = max(seen, default=None)
        return node

    def copy(self) -> "Totals":
        return replace(self, **{item.name: getattr(self, item.name).copy() for item in fields(self)
                                if isinstance(getattr(self, item.name), np.ndarray)})

    @property
    def committed_tokens(self) -> int:
        return self.drafts_accepted + self.requests

    def acceptance_by_position(self) -> list[float]:
        return [float(a / v) if v else 0.0 for a, v in zip(self.position_accepted, self.position_verified)]


class TelemetryTotals:
    """:class:`Totals` since the sidecar started, fed by the link thread and read by any other."""

    def __init__(self, stride: int, num_layers: int, dispatch_row_bytes: int = 0):
        self.stride, self.num_layers = stride, num_layers
        self.dispatch_row_bytes = dispatch_row_bytes  # the link sets it on every attach
        self._lock = threading.Lock()
        self._totals = Totals(stride, num_layers)
        self._rate_window = deque(maxlen=64)  # (monotonic, steps)

    def add(self, batch: RecordBatch) -> None:
        if len(batch) == 0:
            return
        counts = Totals.of(batch, self.num_layers, self.dispatch_row_bytes)
        with self._lock:
            counts.last_record_monotonic = time.monotonic()
            self._totals.merge(counts)
            self._rate_window.append((counts.last_record_monotonic, self._totals.steps))

    def snapshot(self) -> Totals:
        with self._lock:
            return self._totals.copy()

    def steps_per_second(self, horizon_s: float = 5.0) -> float:
        with self._lock:
            now = time.monotonic()
            window = [(t, s) for t, s in self._rate_window if now - t <= horizon_s]
        if len(window) < 2 or window[-1][0] == window[0][0]:
            return 0.0
        return (window[-1][1] - window[0][1]) / (window[-1][0] - window[0][0])
