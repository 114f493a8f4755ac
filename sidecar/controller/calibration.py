"""Calibration of the draft confidence head from telemetry rows, treating capped rows as censored.

For each draft position ``i`` (1-based) and bin of the running product of survival up to ``i``
(the quantity the engine's rule thresholds), counts how often draft ``i`` was accepted among the
rows where it was *observed*: every draft before it accepted (``accepted >= i-1``) and draft ``i``
itself verified (``i <= L - 1``). A draft past the live length is unobserved, not a rejection: it
adds nothing to either count. The estimate of ``P(accepted_i | running product_i, drafts before
accepted)`` is the binned rate, shrunk towards the position's mean and made monotone in the
running product by pooling adjacent violators (isotonic regression), with exponential forgetting
so it follows a drifting head.

Why the running product and not draft ``i``'s own confidence: the engine verifies draft ``i``
when the running product at ``i`` passes its threshold (or ``k_min`` or an exploration step asks
for it), so within a bin of the running product which drafts were verified depends on nothing
else, and the verified drafts stand for the censored ones (missing at random given the bin).
Within a bin of the draft's own confidence, the verified drafts are those whose earlier drafts
looked good; a request's drafts move together, so those were accepted more often than the
censored drafts of the same bin, and longer rules looked better than they are (SYNTHETIC check:
``bench/CONTROLLER_RESULTS.md``, twenty-second round).

:class:`AcceptanceDrift` watches for a sudden change: per position, a one-sided CUSUM in each
direction of the observed acceptance minus the calibrated prediction, beyond an allowance. The
allowance absorbs the calibration's own bias; a change larger than it shows within a few ticks.
"""

from typing import Callable

import numpy as np

__all__ = ["AcceptanceCalibration", "AcceptanceDrift", "LiftedCalibration", "logit", "observed_drafts", "isotonic",
           "running_product", "uniform_bins"]


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


def running_product(confidence: np.ndarray) -> np.ndarray:
    """``[rows, D]`` running product of the clipped confidence, float32 and left to right as
    :func:`vcap.engine_hook.reference.live_lengths` thresholds it."""
    survival = np.nan_to_num(np.asarray(confidence, dtype=np.float32), nan=0.0)
    return np.cumprod(np.clip(survival, 0.0, 1.0), axis=1, dtype=np.float32)


def uniform_bins(values: np.ndarray, num_bins: int) -> np.ndarray:
    """Bin of each value in ``num_bins`` equal parts of [0, 1] (NaN in the first; values outside clipped)."""
    clean = np.nan_to_num(np.asarray(values, dtype=np.float64), nan=0.0)
    return np.clip((clean * num_bins).astype(np.int64), 0, num_bins - 1)


def observed_drafts(live: np.ndarray, accepted: np.ndarray, num_drafts: int) -> tuple[np.ndarray, np.ndarray]:
    """``(observed, accepted)`` masks ``[rows, num_drafts]``: draft i was verified after every
    earlier draft was accepted, and whether it was accepted. Drafts past ``L - 1`` are censored."""
    positions = np.arange(1, num_drafts + 1)
    live = np.asarray(live, dtype=np.int64)[:, None]
    accepted = np.minimum(np.asarray(accepted, dtype=np.int64), live[:, 0] - 1)[:, None]
    observed = (positions <= live - 1) & (accepted >= positions - 1)
    return observed, observed & (accepted >= positions)


class AcceptanceCalibration:
    """Per-position binned, isotonic estimate of the conditional acceptance given the running
    product of survival. Every method takes the rows' recorded confidence ``[rows, D]``.

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

    def forget(self, keep: float, moved: np.ndarray | None = None, moved_keep: float = 0.0,
               max_trials: float = float("inf")) -> None:
        """Keep ``keep`` of what was learned (after a detected change of acceptance): a prior-
        weighted restart. Positions in ``moved`` (a ``[D]`` mask) keep ``moved_keep`` instead,
        and no position keeps more than ``max_trials`` drafts' worth (the old table stays the
        prior, the new rows soon outweigh it)."""
        scale = np.full(self.num_drafts, float(keep))
        if moved is not None:
            scale[np.asarray(moved, dtype=bool)] = moved_keep
        total = self.trials.sum(axis=1) * scale
        scale = np.where(total > max_trials, scale * max_trials / np.maximum(total, 1e-12), scale)
        self.trials *= scale[:, None]
        self.successes *= scale[:, None]
        self._table = None

    def bin_of(self, confidence: np.ndarray) -> np.ndarray:
        """``[rows, D]`` bin of each draft's running product of survival."""
        return uniform_bins(running_product(confidence[:, :self.num_drafts]), self.num_bins)

    def table(self) -> np.ndarray:
        """``[D, bins]`` calibrated acceptance per position and running-product bin (a position
        without a single observed draft holds bin centres; :meth:`predict` does not use them)."""
        if self._table is None:
            table = np.empty((self.num_drafts, self.num_bins))
            centres = (np.arange(self.num_bins) + 0.5) / self.num_bins
            for position in range(self.num_drafts):
                trials, successes = self.trials[position], self.successes[position]
                total = trials.sum()
                prior = successes.sum() / total if total > 0 else None
                prior_rate = centres if prior is None else np.full(self.num_bins, prior)
                rate = (successes + self.prior_strength * prior_rate) / (trials + self.prior_strength)
                table[position] = isotonic(rate, trials + self.prior_strength)
            self._table = np.clip(table, 0.0, 1.0)
        return self._table

    def predict(self, confidence: np.ndarray) -> np.ndarray:
        """Calibrated acceptance ``[rows, D]`` of each draft given every earlier one accepted. A
        bin with few drafts observed leans toward the row's own confidence, by ``prior_strength``
        drafts' worth (a position never observed: the confidence alone). Its table value leans
        toward its position's mean rate, which the older rows set: under a cap that hides the
        third draft on, the risen confidence of the capped drafts fell into bins of 3-4 decayed
        drafts, and the table held them 0.26-0.29 below the acceptance every row verified showed
        (``bench/CONTROLLER_RESULTS.md``, forty-seventh round)."""
        table = self.table()
        positions = np.arange(self.num_drafts)[None, :]
        bins = self.bin_of(confidence[:, :self.num_drafts])
        raw = np.clip(np.nan_to_num(np.asarray(confidence[:, :self.num_drafts], dtype=np.float64), nan=0.0), 0.0, 1.0)
        trials = self.trials[positions, bins]
        weight = trials / (trials + self.prior_strength)
        return weight * table[positions, bins] + (1.0 - weight) * raw


def logit(p, eps: float = 1e-6):
    """``log(p / (1 - p))`` with ``p`` clipped to ``[eps, 1 - eps]`` (a rate of 0 or 1 stays finite)."""
    p = np.clip(p, eps, 1 - eps)
    return np.log(p / (1 - p))


class LiftedCalibration:
    """``calibration``'s predictions with every position's acceptance moved by ``logit_shift`` in
    logit: what the hidden drafts would accept had they risen as much as a draft that is seen."""

    def __init__(self, calibration: AcceptanceCalibration, logit_shift: float):
        self.calibration, self.logit_shift = calibration, logit_shift

    def predict(self, confidence: np.ndarray) -> np.ndarray:
        return 1.0 / (1.0 + np.exp(-(logit(self.calibration.predict(confidence)) + self.logit_shift)))


class AcceptanceDrift:
    """Detects a change of acceptance per draft position: CUSUMs both ways of (a) observed minus
    predicted acceptance and (b) the confidence against its slow moving average over the blocks
    where it is read (``min_requests_confidence`` requests or more). (b) sees a change the
    confidence head follows: the calibration stays right, the rows the decisions are judged on do
    not, until newer rows replace them. Where it is read again after more than ``restart_after_s``
    without a read, the slow mean starts again from ``recent_confidence(since_ns)``: the mean
    confidence per position of the rows of the last ``restart_after_s`` (the controller's window
    from ``since_ns`` on, the rows a bucket is judged on once the acceptance moved; None while
    there are none). (b)'s sums start again from zero: a change those rows already hold is not
    new. Kept through 28 s at three requests, the slow mean held the confidence from before a rise,
    and the first blip to four raised a false alarm (drawn59-5-accept on the H100,
    ``bench/CONTROLLER_RESULTS.md``, forty-ninth round). A batch that moves between three and five
    requests reads the confidence every few blocks: there the slow mean stays, and so does its
    sight of a change (judged against the window's rows at each return, it missed most).

    The unit of evidence is a request, not a row. Rows of one request are correlated (its
    confidence and acceptance move together for as long as it runs), so at a small batch size the
    mean over many steps still rests on the few requests in the batch. Rows are gathered in blocks
    of ``block_s`` of record time; in a block, the rows of one request count as one unit: a
    block's units are ``min(rows, requests in the batch)``. Each block adds to the CUSUMs its
    standardised mean, ``(mean - allowance) / (sd / sqrt(units))`` minus ``slack``, with the per-row
    standard deviation of the statistic (which holds the spread between requests too) estimated
    from the rows. ``threshold`` is in these standard units.

    Fed with the rows of each batch and the calibration's predictions for them, *before* the
    calibration learns from them. ``allowance``: the absolute change that counts as none (it also
    absorbs the calibration's own bias).
    """

    _STATS = 2   # (a) observed minus predicted, (b) confidence minus its slow mean

    def __init__(self, num_drafts: int, recent_confidence: Callable[[int], np.ndarray | None],
                 allowance: float = 0.03, threshold: float = 10.0, slack: float = 1.0, block_s: float = 1.0,
                 restart_after_s: float = 20.0, reference_half_life_blocks: float = 30.0, min_sd: float = 0.05,
                 prior_sd: float = 0.3, prior_blocks: float = 10.0, min_requests_confidence: float = 4.0):
        self.num_drafts, self.recent_confidence = num_drafts, recent_confidence
        self.restart_after_ns = int(restart_after_s * 1e9)
        self.allowance, self.threshold, self.slack = allowance, threshold, slack
        self.block_ns, self.min_sd = int(block_s * 1e9), min_sd
        self.prior_sd, self.prior_blocks, self.min_requests_confidence = prior_sd, prior_blocks, min_requests_confidence
        self.reference_keep = 0.5 ** (1.0 / reference_half_life_blocks)
        self.reference = None      # [D] slow mean of the confidence over the blocks where it is read
        self._read_until_ns = None   # the end of the last block where the confidence was read
        self._block_end_ns = None
        # slow per-row first and second moments of each statistic over blocks: the per-row spread
        # over many requests (a block at a small batch size holds the spread within a few only)
        self._moments = np.zeros((2, self._STATS, num_drafts))
        self._moment_weight = np.zeros((self._STATS, num_drafts))
        self.up = np.zeros((self._STATS, num_drafts))
        self.down = np.zeros((self._STATS, num_drafts))
        self.alarms = 0
        self.moved = np.zeros(num_drafts, dtype=bool)   # positions that moved, at the last alarm
        self.rose = False                                # ... and whether acceptance rose
        self.by_confidence = False                       # ... and whether (b) raised it
        self.blocks = 0
        self._block_start_ns = None
        self._clear_block()

    def _clear_block(self) -> None:
        shape = (self._STATS, self.num_drafts)
        self._sum, self._squares, self._rows = np.zeros(shape), np.zeros(shape), np.zeros(shape)
        self._requests, self._request_rows = 0.0, 0

    def update(self, predicted: np.ndarray, live: np.ndarray, accepted: np.ndarray,
               confidence: np.ndarray | None = None, time_ns: np.ndarray | None = None,
               requests: np.ndarray | None = None) -> bool:
        """``predicted [rows, D]`` calibrated acceptance of rows whose drafts ``live`` and
        ``accepted`` say which were observed; ``confidence [rows, D]`` of every row; ``time_ns``
        the record time of each row's step and ``requests`` its batch size. Without ``time_ns``
        the call is one block; without ``requests`` every row is a request. True when a change
        is detected (the statistics then restart)."""
        observed, success = observed_drafts(live, accepted, self.num_drafts)
        values = [np.where(observed, success - predicted, 0.0)]
        masks = [observed]
        if confidence is not None and len(confidence):
            values.append(np.nan_to_num(np.asarray(confidence[:, :self.num_drafts], dtype=np.float64)))
            masks.append(np.ones_like(observed))
        for i, (value, mask) in enumerate(zip(values, masks)):
            self._sum[i] += np.where(mask, value, 0.0).sum(axis=0)
            self._squares[i] += np.where(mask, value ** 2, 0.0).sum(axis=0)
            self._rows[i] += mask.sum(axis=0)
        rows = len(live)
        self._requests += float(np.sum(requests)) if requests is not None else float(rows) * rows
        self._request_rows += rows
        if time_ns is None:
            return self._close()
        latest = int(np.max(time_ns)) if len(time_ns) else None
        if latest is None:
            return False
        if self._block_start_ns is None:
            self._block_start_ns = latest
        if latest - self._block_start_ns < self.block_ns:
            return False
        self._block_start_ns = self._block_end_ns = latest
        return self._close()

    def _close(self) -> bool:
        """Fold the block in; True on an alarm."""
        rows, total = self._rows, self._sum
        requests = self._requests / max(self._request_rows, 1)   # mean batch size over its rows
        self.blocks += 1
        fired = False
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = np.where(rows > 0, total / np.maximum(rows, 1), 0.0)
            second = np.where(rows > 0, self._squares / np.maximum(rows, 1), 0.0)
        seen_any = rows >= 2
        keep = np.where(seen_any, self.reference_keep, 1.0)
        self._moments = keep * self._moments + (1 - keep) * np.stack([mean, second])
        self._moment_weight = keep * self._moment_weight + (1 - keep)
        # the per-row spread over the blocks so far, with the prior sd worth prior_blocks blocks
        slow_mean = np.where(self._moment_weight > 0, self._moments[0] / np.maximum(self._moment_weight, 1e-12), 0.0)
        slow_second = np.where(self._moment_weight > 0, self._moments[1] / np.maximum(self._moment_weight, 1e-12), 0.0)
        blocks = self._moment_weight / (1 - self.reference_keep)     # blocks seen, discounted
        spread = np.maximum(slow_second - slow_mean ** 2, 0.0)
        variance = (blocks * spread + self.prior_blocks * self.prior_sd ** 2) / (blocks + self.prior_blocks)
        sd = np.sqrt(np.maximum(variance, self.min_sd ** 2))
        units = np.minimum(rows, max(requests, 1.0))
        for i in range(self._STATS):
            seen = rows[i] >= 2
            if i == 1:   # the confidence of a batch of few requests is what those requests are
                seen = seen & (requests >= self.min_requests_confidence)
                if not seen.any():
                    continue
                end = self._block_end_ns
                if end is not None and self._read_until_ns is not None \
                        and end - self._read_until_ns > self.restart_after_ns:
                    recent = self.recent_confidence(end - self.restart_after_ns)
                    if recent is not None:
                        self.reference = np.asarray(recent, dtype=np.float64)
                        self.up[i] = self.down[i] = 0.0
                self._read_until_ns = end
                if self.reference is None:
                    self.reference = mean[i].copy()
            if not seen.any():
                continue
            centre = mean[i] - self.reference if i == 1 else mean[i]
            error = sd[i] / np.sqrt(np.maximum(units[i], 1.0))
            rise = np.where(seen, (centre - self.allowance) / error - self.slack, 0.0)
            fall = np.where(seen, (-centre - self.allowance) / error - self.slack, 0.0)
            self.up[i] = np.maximum(0.0, self.up[i] + rise)
            self.down[i] = np.maximum(0.0, self.down[i] + fall)
            if i == 1:
                self.reference = np.where(seen, self.reference_keep * self.reference
                                          + (1 - self.reference_keep) * mean[i], self.reference)
        self._clear_block()
        if max(self.up.max(), self.down.max()) > self.threshold:
            fired = True
            # a position moved where either statistic has come half way to the alarm
            self.moved = (np.maximum(self.up, self.down) > self.threshold / 2).any(axis=0)
            self.rose = bool(self.up.max() >= self.down.max())
            sums = np.maximum(self.up, self.down).max(axis=1)
            self.by_confidence = bool(sums[1] > sums[0])
            self.reset()
            self.alarms += 1
        return fired

    def reset(self) -> None:
        self.up[:] = 0.0
        self.down[:] = 0.0
        self.reference = None
        self._clear_block()
