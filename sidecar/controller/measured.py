"""Measured step times per batch-size bucket and rule: what disposes of the cost model's proposals.

The cost fit (``alpha + beta * D + delta * live_rows``) is linear; the engine's step is not (a
fused MoE pays its rows per tile: on the H200 loop at bs 256, k=1 took 199.6 ms and k=2 207.3 ms
where the fit said 190 and 213). Every step says which policy generation it ran under, so its
rule in its bucket is known: the store keeps the newest steps of each ``(bucket, rule)`` (an
exploration step counts for verifying every row) and gives, against the current fit, the
correction ``c = sum(measured step) / sum(predicted step)`` at the rule's measured live length
per request. Tokens are not measured here: the window's counterfactual tokens of every rule come
from the same rows (paired), far less noisy than two runs' tokens; only the step time is taken
from measurement.

A correction is known where a rule ran; between those live lengths it is interpolated, beyond
them held flat. Trials (``decision.py``) run the model's best candidates whose live length no
measurement covers, so that the choice between them is made on measured step times. Beyond the
measured live lengths the correction held flat is a guess, so a measured rule covers less there.
"""

from collections import deque
from dataclasses import dataclass

import numpy as np

from vcap.policy import Bucket

from .cost_model import ExpertCurve, StepCostFit

__all__ = ["RuleKey", "rule_key", "Correction", "StepTimes"]

MERGE_LIVE = 0.05   # measured rules closer than this in live length per request are one point

RuleKey = tuple   # (k_min, k_max, thresholds); every row verified is (D, D, ())


def rule_key(rule: Bucket, num_drafts: int) -> RuleKey:
    if rule.k_min >= num_drafts:
        return (num_drafts, num_drafts, ())
    return (int(rule.k_min), int(rule.k_max), tuple(round(float(t), 4) for t in rule.thresholds[:num_drafts]))


@dataclass(frozen=True, slots=True)
class Correction:
    """Measured over predicted step time at measured live lengths per request (``live`` ascending).

    With a ``shape`` (the engine's start-up profile over the fit at live lengths ``shape_live``,
    :meth:`shaped`), the correction between and beyond the measured live lengths follows the
    profile: the measured points fix its level, the profile the bends between them."""

    live: np.ndarray
    ratio: np.ndarray
    se: np.ndarray
    steps: np.ndarray
    shape_live: np.ndarray | None = None
    shape: np.ndarray | None = None

    def at(self, live) -> np.ndarray:
        if not len(self.live):
            return np.ones_like(np.asarray(live, dtype=np.float64))
        if self.shape is None:
            return np.interp(live, self.live, self.ratio)
        level = np.interp(live, self.live, self.ratio / np.interp(self.live, self.shape_live, self.shape))
        return level * np.interp(live, self.shape_live, self.shape)

    def relative_se(self, live) -> np.ndarray:
        """Standard error of the correction over the correction at live lengths ``live``,
        interpolated between the measured live lengths and held flat beyond them (with no
        profile's shape; 0 where nothing is measured): how far a measured step time
        may be off by chance. The step time of the rule in force is measured all the time; one
        that sits high by chance must not make a rule measured earlier look better."""
        if not len(self.live):
            return np.zeros_like(np.asarray(live, dtype=np.float64))
        return np.interp(live, self.live, self.se / self.ratio)

    def shaped(self, shape_live: np.ndarray, shape: np.ndarray) -> "Correction":
        """This correction, bent between measurements as ``shape`` (profile over fit) bends."""
        return Correction(self.live, self.ratio, self.se, self.steps, np.asarray(shape_live, dtype=np.float64),
                          np.asarray(shape, dtype=np.float64))

    def lowest_around(self, live) -> np.ndarray:
        """At live lengths inside the measured range, the lower of the two measured corrections
        around each (with a profile's shape, the lower level bent by it); elsewhere :meth:`at`.
        Between two measurements the correction is interpolated, but where the step time bends
        there (a fused MoE's tiles fill up) the truth can lie anywhere between the two: this is
        the most favourable of those."""
        live = np.asarray(live, dtype=np.float64)
        at = self.at(live)
        if len(self.live) < 2:
            return at
        level = self.ratio if self.shape is None else self.ratio / np.interp(self.live, self.shape_live, self.shape)
        right = np.clip(np.searchsorted(self.live, live), 1, len(self.live) - 1)
        lowest = np.minimum(level[right - 1], level[right])
        if self.shape is not None:
            lowest = lowest * np.interp(live, self.shape_live, self.shape)
        inside = (live > self.live[0]) & (live < self.live[-1])
        return np.where(inside, lowest, at)

    def covered(self, live: float, spacing: float, edge_spacing: float) -> bool:
        """A measured rule lies within ``spacing`` of ``live``, or within ``edge_spacing`` where
        ``live`` is beyond every measured live length (where the correction is held flat, not measured)."""
        if not len(self.live):
            return False
        inside = self.live[0] <= live <= self.live[-1]
        return float(np.min(np.abs(self.live - live))) < (spacing if inside else edge_spacing)


class StepTimes:
    """The newest ``max_steps`` steps of each ``(bucket, rule)``: batch size, live rows, step time,
    record time. ``enough_steps``: a rule with this many steps is measured whatever its rows.
    Not thread safe (the controller's tick)."""

    def __init__(self, edges: tuple[int, ...], max_steps: int = 2048, enough_steps: int = 256):
        self.edges = np.asarray(edges)
        self.max_steps, self.enough_steps = max_steps, min(enough_steps, max_steps)
        self.steps: dict[tuple[int, RuleKey], deque] = {}

    def add(self, bucket: np.ndarray, keys: list, bs: np.ndarray, live_rows: np.ndarray, step_ns: np.ndarray,
            time_ns: np.ndarray) -> None:
        for b, key, n, rows, ns, t in zip(bucket, keys, bs, live_rows, step_ns, time_ns):
            if key is None or n <= 0 or ns <= 0:
                continue
            entry = self.steps.get((int(b), key))
            if entry is None:
                entry = self.steps[(int(b), key)] = deque(maxlen=self.max_steps)
            entry.append((int(n), float(rows), float(ns), int(t)))

    def bucket_of(self, bs: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.edges, bs, side="right") - 1

    def count(self, bucket: int, key: RuleKey) -> tuple[int, int]:
        """(steps, request rows) measured for ``key`` in ``bucket``."""
        entry = self.steps.get((bucket, key))
        if not entry:
            return 0, 0
        return len(entry), sum(n for n, *_ in entry)

    def enough(self, bucket: int, key: RuleKey, min_steps: int, min_rows: int) -> bool:
        """``key`` has ``min_steps`` steps in ``bucket`` and ``min_rows`` request rows, or
        ``enough_steps`` steps (at bs 1 they are fewer rows than ``min_rows``)."""
        steps, rows = self.count(bucket, key)
        return steps >= min_steps and (rows >= min_rows or steps >= self.enough_steps)

    def drop_bucket(self, bucket: int) -> None:
        for key in [k for k in self.steps if k[0] == bucket]:
            del self.steps[key]

    def expire(self, before_ns: int) -> None:
        """Drop steps stamped before ``before_ns``."""
        for key in list(self.steps):
            entry = self.steps[key]
            while entry and entry[0][3] < before_ns:
                entry.popleft()
            if not entry:
                del self.steps[key]

    def clear(self) -> None:
        self.steps.clear()

    def correction(self, bucket: int, curve: ExpertCurve, cost: StepCostFit, min_steps: int,
                   min_rows: int) -> Correction:
        """The bucket's measured corrections against the current fit, one point per rule with
        enough steps (:meth:`enough`); points closer than ``MERGE_LIVE`` in
        live length are merged (weighted by steps)."""
        points = []
        for (b, key), entry in self.steps.items():
            if b != bucket or not self.enough(bucket, key, min_steps, min_rows):
                continue
            values = np.asarray(entry, dtype=np.float64)
            bs, rows, ns = values[:, 0], values[:, 1], values[:, 2]
            predicted = cost.predict(curve.total(rows), bs, rows)
            ratio = ns.sum() / predicted.sum()
            se = float(np.sqrt(((ns - ratio * predicted) ** 2).sum()) / predicted.sum())
            points.append((rows.sum() / bs.sum(), ratio, se, len(entry)))
        points.sort()
        merged = []
        for point in points:
            if merged and point[0] - merged[-1][0] < MERGE_LIVE:
                a, b = merged[-1], point
                w = a[3] + b[3]
                merged[-1] = ((a[0] * a[3] + b[0] * b[3]) / w, (a[1] * a[3] + b[1] * b[3]) / w,
                              float(np.hypot(a[2] * a[3], b[2] * b[3]) / w), w)
            else:
                merged.append(point)
        if not merged:
            return Correction(np.zeros(0), np.zeros(0), np.zeros(0), np.zeros(0, dtype=np.int64))
        live, ratio, se, steps = (np.asarray(v) for v in zip(*merged))
        return Correction(live, ratio, se, steps.astype(np.int64))
