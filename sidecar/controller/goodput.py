"""Counterfactual goodput of candidate verify rules on a window of recorded request rows.

For a candidate rule (thresholds, ``k_min``, ``k_max``: one policy bucket) the live length of
every recorded row is recomputed with the engine's reference rule on its recorded confidence. Its
accepted drafts are then known exactly where the record says so, and predicted only where the
record is censored:

- ``L' <= L``: ``min(accepted, L' - 1)`` (acceptance is a prefix; capping it is exact);
- ``L' > L`` and the row stopped before its cap (``accepted < L - 1``): ``accepted`` (the rejection
  was observed);
- ``L' > L`` and the row hit its cap: ``L - 1`` plus the expected extra accepted drafts under the
  calibrated acceptance, ``sum_{i=L}^{L'-1} prod_{j=L}^{i} p_j``.

Committed tokens are accepted + 1 per request. Step time comes from the cost fit evaluated at the
batch size, the candidate's live rows and their distinct experts; goodput = committed tokens per second.
"""

from dataclasses import dataclass

import numpy as np

from vcap.policy import Bucket

from .calibration import AcceptanceCalibration, LiftedCalibration, running_product
from .cost_model import ExpertCurve, StepCostFit

__all__ = ["THRESHOLD_GRID", "candidate_grid", "accepted_table", "live_for_rules", "Evaluation",
           "evaluate_rules", "BucketChoice", "choose_rule"]

# Thresholds on the running product of survival (uniform across positions).
THRESHOLD_GRID = (0.0, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.13, 0.16, 0.2, 0.25, 0.3, 0.35, 0.4,
                  0.5, 0.6, 0.7, 0.8)
_NUM_CHUNKS = 8


def candidate_grid(num_drafts: int, thresholds=THRESHOLD_GRID) -> list[Bucket]:
    """Every uniform threshold x ``k_max`` (``k_min = 1``), ``min_bs`` left at 1."""
    rules = []
    for k_max in range(1, num_drafts + 1):
        for threshold in thresholds:
            if threshold == 0.0:
                rules.append(Bucket(1, k_max, k_max, (0.0,) * num_drafts))  # fixed k = k_max
            else:
                rules.append(Bucket(1, 1, k_max, (float(threshold),) * num_drafts))
    return rules


def live_for_rules(running: np.ndarray, rules: list[Bucket]) -> np.ndarray:
    """``[rows, rules]`` live lengths, as :func:`vcap.engine_hook.reference.live_lengths` computes
    them from the float32 running product of the clipped confidence."""
    num_drafts = running.shape[1]
    if not rules:
        return np.empty((running.shape[0], 0), dtype=np.int64)
    # leading passes once per distinct threshold vector (the expensive part), all in one array op;
    # each rule then clips its vector's column to its k bounds
    vectors = [tuple(rule.thresholds[:num_drafts]) for rule in rules]
    index = {vector: i for i, vector in enumerate(dict.fromkeys(vectors))}
    thresholds = np.asarray(list(index), dtype=np.float32)                           # [vectors, D]
    passes = running[:, None, :] >= thresholds[None, :, :]
    leading = np.logical_and.accumulate(passes, axis=2).sum(axis=2)
    column = [index[vector] for vector in vectors]
    k_min = np.array([min(max(int(rule.k_min), 1), num_drafts) for rule in rules])
    k_max = np.maximum(np.array([min(int(rule.k_max), num_drafts) for rule in rules]), k_min)
    return np.clip(leading[:, column], k_min[None, :], k_max[None, :]).astype(np.int64) + 1


def accepted_table(confidence: np.ndarray, live: np.ndarray, accepted: np.ndarray,
                   calibration: AcceptanceCalibration | LiftedCalibration | None) -> np.ndarray:
    """``[rows, stride + 1]``: accepted drafts of each row had it verified ``L' - 1`` drafts
    (column ``L'``; column 0 unused), exact where observed, expected where censored."""
    rows, num_drafts = confidence.shape
    stride = num_drafts + 1
    live = np.clip(np.asarray(live, dtype=np.int64), 1, stride)
    accepted = np.minimum(np.asarray(accepted, dtype=np.int64), live - 1)
    targets = np.arange(stride + 1)
    table = np.minimum(accepted[:, None], np.maximum(targets - 1, 0)[None, :]).astype(np.float64)
    censored = (accepted == live - 1) & (live < stride)
    if calibration is not None and censored.any():
        p = np.clip(calibration.predict(confidence[censored]), 1e-9, 1.0)
        # P[j] = prod_{m<=j} p_m, Q[j] = sum_{m<=j} P[m], both with index 0 = empty
        prefix = np.concatenate([np.ones((len(p), 1)), np.cumprod(p, axis=1)], axis=1)
        cumulative = np.concatenate([np.zeros((len(p), 1)), np.cumsum(prefix[:, 1:], axis=1)], axis=1)
        row_live = live[censored]
        index = np.arange(len(p))
        base_prefix = prefix[index, row_live - 1]
        base_cumulative = cumulative[index, row_live - 1]
        for target in range(2, stride + 1):
            later = target > row_live
            extra = (cumulative[index, target - 1] - base_cumulative) / base_prefix
            column = table[censored, target]
            column[later] = (row_live - 1)[later] + extra[later]
            table[censored, target] = column
    return table


@dataclass(slots=True)
class Evaluation:
    """Per rule: mean committed tokens per request, mean live length, tokens given up per
    request-step against all-live, and its standard error (chunks of the window)."""

    tokens: np.ndarray
    mean_live: np.ndarray
    given_up: np.ndarray
    given_up_se: np.ndarray
    chunk_tokens: np.ndarray     # [chunks, rules]
    chunk_live: np.ndarray       # [chunks, rules]

    def step_time_ns(self, bs, curve: ExpertCurve, cost: StepCostFit, chunk: bool = False,
                     correction: np.ndarray | None = None) -> np.ndarray:
        """Predicted step time of each rule at batch size ``bs``, times ``correction`` (per rule:
        measured over predicted step time, :mod:`.measured`) when given."""
        mean_live = self.chunk_live if chunk else self.mean_live
        time_ns = cost.predict(curve.total(bs * mean_live), bs, bs * mean_live)
        return time_ns if correction is None else time_ns * correction

    def goodput(self, bs_points: np.ndarray, weights: np.ndarray, curve: ExpertCurve,
                cost: StepCostFit, chunk: bool = False, correction: np.ndarray | None = None) -> np.ndarray:
        """Tokens per second of each rule over steps at ``bs_points`` weighted by ``weights``."""
        tokens = self.chunk_tokens if chunk else self.tokens
        committed = sum(w * bs * tokens for bs, w in zip(bs_points, weights))
        seconds = sum(w * self.step_time_ns(bs, curve, cost, chunk, correction)
                      for bs, w in zip(bs_points, weights)) / 1e9
        return committed / seconds


def evaluate_rules(confidence: np.ndarray, live: np.ndarray, accepted: np.ndarray,
                   calibration: AcceptanceCalibration | LiftedCalibration | None, rules: list[Bucket]) -> Evaluation:
    """Evaluate ``rules`` on the recorded rows (see the module docstring)."""
    table = accepted_table(confidence, live, accepted, calibration)
    stride = confidence.shape[1] + 1
    candidate_live = live_for_rules(running_product(confidence), rules)
    rows = np.arange(len(table))[:, None]
    predicted = table[rows, candidate_live]                   # [rows, rules]
    given_up_rows = table[:, stride][:, None] - predicted
    count = len(table)
    chunks = max(1, min(_NUM_CHUNKS, count // 16))
    usable = count // chunks * chunks
    shape = (chunks, usable // chunks, len(rules))

    def chunked(values):
        return values[:usable].reshape(shape).mean(axis=1)

    chunk_given_up = chunked(given_up_rows)
    se = chunk_given_up.std(axis=0, ddof=1) / np.sqrt(chunks) if chunks > 1 else np.zeros(len(rules))
    return Evaluation(tokens=predicted.mean(axis=0) + 1.0, mean_live=candidate_live.mean(axis=0),
                      given_up=given_up_rows.mean(axis=0), given_up_se=se,
                      chunk_tokens=chunked(predicted) + 1.0, chunk_live=chunked(candidate_live.astype(np.float64)))


@dataclass(slots=True)
class BucketChoice:
    """The outcome of the search for one batch-size bucket."""

    best: int                 # index of the best rule within the guardrail
    unconstrained: int        # index of the best rule ignoring it
    goodput: np.ndarray       # per rule, tokens per second over the bucket's batch sizes
    goodput_se: np.ndarray    # per rule, standard error of the gain against ``reference``
    feasible: np.ndarray      # per rule, within the guardrail at z standard errors above the estimate
    violating: np.ndarray     # per rule, over the guardrail at z standard errors below the estimate


def choose_rule(evaluation: Evaluation, bs_points, weights, curve: ExpertCurve, cost: StepCostFit,
                max_given_up: float, z: float, reference: int, all_live: int | None = None,
                correction: np.ndarray | None = None) -> BucketChoice:
    """The rule of best predicted goodput among the feasible ones.

    Feasible: (1) its goodput gain over verifying every row (``all_live``, when given) stays
    positive ``z`` standard errors down: the guardrail against model error, which lets a rule give
    up drafts only where the step time it saves pays for them by more than the uncertainty of the
    estimate; (2) when ``max_given_up`` is finite (the operator's explicit bound), its tokens
    given up, ``z`` standard errors up, stay within it. A rule in force is left only when it is
    infeasible by the same margins the other way (``violating``): the band between the two keeps
    the choice from flapping around the bound. ``goodput_se`` is the standard error of each rule's
    goodput difference to rule ``reference`` (chunks of the window). ``correction``: per rule,
    measured over predicted step time (:mod:`.measured`)."""
    goodput = evaluation.goodput(bs_points, weights, curve, cost, correction=correction)
    chunk = evaluation.goodput(bs_points, weights, curve, cost, chunk=True, correction=correction)   # [chunks, rules]

    def gain_se(base: int) -> np.ndarray:
        if chunk.shape[0] <= 1:
            return np.zeros_like(goodput)
        gain = chunk / chunk[:, [base]]
        return gain.std(axis=0, ddof=1) / np.sqrt(chunk.shape[0]) * goodput[base]

    se = gain_se(reference)
    bounded = np.isfinite(max_given_up)
    feasible = np.ones(len(goodput), dtype=bool)
    violating = np.zeros(len(goodput), dtype=bool)
    if bounded:
        feasible &= evaluation.given_up + z * evaluation.given_up_se <= max_given_up + 1e-12
        violating |= evaluation.given_up - z * evaluation.given_up_se > max_given_up + 1e-12
    if all_live is not None:
        live_se = gain_se(all_live)
        margin = goodput - goodput[all_live]
        feasible &= margin - z * live_se >= 0
        violating |= margin + z * live_se < 0
        feasible[all_live] = True
        violating[all_live] = False
    if not feasible.any():
        # all-live gives up nothing; it is always in the grid as fixed k = D
        feasible = evaluation.given_up <= 1e-12
    masked = np.where(feasible, goodput, -np.inf)
    return BucketChoice(best=int(np.argmax(masked)), unconstrained=int(np.argmax(goodput)),
                        goodput=goodput, goodput_se=se, feasible=feasible, violating=violating)
