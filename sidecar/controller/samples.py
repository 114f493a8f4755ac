"""What the controller keeps of the records: a bounded copy of each batch, ring buffers of the
newest samples, and the recency weights the fits give them."""

from dataclasses import dataclass

import numpy as np

from vcap.segment import FLAG_EXPLORE, FLAG_FALLBACK

from ..telemetry import RecordBatch

__all__ = ["Observation", "observe", "SampleRing", "recency_weights"]


@dataclass(frozen=True, slots=True)
class Observation:
    """One batch of one ring: every step's figures, a subsample of its request rows, and the
    sampled steps' expert counts."""

    ring: int
    shape: tuple[int, int, int]   # max_bs, drafts, MoE layers of the engine that wrote it
    bs: np.ndarray                # per step
    time_ns: np.ndarray
    num_queued: np.ndarray
    tokens: np.ndarray            # committed tokens
    step_ns: np.ndarray
    generation: np.ndarray        # per step: the policy generation it ran under
    explore: np.ndarray           # per step: an exploration step (every row verified)
    fallback: np.ndarray          # per step: the engine ran its fallback policy (no lease)
    live_rows: np.ndarray         # per step: rows verified (sum of live lengths)
    confidence: np.ndarray        # per subsampled request row
    live: np.ndarray
    accepted: np.ndarray
    row_explore: np.ndarray       # per subsampled request row: its step verified every row
    row_in_window: np.ndarray     # ... and the window keeps it (the calibration learns from every row)
    row_time_ns: np.ndarray
    row_bs: np.ndarray            # per subsampled request row: its step's batch size
    sampled_bs: np.ndarray        # per sampled step
    sampled_live_rows: np.ndarray
    sampled_step_ns: np.ndarray
    sampled_time_ns: np.ndarray
    experts_all: np.ndarray       # [sampled steps, layers]
    experts_live: np.ndarray


def _sample(rows: np.ndarray, limit: int, rng: np.random.Generator) -> np.ndarray:
    return rows if len(rows) <= limit else rng.choice(rows, limit, replace=False)


def observe(ring: int, batch: RecordBatch, rows_per_record: int, rng: np.random.Generator) -> Observation:
    """Every request row of an exploration step, and at most ``rows_per_record`` rows per other
    record, chosen by ``rng`` (a seeded one makes a replayed trace decide the same way); of the
    exploration rows, the window (``row_in_window``) keeps ``rows_per_record`` per record too.

    Exploration steps are the only rows that show what the capped drafts would have done, and
    goodput pays for them: subsampled like the others, two thirds of them never reached the
    calibration at bs 96, and it had ~350 drafts to calibrate what a longer rule would verify
    (``bench/CONTROLLER_RESULTS.md``, twenty-fourth round). The window keeps its sample: every
    exploration row in it made a third of its rows at bs 256 and one step in 16, rows of the same
    few instants, and a steady bucket's choice noisier."""
    explore = batch.flagged(FLAG_EXPLORE)
    step_index, request = np.nonzero(batch.real)
    row_explore = explore[step_index]
    explored = np.flatnonzero(row_explore)
    keep = row_explore.copy()
    keep[_sample(np.flatnonzero(~row_explore), rows_per_record * int((~explore).sum()), rng)] = True
    in_window = keep & ~row_explore
    in_window[_sample(explored, rows_per_record * int(explore.sum()), rng)] = True
    step_index, request, row_explore, in_window = step_index[keep], request[keep], row_explore[keep], in_window[keep]
    confidence, live, accepted = batch.rows((step_index, request))
    step_ns, time_ns, sampled = batch.field("step_ns"), batch.field("time_ns"), batch.sampled
    return Observation(
        ring=ring, shape=(batch.real.shape[1], batch.stride - 1, batch.experts_all.shape[1]),
        bs=batch.bs, time_ns=time_ns, num_queued=batch.field("num_queued"),
        tokens=batch.tokens, step_ns=step_ns, generation=batch.field("generation"),
        explore=explore, fallback=batch.flagged(FLAG_FALLBACK), live_rows=batch.live_rows,
        confidence=confidence.copy(), live=live, accepted=accepted,
        row_explore=row_explore, row_in_window=in_window, row_time_ns=time_ns[step_index], row_bs=batch.bs[step_index],
        sampled_bs=batch.bs[sampled], sampled_live_rows=batch.live_rows[sampled],
        sampled_step_ns=step_ns[sampled], sampled_time_ns=time_ns[sampled],
        experts_all=batch.experts_all, experts_live=batch.experts_live)


class SampleRing:
    """The newest ``capacity`` samples of a few parallel arrays (a ring buffer, not in time order).

    >>> ring = SampleRing(1024, ((5,), np.float32), ((), np.int64))   # [n, 5] and [n] columns
    >>> ring.add(confidence, live)
    >>> confidence, live = ring.arrays()
    """

    def __init__(self, capacity: int, *columns: tuple[tuple[int, ...], type]):
        self.buffers = [np.zeros((capacity, *shape), dtype=dtype) for shape, dtype in columns]
        self.capacity, self.count, self.cursor = capacity, 0, 0

    def add(self, *values: np.ndarray) -> None:
        n = min(len(values[0]), self.capacity)
        index = (self.cursor + np.arange(n)) % self.capacity
        for buffer, value in zip(self.buffers, values):
            buffer[index] = value[len(value) - n:]
        self.cursor = (self.cursor + n) % self.capacity
        self.count = min(self.count + n, self.capacity)

    def arrays(self) -> tuple[np.ndarray, ...]:
        return tuple(buffer[:self.count] for buffer in self.buffers)

    def clear(self) -> None:
        self.count = self.cursor = 0


def recency_weights(time_ns: np.ndarray, now_ns: int, half_life_s: float) -> np.ndarray:
    """``0.5 ** (age / half_life)`` of samples stamped ``time_ns`` (record clock)."""
    age_s = np.maximum(now_ns - np.asarray(time_ns, dtype=np.float64), 0.0) / 1e9
    return 0.5 ** (age_s / half_life_s)
