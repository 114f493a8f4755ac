"""Calibration of the draft confidence head from telemetry rows, treating capped rows as censored.

For each draft position ``i`` (1-based) and confidence bin, counts how often draft ``i`` was
accepted among the rows where it was *observed*: every draft before it accepted (``accepted >= i-1``)
and draft ``i`` itself verified (``i <= L - 1``). A draft past the live length is unobserved, not a
rejection: it adds nothing to either count. The estimate of ``P(accepted_i | confidence_i, drafts
before accepted)`` is the binned rate, shrunk towards the position's mean and made monotone in the
confidence by pooling adjacent violators (isotonic regression), with exponential forgetting so it
follows a drifting head.

:class:`AcceptanceDrift` watches for a sudden change: per position, a one-sided CUSUM in each
direction of the observed acceptance minus the calibrated prediction, beyond an allowance. The
allowance absorbs the calibration's own bias; a change larger than it shows within a few ticks.
"""

import numpy as np

__all__ = ["AcceptanceCalibration", "AcceptanceDrift", "observed_drafts", "isotonic"]


def isotonic(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Non-decreasing least-squares fit of ``values`` with ``weights`` (pool adjacent violators)."""
    means, totals, sizes = [], [], []
    for value, weight in zip(values.astype(float), np.maximum(weights.astype(float), 1e-12)):
        means.append(value)
        totals.append(weight)
        sizes.append(1)
        while len(means) > 1 and means[-2] > means[-1]:
            weight_sum = totals[-2] + totals[-1]
            merged = (means[-2] * totals[-2] + means[-1] * totals[-1]) / weight_sum
            size = sizes[-2] + sizes[-1]
            del means[-1], totals[-1], sizes[-1]
            means[-1], totals[-1], sizes[-1] = merged, weight_sum, size
    return np.repeat(means, sizes)


def observed_drafts(live: np.ndarray, accepted: np.ndarray, num_drafts: int) -> tuple[np.ndarray, np.ndarray]:
    """``(observed, accepted)`` masks ``[rows, num_drafts]``: draft i was verified after every
    earlier draft was accepted, and whether it was accepted. Drafts past ``L - 1`` are censored."""
    positions = np.arange(1, num_drafts + 1)
    live = np.asarray(live, dtype=np.int64)[:, None]
    accepted = np.minimum(np.asarray(accepted, dtype=np.int64), live[:, 0] - 1)[:, None]
    observed = (positions <= live - 1) & (accepted >= positions - 1)
    return observed, observed & (accepted >= positions)


class AcceptanceCalibration:
    """Per-position binned, isotonic estimate of the conditional acceptance given the confidence.

    Not thread safe: the controller feeds it from its own tick.
    """

    def __init__(self, num_drafts: int, num_bins: int = 20, half_life_rows: float = 200_000.0,
                 prior_strength: float = 4.0):
        if num_drafts < 1 or num_bins < 2:
            raise ValueError(f"need num_drafts >= 1 and num_bins >= 2, got {num_drafts}, {num_bins}")
        self.num_drafts, self.num_bins = num_drafts, num_bins
        self.half_life_rows, self.prior_strength = half_life_rows, prior_strength
        self.trials = np.zeros((num_drafts, num_bins))
        self.successes = np.zeros((num_drafts, num_bins))
        self.rows_seen = 0
        self._table = None

    def update(self, confidence: np.ndarray, live: np.ndarray, accepted: np.ndarray) -> None:
        """Fold request rows in: ``confidence [rows, D]``, live lengths and accepted drafts."""
        rows = len(live)
        if rows == 0:
            return
        decay = 0.5 ** (rows / self.half_life_rows)
        self.trials *= decay
        self.successes *= decay
        observed, success = observed_drafts(live, accepted, self.num_drafts)
        bins = self.bin_of(confidence[:, :self.num_drafts])
        for position in range(self.num_drafts):
            seen = observed[:, position]
            self.trials[position] += np.bincount(bins[seen, position], minlength=self.num_bins)
            self.successes[position] += np.bincount(bins[success[:, position], position], minlength=self.num_bins)
        self.rows_seen += rows
        self._table = None

    def forget(self, keep: float) -> None:
        """Keep ``keep`` of what was learned (after a detected change of acceptance)."""
        self.trials *= keep
        self.successes *= keep
        self._table = None

    def bin_of(self, confidence: np.ndarray) -> np.ndarray:
        clean = np.nan_to_num(np.asarray(confidence, dtype=np.float64), nan=0.0)
        return np.clip((clean * self.num_bins).astype(np.int64), 0, self.num_bins - 1)

    def table(self) -> np.ndarray:
        """``[D, bins]`` calibrated acceptance per position and confidence bin."""
        if self._table is None:
            table = np.empty((self.num_drafts, self.num_bins))
            centres = (np.arange(self.num_bins) + 0.5) / self.num_bins
            for position in range(self.num_drafts):
                trials, successes = self.trials[position], self.successes[position]
                total = trials.sum()
                # with no data at all the raw confidence is the best guess there is
                prior = successes.sum() / total if total > 0 else None
                prior_rate = centres if prior is None else np.full(self.num_bins, prior)
                rate = (successes + self.prior_strength * prior_rate) / (trials + self.prior_strength)
                table[position] = isotonic(rate, trials + self.prior_strength)
            self._table = np.clip(table, 0.0, 1.0)
        return self._table

    def predict(self, confidence: np.ndarray) -> np.ndarray:
        """Calibrated acceptance ``[rows, D]`` of each draft given every earlier one accepted."""
        table = self.table()
        bins = self.bin_of(confidence[:, :self.num_drafts])
        return table[np.arange(self.num_drafts)[None, :], bins]


class AcceptanceDrift:
    """Detects a change of acceptance per draft position: CUSUMs both ways of (a) observed minus
    predicted acceptance and (b) the confidence against its slow moving average. (b) sees a
    change the confidence head follows (the calibration stays right, the recorded rows do not).

    Fed with the rows of each batch and the calibration's predictions for them, *before* the
    calibration learns from them. ``allowance``: the absolute change that counts as none;
    ``threshold``: the excess beyond the allowance, summed over rows, that raises the alarm.
    """

    def __init__(self, num_drafts: int, allowance: float = 0.06, threshold: float = 60.0,
                 reference_half_life_rows: float = 5000.0):
        self.num_drafts, self.allowance, self.threshold = num_drafts, allowance, threshold
        self.reference_half_life_rows = reference_half_life_rows
        self.reference = None      # [D] slow mean of the confidence
        self.up = np.zeros((2, num_drafts))
        self.down = np.zeros((2, num_drafts))
        self.alarms = 0

    def update(self, predicted: np.ndarray, live: np.ndarray, accepted: np.ndarray,
               confidence: np.ndarray | None = None) -> bool:
        """``predicted [rows, D]`` calibrated acceptance of rows whose drafts ``live`` and
        ``accepted`` say which were observed; ``confidence [rows, D]`` of every row. True when a
        change is detected (the statistics then restart)."""
        observed, success = observed_drafts(live, accepted, self.num_drafts)
        excess = [np.where(observed, success - predicted, 0.0).sum(axis=0)]
        count = [observed.sum(axis=0)]
        if confidence is not None and len(confidence):
            confidence = np.nan_to_num(np.asarray(confidence[:, :self.num_drafts], dtype=np.float64))
            if self.reference is None:
                self.reference = confidence.mean(axis=0)
            excess.append((confidence - self.reference).sum(axis=0))
            count.append(np.full(self.num_drafts, len(confidence)))
            keep = 0.5 ** (len(confidence) / self.reference_half_life_rows)
            self.reference = keep * self.reference + (1 - keep) * confidence.mean(axis=0)
        for i, (e, n) in enumerate(zip(excess, count)):
            self.up[i] = np.maximum(0.0, self.up[i] + e - self.allowance * n)
            self.down[i] = np.maximum(0.0, self.down[i] - e - self.allowance * n)
        if max(self.up.max(), self.down.max()) > self.threshold:
            self.reset()
            self.alarms += 1
            return True
        return False

    def reset(self) -> None:
        self.up[:] = 0.0
        self.down[:] = 0.0
        self.reference = None
