"""The controller's model of one engine geometry: calibrated acceptance, expert union and step
cost, load per batch size, and the window of recent request rows that candidate rules are
evaluated on."""

from collections import deque

import numpy as np

from vcap.policy import Bucket
from vcap.segment import SegmentConfig

from .calibration import AcceptanceCalibration
from .config import ControllerConfig
from .cost_model import ExpertCurve, StepCostFit
from .goodput import Evaluation, candidate_grid, evaluate_rules
from .load import BucketLoad, LoadTracker
from .samples import Observation, SampleRing

__all__ = ["EngineModel"]


class EngineModel:
    """Learns from :class:`Observation` s of one geometry (``shape``); not thread safe."""

    def __init__(self, geometry: SegmentConfig, config: ControllerConfig):
        num_drafts, layers = geometry.num_drafts, geometry.num_moe_layers
        self.shape = (geometry.max_bs, num_drafts, layers)
        self.stride, self.max_bs = geometry.stride, geometry.max_bs
        self.edges = tuple(e for e in config.bucket_edges if e <= geometry.max_bs)[:geometry.max_buckets]
        self.calibration = AcceptanceCalibration(num_drafts)
        self.window = SampleRing(config.window_rows, ((num_drafts,), np.float32), ((), np.int64), ((), np.int64))
        self.curve = ExpertCurve(layers, geometry.num_experts, geometry.top_k, geometry.stride * geometry.max_bs)
        self.cost = StepCostFit()
        self.load = LoadTracker(geometry.max_bs, config.load_half_life_s)
        self.rules = candidate_grid(num_drafts)
        self.unions = SampleRing(2 * config.cost_samples, ((), np.int64), ((layers,), np.int64))  # rows, experts
        self.costs = SampleRing(config.cost_samples, *[((), np.float64)] * 3)  # experts, bs, step_ns
        self.steps = deque(maxlen=4096)  # (ring, tokens, step_ns)

    @property
    def num_drafts(self) -> int:
        return self.stride - 1

    def fold(self, observation: Observation) -> None:
        o = observation
        self.calibration.update(o.confidence, o.live, o.accepted)
        self.window.add(o.confidence, o.live, o.accepted)
        self.load.add(o.bs, o.time_ns, o.num_queued)
        self.steps.extend((o.ring, int(tokens), int(step_ns)) for tokens, step_ns in zip(o.tokens, o.step_ns))
        if len(o.sampled_bs):
            # every sampled step is two points of the union curve: all rows and live rows
            self.unions.add(np.concatenate([self.stride * o.sampled_bs, o.sampled_live_rows]),
                            np.concatenate([o.experts_all, o.experts_live]))
            self.costs.add(o.experts_live.sum(axis=1), o.sampled_bs, o.sampled_step_ns)

    def fit(self) -> None:
        if self.unions.count >= 8:
            self.curve.fit(*self.unions.arrays())
        if self.costs.count >= self.cost.min_samples:
            self.cost.fit(*self.costs.arrays())

    def observed_goodput(self) -> float:
        """Committed tokens per second over the recent steps, summed over rings."""
        per_ring = {}
        for ring, tokens, step_ns in self.steps:
            total = per_ring.setdefault(ring, [0, 0])
            total[0] += tokens
            total[1] += step_ns
        return float(sum(t / (ns / 1e9) for t, ns in per_ring.values() if ns > 0))

    def ready(self, min_rows: int) -> bool:
        return self.window.count >= min_rows and self.cost.ready

    def bucket_loads(self) -> list[BucketLoad]:
        """The load of each policy bucket ``[edge, next edge)``."""
        bounds = zip(self.edges, self.edges[1:] + (self.max_bs + 1,))
        return [self.load.points(low, high) for low, high in bounds]

    def evaluate(self, rules: list[Bucket]) -> Evaluation:
        """``rules`` on the window (see :mod:`vcap.sidecar.controller.goodput`)."""
        return evaluate_rules(*self.window.arrays(), self.calibration, rules)
