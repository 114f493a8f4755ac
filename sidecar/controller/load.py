"""The load the controller plans for: batch sizes over time (from the records) and the engine's
queue (from the records, or SGLang's own ``sglang:num_queue_reqs`` with ``--engine-metrics``)."""

import threading
import urllib.request
from dataclasses import dataclass

import numpy as np

__all__ = ["BucketLoad", "LoadTracker", "read_engine_queue", "EngineQueuePoller"]


# below this share of the steps a bucket counts as idle: its rule does nothing to goodput now
BUSY_SHARE = 0.02


@dataclass(frozen=True, slots=True)
class BucketLoad:
    """The steps of one batch-size bucket: representative batch sizes, their step weights (sum
    1), the bucket's share of all steps and its share of the engine's time."""

    points: np.ndarray
    weights: np.ndarray
    share: float
    time_share: float = 0.0

    @property
    def busy(self) -> bool:
        return self.share >= BUSY_SHARE

    @property
    def typical_bs(self) -> int:
        return int(round(float(np.dot(self.points, self.weights) / self.weights.sum())))

    def at_load(self, bs: np.ndarray) -> np.ndarray:
        """Which of the batch sizes ``bs`` (a row's step's) ran at this load: within 50% of
        :attr:`typical_bs`."""
        typical = self.typical_bs
        return np.abs(bs - typical) <= 0.5 * typical


class LoadTracker:
    """Steps and step time per batch size with exponential forgetting over the records' own
    clock, and the queue. A bucket's share of the steps weighs its steps in a goodput mix; its
    share of the time says how soon a new load dominates: after a shift from bs 4 to 96 the
    steps are ten times longer, and the new bucket holds most of the time seconds before it holds
    most of the steps."""

    def __init__(self, max_bs: int, half_life_s: float):
        self.max_bs, self.half_life_s = max_bs, half_life_s
        self.weights = np.zeros(max_bs + 1)
        self.seconds = np.zeros(max_bs + 1)
        self.last_time_ns = None
        self.queue = 0.0

    def add(self, bs: np.ndarray, time_ns: np.ndarray, num_queued: np.ndarray, step_ns: np.ndarray) -> None:
        latest = int(time_ns.max())
        if self.last_time_ns is not None and latest > self.last_time_ns:
            decay = 0.5 ** ((latest - self.last_time_ns) / 1e9 / self.half_life_s)
            self.weights *= decay
            self.seconds *= decay
        self.last_time_ns = latest if self.last_time_ns is None else max(latest, self.last_time_ns)
        sizes = np.clip(bs, 0, self.max_bs)
        self.weights += np.bincount(sizes, minlength=self.max_bs + 1)
        self.seconds += np.bincount(sizes, weights=np.asarray(step_ns, dtype=np.float64) / 1e9, minlength=self.max_bs + 1)
        self.queue = float(num_queued[-1])

    def points(self, low: int, high: int, max_points: int = 12) -> BucketLoad:
        """Representative batch sizes in ``[low, high)``, their step weights and the bucket's shares
        of steps and time. A bucket without load gets its geometric middle, weight 1 and shares 0."""
        high = min(high, self.max_bs + 1)
        weights = self.weights[low:high]
        total, everything = float(weights.sum()), float(self.weights[1:].sum())
        if total <= 1e-6 * max(everything, 1.0):
            return BucketLoad(np.array([max(low, round((low * max(high - 1, low)) ** 0.5))], dtype=float), np.ones(1), 0.0)
        time_share = float(self.seconds[low:high].sum()) / max(float(self.seconds[1:].sum()), 1e-12)
        sizes = np.arange(low, high, dtype=float)
        groups = np.array_split(np.arange(len(sizes)), min(max_points, len(sizes)))
        points = np.array([(sizes[g] * weights[g]).sum() / max(weights[g].sum(), 1e-12) for g in groups])
        group_weights = np.array([weights[g].sum() for g in groups])
        keep = group_weights > 0
        return BucketLoad(points[keep], group_weights[keep] / total, total / everything, time_share)


def read_engine_queue(url: str, timeout_s: float = 1.0) -> float | None:
    """Sum of ``sglang:num_queue_reqs`` in an SGLang ``/metrics`` page; None when absent or unreachable."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            text = response.read().decode("utf-8", "replace")
    except (OSError, ValueError):
        return None
    values = []
    for line in text.splitlines():
        if line.startswith("sglang:num_queue_reqs") and not line.startswith("sglang:num_queue_reqs_"):
            try:
                values.append(float(line.rsplit(None, 1)[-1]))
            except ValueError:
                continue
    return sum(values) if values else None


class EngineQueuePoller:
    """Reads the engine queue from SGLang's metrics every ``interval_s`` in a short-lived thread."""

    def __init__(self, url: str, interval_s: float = 5.0, reader=read_engine_queue):
        self.url, self.interval_s, self.reader = url, interval_s, reader
        self.value: float | None = None
        self._next_s = None
        self._thread: threading.Thread | None = None

    def poll_if_due(self, now: float) -> None:
        if self._next_s is not None and now < self._next_s:
            return
        if self._thread is not None and self._thread.is_alive():
            return
        self._next_s = now + self.interval_s
        self._thread = threading.Thread(target=self._poll, name="vcap-engine-metrics", daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        value = self.reader(self.url)
        if value is not None:
            self.value = value

    def stop(self) -> None:
        if self._thread is not None:
            self._thread.join(timeout=2)
