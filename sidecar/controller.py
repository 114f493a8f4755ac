"""The automatic controller: learns acceptance, cost and load from the rings and, in ``auto``
control mode, writes the per-bucket policy that maximises predicted goodput (committed tokens per
second), with hysteresis and a guardrail on accepted tokens given up.

Usage (the sidecar wires it)::

    controller = AutoController(control, ControllerConfig())
    link = EngineLink(name, control, on_records=controller.observe)   # link thread
    while running:                                                    # main loop, every ~0.5 s
        controller.tick(time.monotonic())
        for name, value in controller.metrics().items(): ...

``observe`` only copies a subsample of each batch into a queue under a lock; every fit and the
search over candidate rules run in ``tick``.
"""

import logging
import threading
from collections import deque
from dataclasses import dataclass

import numpy as np

from vcap.policy import Bucket, Policy
from vcap.segment import FLAG_EXPERTS_SAMPLED, SegmentConfig

from .calibration import AcceptanceCalibration
from .control import StaleGeneration
from .cost_model import ExpertCurve, StepCostFit
from .goodput import candidate_grid, choose_rule, evaluate_rules, rule_of
from .load import EngineQueuePoller, LoadTracker

__all__ = ["ControllerConfig", "AutoController", "CONTROLLER_METRICS", "add_controller_arguments",
           "config_from_args"]

log = logging.getLogger("vcap.controller")

# name, type, help: what metrics() returns, for sidecar/metrics.py
CONTROLLER_METRICS = (
    ("vcap_controller_cost_fit_r2", "gauge", "R^2 of the fitted step time a + b * distinct experts (+ c * bs) on sampled steps"),
    ("vcap_controller_expert_curve_fit_r2", "gauge", "R^2 of the fitted distinct-experts-versus-live-rows curve on sampled steps"),
    ("vcap_controller_explore_cost_ratio", "gauge", "Predicted fraction of goodput lost to exploration steps (every row verified)"),
    ("vcap_controller_guardrail_hits_total", "counter", "Decisions where the goodput-best rule of a bucket broke the tokens-given-up guardrail and was not chosen"),
    ("vcap_controller_predicted_goodput_tokens_per_second", "gauge", "Predicted committed tokens per second of the controller's policy at the current load, exploration included"),
    ("vcap_controller_current_goodput_tokens_per_second", "gauge", "Predicted committed tokens per second of the policy in force at the current load"),
    ("vcap_controller_observed_goodput_tokens_per_second", "gauge", "Measured committed tokens per second over the controller's window of steps"),
    ("vcap_controller_max_tokens_given_up", "gauge", "The guardrail: most accepted drafts per request-step the controller may give up (--max-tokens-given-up)"),
    ("vcap_controller_predicted_tokens_given_up", "gauge", "Predicted accepted drafts given up per request-step by the controller's policy, against verifying every row"),
    ("vcap_controller_policy_writes_total", "counter", "Policies written by the controller"),
    ("vcap_controller_window_rows", "gauge", "Request rows in the controller's estimation window"),
    ("vcap_controller_ready", "gauge", "1 when the controller has enough data and a cost fit to choose a policy"),
    ("vcap_controller_engine_queue_requests", "gauge", "Requests waiting in the engine (records' num_queued, or SGLang's sglang:num_queue_reqs with --engine-metrics)"),
)


@dataclass(slots=True)
class ControllerConfig:
    """Knobs of the automatic controller; each has a ``vcap-sidecar`` flag (see add_controller_arguments)."""

    max_tokens_given_up: float = 0.1      # accepted drafts per request-step, against all-live
    explore_period: int = 0               # 0: chosen from explore_cost_target
    explore_cost_target: float = 0.005    # adaptive exploration: at most this fraction of goodput
    min_explore_period: int = 16
    max_explore_period: int = 400
    min_gain: float = 0.01                # relative goodput gain that justifies a change
    idle_bucket_gain: float = 0.03        # the same for buckets without recent load
    confidence_z: float = 1.0             # a gain must exceed min_gain + z standard errors
    guardrail_z: float = 2.0              # the guardrail is judged at +- z standard errors
    min_interval_s: float = 3.0           # dwell between two writes
    bucket_edges: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    window_rows: int = 16384
    rows_per_record: int = 32
    min_rows: int = 1000
    cost_samples: int = 2048
    load_half_life_s: float = 10.0
    engine_metrics_url: str | None = None
    engine_metrics_interval_s: float = 5.0

    def __post_init__(self):
        edges = tuple(int(e) for e in self.bucket_edges)
        self.bucket_edges = edges
        checks = [
            (self.max_tokens_given_up >= 0, "max_tokens_given_up must be >= 0"),
            (0 <= self.explore_period <= 1_000_000, "explore_period must be in 0..1000000"),
            (0 < self.explore_cost_target < 1, "explore_cost_target must be in (0, 1)"),
            (1 <= self.min_explore_period <= self.max_explore_period, "need 1 <= min_explore_period <= max_explore_period"),
            (min(self.min_gain, self.idle_bucket_gain, self.confidence_z, self.guardrail_z) >= 0, "gains and z must be >= 0"),
            (self.min_interval_s >= 0, "min_interval_s must be >= 0"),
            (len(edges) >= 1 and edges[0] == 1 and all(a < b for a, b in zip(edges, edges[1:])),
             f"bucket_edges must start at 1 and increase, got {edges}"),
            (self.window_rows >= 64 and self.rows_per_record >= 1 and self.min_rows >= 1, "window sizes must be positive"),
            (self.cost_samples >= 32, "cost_samples must be >= 32"),
            (self.load_half_life_s > 0 and self.engine_metrics_interval_s > 0, "intervals must be > 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


def add_controller_arguments(parser) -> None:
    """The controller's ``vcap-sidecar`` flags."""
    add = parser.add_argument
    add("--max-tokens-given-up", type=float, default=0.1,
        help="auto mode: most accepted drafts per request-step the policy may give up against verifying every row")
    add("--explore-period", type=int, default=0, help="auto mode: verify every row every N steps (0: adaptive)")
    add("--explore-cost-target", type=float, default=0.005, help="auto mode: goodput fraction adaptive exploration may cost")
    add("--controller-min-gain", type=float, default=0.01, help="auto mode: predicted relative gain that justifies a change")
    add("--controller-min-interval", type=float, default=3.0, help="auto mode: seconds between two policy changes")
    add("--controller-buckets", default="1,2,4,8,16,32,64,128", help="auto mode: batch-size bucket edges")
    add("--engine-metrics", default=None, metavar="URL",
        help="SGLang's /metrics URL: read sglang:num_queue_reqs for the engine queue")


def config_from_args(args) -> ControllerConfig:
    """Raises ValueError on a bad flag value."""
    edges = tuple(int(v) for v in str(args.controller_buckets).split(",") if v.strip())
    return ControllerConfig(max_tokens_given_up=args.max_tokens_given_up, explore_period=args.explore_period,
                            explore_cost_target=args.explore_cost_target, min_gain=args.controller_min_gain,
                            min_interval_s=args.controller_min_interval, bucket_edges=edges,
                            engine_metrics_url=args.engine_metrics)


_EXPLORE_PERIODS = (16, 24, 32, 48, 64, 96, 128, 192, 256, 400, 600, 1000)


class _RowWindow:
    """Ring buffer of the most recent request rows."""

    def __init__(self, capacity: int, num_drafts: int):
        self.confidence = np.zeros((capacity, num_drafts), dtype=np.float32)
        self.live = np.zeros(capacity, dtype=np.int64)
        self.accepted = np.zeros(capacity, dtype=np.int64)
        self.capacity, self.count, self.cursor = capacity, 0, 0

    def add(self, confidence, live, accepted) -> None:
        n = len(live)
        if n > self.capacity:
            confidence, live, accepted = confidence[-self.capacity:], live[-self.capacity:], accepted[-self.capacity:]
            n = self.capacity
        index = (self.cursor + np.arange(n)) % self.capacity
        self.confidence[index], self.live[index], self.accepted[index] = confidence, live, accepted
        self.cursor = (self.cursor + n) % self.capacity
        self.count = min(self.count + n, self.capacity)

    def arrays(self):
        n = self.count
        return self.confidence[:n], self.live[:n], self.accepted[:n]


class AutoController:
    """Chooses and writes the policy in ``auto`` control mode; learns in every mode.

    ``geometry`` stands in for the attached segment's config when there is none (the
    evaluation harness drives a pure-trace engine).
    """

    def __init__(self, control, config: ControllerConfig | None = None, geometry: SegmentConfig | None = None):
        self.control, self.config, self.geometry = control, config or ControllerConfig(), geometry
        self._lock = threading.Lock()
        self._pending: deque = deque(maxlen=4096)
        self._subsample_rng = np.random.default_rng(0)   # fixed seed: a replayed trace decides the same way
        self._shape = None
        self.poller = EngineQueuePoller(self.config.engine_metrics_url, self.config.engine_metrics_interval_s) \
            if self.config.engine_metrics_url else None
        self.last_write_s = None
        self.guardrail_hits = 0
        self.writes = 0
        self.last_decision = ""
        self._metrics = {name: 0.0 for name, _, _ in CONTROLLER_METRICS}

    # -- link thread ---------------------------------------------------------------------------

    def observe(self, ring: int, records: np.ndarray) -> None:
        """Queue a batch of records (``vcap.segment.record_dtype``) of one ring: a bounded copy."""
        n = len(records)
        if n == 0:
            return
        max_bs = records["live"].shape[1]
        bs = np.minimum(records["bs"].astype(np.int64), max_bs)
        real = np.arange(max_bs)[None, :] < bs[:, None]
        step_index, request = np.nonzero(real)
        limit = self.config.rows_per_record * n
        if len(step_index) > limit:
            chosen = np.sort(self._subsample_rng.choice(len(step_index), limit, replace=False))
            step_index, request = step_index[chosen], request[chosen]
        live_all = np.where(real, records["live"], 0).astype(np.int64)
        accepted_all = np.where(real, np.minimum(records["accepted"], np.maximum(records["live"].astype(np.int64) - 1, 0)), 0)
        flags = records["flags"].astype(np.int64)
        sampled = (flags & FLAG_EXPERTS_SAMPLED) != 0
        batch = {
            "ring": ring, "bs": bs, "flags": flags, "step_ns": records["step_ns"].astype(np.int64),
            "time_ns": records["time_ns"].astype(np.int64), "num_queued": records["num_queued"].astype(np.int64),
            "live_rows": live_all.sum(axis=1), "tokens": accepted_all.sum(axis=1) + bs,
            "confidence": records["confidence"][step_index, request].copy(),
            "live": records["live"][step_index, request].astype(np.int64),
            "accepted": records["accepted"][step_index, request].astype(np.int64),
            "sampled_bs": bs[sampled], "sampled_live_rows": live_all.sum(axis=1)[sampled],
            "sampled_step_ns": records["step_ns"][sampled].astype(np.int64),
            "experts_all": records["experts_all"][sampled].astype(np.int64),
            "experts_live": records["experts_live"][sampled].astype(np.int64),
            "shape": (max_bs, records["confidence"].shape[2], records["experts_all"].shape[1]),
        }
        with self._lock:
            self._pending.append(batch)

    # -- main loop -----------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Fold queued records in, refit, and in auto mode write a better policy if justified."""
        geometry = self._geometry()
        if geometry is None:
            return
        if self._shape != (geometry.max_bs, geometry.num_drafts, geometry.num_moe_layers):
            self._reset(geometry)
        with self._lock:
            batches = list(self._pending)
            self._pending.clear()
        for batch in batches:
            if batch["shape"] == self._shape:
                self._fold(batch)
        if self.poller is not None:
            self.poller.poll_if_due(now)
        self._fit()
        self._decide(now)

    def metrics(self) -> dict[str, float]:
        """Current values of :data:`CONTROLLER_METRICS`, by name."""
        values = dict(self._metrics)
        values["vcap_controller_guardrail_hits_total"] = float(self.guardrail_hits)
        values["vcap_controller_max_tokens_given_up"] = float(self.config.max_tokens_given_up)
        values["vcap_controller_policy_writes_total"] = float(self.writes)
        values["vcap_controller_window_rows"] = float(self.window.count) if self._shape else 0.0
        queue = self.poller.value if self.poller is not None and self.poller.value is not None else (
            self.load.queue if self._shape else 0.0)
        values["vcap_controller_engine_queue_requests"] = float(queue)
        return values

    def close(self) -> None:
        if self.poller is not None:
            self.poller.stop()

    # -- internals -----------------------------------------------------------------------------

    def _geometry(self) -> SegmentConfig | None:
        segment = getattr(self.control, "segment", None)
        return segment.config if segment is not None else self.geometry

    def _reset(self, geometry: SegmentConfig) -> None:
        c = self.config
        num_drafts = geometry.num_drafts
        self.stride, self.max_bs, self.num_layers = geometry.stride, geometry.max_bs, geometry.num_moe_layers
        self.edges = tuple(e for e in c.bucket_edges if e <= geometry.max_bs)[:geometry.max_buckets]
        self.calibration = AcceptanceCalibration(num_drafts)
        self.window = _RowWindow(c.window_rows, num_drafts)
        self.curve = ExpertCurve(geometry.num_moe_layers, geometry.num_experts, geometry.top_k,
                                 geometry.stride * geometry.max_bs)
        self.cost = StepCostFit()
        self.load = LoadTracker(geometry.max_bs, c.load_half_life_s)
        self.rules = candidate_grid(num_drafts)
        size = c.cost_samples
        self._union_rows = np.zeros(2 * size, dtype=np.int64)
        self._union_experts = np.zeros((2 * size, geometry.num_moe_layers), dtype=np.int64)
        self._cost_x = np.zeros((size, 3))      # experts, bs, step_ns
        self._union_count = self._cost_count = 0
        self._union_cursor = self._cost_cursor = 0
        self._steps = deque(maxlen=4096)        # (ring, tokens, step_ns)
        # last: metrics() on another thread takes a set _shape to mean "everything exists"
        self._shape = (geometry.max_bs, num_drafts, geometry.num_moe_layers)

    def _fold(self, batch: dict) -> None:
        self.calibration.update(batch["confidence"], batch["live"], batch["accepted"])
        self.window.add(batch["confidence"], batch["live"], batch["accepted"])
        self.load.add(batch["bs"], batch["time_ns"], batch["num_queued"])
        for tokens, step_ns in zip(batch["tokens"], batch["step_ns"]):
            self._steps.append((batch["ring"], int(tokens), int(step_ns)))
        if len(batch["sampled_bs"]):
            rows = np.concatenate([self.stride * batch["sampled_bs"], batch["sampled_live_rows"]])
            experts = np.concatenate([batch["experts_all"], batch["experts_live"]])
            self._union_cursor, self._union_count = self._push(
                (self._union_rows, self._union_experts), (rows, experts), self._union_cursor, self._union_count)
            cost = np.stack([batch["experts_live"].sum(axis=1), batch["sampled_bs"], batch["sampled_step_ns"]], axis=1)
            self._cost_cursor, self._cost_count = self._push(
                (self._cost_x,), (cost,), self._cost_cursor, self._cost_count)

    @staticmethod
    def _push(buffers, values, cursor, count):
        capacity = len(buffers[0])
        n = min(len(values[0]), capacity)
        index = (cursor + np.arange(n)) % capacity
        for buffer, value in zip(buffers, values):
            buffer[index] = value[-n:]
        return (cursor + n) % capacity, min(count + n, capacity)

    def _fit(self) -> None:
        if self._union_count >= 8:
            n = self._union_count
            self.curve.fit(self._union_rows[:n], self._union_experts[:n])
        if self._cost_count >= self.cost.min_samples:
            x = self._cost_x[:self._cost_count]
            self.cost.fit(x[:, 0], x[:, 1], x[:, 2])
        self._metrics["vcap_controller_cost_fit_r2"] = float(np.nan_to_num(self.cost.r2))
        self._metrics["vcap_controller_expert_curve_fit_r2"] = float(np.nan_to_num(self.curve.r2))
        if self._steps:
            goodput = {}
            for ring, tokens, step_ns in self._steps:
                total = goodput.setdefault(ring, [0, 0])
                total[0] += tokens
                total[1] += step_ns
            self._metrics["vcap_controller_observed_goodput_tokens_per_second"] = float(
                sum(t / (ns / 1e9) for t, ns in goodput.values() if ns > 0))

    def evaluate(self, rules: list[Bucket]):
        """Evaluation of ``rules`` on the current window (see :mod:`vcap.sidecar.goodput`)."""
        confidence, live, accepted = self.window.arrays()
        return evaluate_rules(confidence, live, accepted, self.calibration, rules)

    def current_rule(self, policy: Policy, bs: int) -> Bucket:
        return rule_of(policy, bs, self.stride - 1)

    # -- the decision --------------------------------------------------------------------------

    def _decide(self, now: float) -> None:
        c, num_drafts = self.config, self.stride - 1
        ready = self.window.count >= c.min_rows and self.cost.ready
        self._metrics["vcap_controller_ready"] = float(ready)
        if not ready:
            return
        state = self.control.state()
        current = state.policy
        bounds = list(zip(self.edges, self.edges[1:] + (self.max_bs + 1,)))
        loads = [self.load.points(low, high) for low, high in bounds]
        current_rules = [self.current_rule(current, int(round(float(np.dot(p, w) / w.sum())))) for p, w, _ in loads]
        rules = list(self.rules)
        for rule in current_rules:
            if rule not in rules:
                rules.append(rule)
        evaluation = self.evaluate(rules)
        all_live = rules.index(Bucket(1, num_drafts, num_drafts, (0.0,) * num_drafts))
        chosen, changed, urgent, hit = [], False, False, False
        for (points, weights, share), rule in zip(loads, current_rules):
            reference = rules.index(rule)
            choice = choose_rule(evaluation, points, weights, self.curve, self.cost, c.max_tokens_given_up,
                                 c.guardrail_z, reference)
            if share > 0 and choice.unconstrained != choice.best:
                hit = True
            gain = choice.goodput[choice.best] / choice.goodput[reference] - 1.0
            needed = (c.min_gain if share >= 0.02 else c.idle_bucket_gain) + \
                c.confidence_z * choice.goodput_se[choice.best] / choice.goodput[reference]
            if choice.violating[reference] or (choice.best != reference and gain > needed):
                chosen.append(choice.best)
                changed = True
                urgent |= share > 0 and bool(choice.violating[reference])
            else:
                chosen.append(reference)
        self.guardrail_hits += int(hit)
        explore_period, explore_cost = self._explore(evaluation, loads, chosen, all_live, current)
        totals = self._totals(evaluation, loads, chosen)
        self._metrics["vcap_controller_predicted_goodput_tokens_per_second"] = totals[0] * (1 - explore_cost)
        self._metrics["vcap_controller_current_goodput_tokens_per_second"] = self._totals(
            evaluation, loads, [rules.index(r) for r in current_rules])[0]
        self._metrics["vcap_controller_predicted_tokens_given_up"] = totals[1]
        self._metrics["vcap_controller_explore_cost_ratio"] = explore_cost
        changed |= explore_period != current.explore_period and (
            current.mode != "conf" or state.source != "auto")
        if state.control_mode != "auto" or not changed:
            return
        if not urgent and self.last_write_s is not None and now - self.last_write_s < c.min_interval_s:
            return
        self._write(state, rules, chosen, explore_period, now)

    def _totals(self, evaluation, loads, chosen) -> tuple[float, float]:
        """Predicted goodput and tokens given up per request-step of per-bucket rules ``chosen``."""
        committed = seconds = given_up = requests = 0.0
        for (points, weights, share), index in zip(loads, chosen):
            if share <= 0:
                continue
            for bs, weight in zip(points, weights):
                w = share * weight
                committed += w * bs * evaluation.tokens[index]
                seconds += w * evaluation.step_time_ns(bs, self.curve, self.cost)[index] / 1e9
                given_up += w * bs * evaluation.given_up[index]
                requests += w * bs
        return (committed / seconds if seconds else 0.0), (given_up / requests if requests else 0.0)

    def _explore(self, evaluation, loads, chosen, all_live, current) -> tuple[int, float]:
        """Exploration period to use, and the fraction of goodput it is predicted to cost."""
        policy_goodput = self._totals(evaluation, loads, chosen)[0]
        off = [all_live] * len(chosen)
        # per-step totals of both, so a mix of (P - 1) policy steps and one all-live step can be formed
        policy_step = self._step_totals(evaluation, loads, chosen)
        off_step = self._step_totals(evaluation, loads, off)

        def cost(period: int) -> float:
            if period <= 0 or policy_goodput <= 0:
                return 0.0
            mixed = ((period - 1) * policy_step[0] + off_step[0]) / ((period - 1) * policy_step[1] + off_step[1])
            return max(0.0, 1.0 - mixed / policy_goodput)

        c = self.config
        if c.explore_period:
            return c.explore_period, cost(c.explore_period)
        target = c.explore_cost_target
        if current.explore_period and target / 4 <= cost(current.explore_period) <= 2 * target:
            return current.explore_period, cost(current.explore_period)
        periods = [p for p in _EXPLORE_PERIODS if c.min_explore_period <= p <= c.max_explore_period] or [c.max_explore_period]
        period = next((p for p in periods if cost(p) <= target), periods[-1])
        return period, cost(period)

    def _step_totals(self, evaluation, loads, chosen) -> tuple[float, float]:
        committed = seconds = 0.0
        for (points, weights, share), index in zip(loads, chosen):
            for bs, weight in zip(points, weights):
                committed += share * weight * bs * evaluation.tokens[index]
                seconds += share * weight * evaluation.step_time_ns(bs, self.curve, self.cost)[index] / 1e9
        return committed, max(seconds, 1e-12)

    def _write(self, state, rules, chosen, explore_period: int, now: float) -> None:
        num_drafts = self.stride - 1
        buckets = []
        for edge, index in zip(self.edges, chosen):
            rule = rules[index]
            if buckets and (buckets[-1].k_min, buckets[-1].k_max, buckets[-1].thresholds) == (
                    rule.k_min, rule.k_max, rule.thresholds):
                continue  # same rule as the bucket below: one bucket
            buckets.append(Bucket(edge, rule.k_min, rule.k_max, tuple(rule.thresholds)))
        policy = Policy("conf", num_drafts, tuple(buckets), explore_period)
        try:
            self.control.set_policy(policy, "auto", who="controller", expected_generation=state.generation,
                                    reason=self.last_decision)
        except StaleGeneration:
            return  # someone else wrote in between: decide again next tick
        self.last_write_s = now
        self.writes += 1
        log.info("controller wrote %d bucket(s), explore period %d", len(buckets), explore_period)
