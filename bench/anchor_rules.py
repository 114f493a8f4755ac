"""Anchor rules for bench/bench_loop.py: the verify-length rules vcap's users would pick instead.

Each external rule turns a step's confidence into live lengths ``L = 1 + k`` per request; the loop
applies them through vcap's own mechanism (the hook, dead rows dropped in the router) by handing
the hook a 0/1 confidence under a ``conf`` policy with threshold 0.5 (``MASK_POLICY``): the
running product passes exactly the first ``k`` positions. vcap clamps ``k >= 1``, so a rule's
``k = 0`` (verify the anchor only) runs as ``k = 1``: counted in ``clamped``.

- :class:`SglangPlanner`: SGLang 0.5.23's own DSpark planner, called from the installed wheel
  (``compute_verify_token_budget`` with the survival history of the previous step, an SPS table
  measured on the loop, then ``schedule_verify_lens_topk_from_survival``, the torch body of
  ``ScheduleVerifyLensTopk``, on the current survival).
- :class:`VllmRule`: vLLM's DSpark adaptive verification (PR #47808), reimplemented from
  vllm-project/vllm@8eadfc2c4c29812fba0dfe8a547b4ef29bdafec9,
  vllm/v1/worker/gpu/spec_decode/adaptive_verification.py: ``_compute_budget`` (budget = argmax of
  ``(n + cumsum(sorted stale survival)) / (draft_cost[n] + verify_cost[n + B])`` over the previous
  step's confidence, cost tables from start-up timings made monotone by a running max and linearly
  interpolated, ``build_cost_tables_from_curves``) and ``_assign_draft_token_budget_kernel``
  (top-B candidates by the current survival, ties by candidate index). The per-request EMA of 0.8
  that issue 13 names is not in that file; ``ema`` below adds it as the issue describes it
  (off by default, LABELLED: not from vLLM's source).
"""

import numpy as np

from vcap.policy import Bucket, Policy

MASK_POLICY = Policy("conf", 5, (Bucket(1, 1, 5, (0.5,) * 5),))


def mask_confidence(live: np.ndarray, num_drafts: int) -> np.ndarray:
    """The 0/1 confidence under which ``MASK_POLICY`` yields ``live`` (k clamped to >= 1)."""
    k = np.clip(np.asarray(live) - 1, 1, num_drafts)
    return (np.arange(num_drafts)[None, :] < k[:, None]).astype(np.float32)


class _History:
    """Each request's confidence of its previous step, by request id (ones for a new request)."""

    def __init__(self, num_drafts: int, ema: float | None = None):
        self.num_drafts, self.ema = num_drafts, ema
        self.previous: dict[int, np.ndarray] = {}
        self.clamped = 0
        self.steps = 0

    def stale(self, request_ids: np.ndarray) -> np.ndarray:
        ones = np.ones(self.num_drafts)
        return np.stack([self.previous.get(int(i), ones) for i in request_ids])

    def update(self, request_ids: np.ndarray, confidence: np.ndarray) -> None:
        current = {}
        for i, row in zip(request_ids.tolist(), confidence.astype(np.float64)):
            old = self.previous.get(i)
            current[i] = row if self.ema is None or old is None else self.ema * old + (1 - self.ema) * row
        self.previous = current

    def count(self, verify_lens: np.ndarray) -> np.ndarray:
        self.steps += 1
        self.clamped += int((verify_lens < 2).sum())
        return verify_lens


class SglangPlanner(_History):
    """SGLang 0.5.23's planner (the installed wheel) with a loop-measured SPS table."""

    def __init__(self, num_drafts: int, sps_points: list[tuple[int, float]]):
        super().__init__(num_drafts)
        from sglang.kernels.ops.speculative.dspark.dspark_schedule import schedule_verify_lens_topk_from_survival
        from sglang.srt.speculative.dspark_components.dspark_planner import (DSparkScheduleConfig,
                                                                             compute_verify_token_budget)
        from sglang.srt.speculative.dspark_components.dspark_sps import profile_sps_table
        import torch
        self._torch, self._budget, self._schedule = torch, compute_verify_token_budget, schedule_verify_lens_topk_from_survival
        self.cfg = DSparkScheduleConfig(gamma=num_drafts)
        self.sps_table = profile_sps_table(probes=sps_points)

    def live(self, confidence: np.ndarray, request_ids: np.ndarray) -> np.ndarray:
        torch, bs = self._torch, len(request_ids)
        history = torch.cumprod(torch.from_numpy(self.stale(request_ids)).float(), dim=1)
        budget = self._budget(history_survival_probs=history, sps_table=self.sps_table, cfg=self.cfg).budget
        survival = torch.cumprod(torch.from_numpy(confidence[:bs]).float(), dim=1)
        lens = self._schedule(survival_probs=survival, budget=budget, cfg=self.cfg).numpy().astype(np.int64)
        self.update(request_ids, confidence[:bs])
        return self.count(lens)


def vllm_cost_table(curve: list[tuple[int, float]], limit: int) -> np.ndarray:
    """``build_cost_tables_from_curves``' table: running max, linear interpolation, linear extrapolation."""
    xs, ys = np.asarray(sorted(curve), dtype=np.float64).T
    ys = np.maximum.accumulate(ys)
    values = np.arange(limit + 1)
    table = np.interp(values, xs, ys)
    if len(xs) > 1:
        after = values > xs[-1]
        table[after] = ys[-1] + (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) * (values[after] - xs[-1])
    return np.maximum(table, 1e-6)


class VllmRule(_History):
    """vLLM's adaptive verification (see the module docstring for the source and commit)."""

    def __init__(self, max_bs: int, num_drafts: int, verify_curve: list[tuple[int, float]], ema: float | None = None):
        super().__init__(num_drafts, ema)
        self.verify_cost = vllm_cost_table(verify_curve, max_bs * (num_drafts + 1))
        self.draft_cost = 0.0   # the drafter is the same under every rule here: no draft cost term

    def budget(self, stale: np.ndarray) -> int:
        n = stale.shape[0]
        scores = np.sort(np.cumprod(stale, axis=1).ravel())[::-1]
        expected = np.concatenate(([n], n + np.cumsum(scores)))
        costs = self.draft_cost + self.verify_cost[n:n + scores.size + 1]
        return int(np.argmax(expected / costs))

    def live(self, confidence: np.ndarray, request_ids: np.ndarray) -> np.ndarray:
        bs = len(request_ids)
        budget = self.budget(self.stale(request_ids))
        survival = np.cumprod(confidence[:bs].astype(np.float32), axis=1).ravel()
        # descending survival, ties by candidate index (the kernel's packed sort key)
        order = np.lexsort((np.arange(survival.size), -survival))
        extra = np.bincount(order[:budget] // self.num_drafts, minlength=bs)
        self.update(request_ids, confidence[:bs])
        return self.count(1 + extra)
