"""The automatic controller: learns acceptance, cost and load from the rings and, in ``auto``
control mode, writes the per-bucket policy that maximises predicted goodput (committed tokens per
second), with hysteresis and a guardrail on accepted tokens given up.

Usage (the sidecar wires it)::

    controller = AutoController(control, ControllerConfig(), engine_config=link.engine_config)
    link = EngineLink(name, control, on_records=controller.observe)   # link thread
    while running:                                                    # main loop, every ~0.5 s
        controller.tick(time.monotonic())
        controller.readings()                                         # for Prometheus

``observe`` only copies a subsample of each batch into a queue under a lock; every fit and the
search over candidate rules run in ``tick``.
"""

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field, fields, replace
from typing import Callable

import numpy as np

from vcap.policy import Bucket, Policy
from vcap.segment import SegmentConfig

from ..policy_control import StaleGeneration
from ..telemetry import RecordBatch
from .config import ControllerConfig
from .decision import plan, policy_of, rise_matters
from .load import EngineQueuePoller
from .model import EngineModel
from .samples import observe
from .step_profile import load_step_profile

__all__ = ["AutoController", "ControllerReadings", "CONTROLLER_METRICS"]

log = logging.getLogger("vcap.controller")


def _prior_geometry(config: SegmentConfig) -> tuple[int, ...]:
    """What a recording must share with the engine to be its prior: the rows, layers and routing."""
    return config.stride, config.max_bs, config.num_moe_layers, config.num_experts, config.top_k


def _gauge(documentation: str) -> dict:
    return {"kind": "gauge", "help": documentation}


def _counter(documentation: str) -> dict:
    return {"kind": "counter", "help": documentation}


@dataclass(slots=True)
class ControllerReadings:
    """What the controller reports; field ``x`` is the Prometheus metric ``vcap_controller_x``."""

    cost_fit_r2: float = field(default=0.0, metadata=_gauge(
        "R^2 of the fitted step time a + b * distinct experts (+ d * live rows) (+ c * bs) on sampled steps"))
    expert_curve_fit_r2: float = field(default=0.0, metadata=_gauge(
        "R^2 of the fitted distinct-experts-versus-live-rows curve on sampled steps"))
    explore_cost_ratio: float = field(default=0.0, metadata=_gauge(
        "Predicted fraction of goodput lost to exploration steps (every row verified)"))
    guardrail_hits_total: float = field(default=0.0, metadata=_counter(
        "Decisions where the goodput-best rule of a bucket broke the tokens-given-up guardrail and was not chosen"))
    predicted_goodput_tokens_per_second: float = field(default=0.0, metadata=_gauge(
        "Predicted committed tokens per second of the controller's policy at the current load, exploration included"))
    current_goodput_tokens_per_second: float = field(default=0.0, metadata=_gauge(
        "Predicted committed tokens per second of the policy in force at the current load, exploration included"))
    observed_goodput_tokens_per_second: float = field(default=0.0, metadata=_gauge(
        "Measured committed tokens per second of one engine (the mean over attention-DP ranks, as the predictions) over the recent steps that ran the policy in force, exploration included"))
    max_tokens_given_up: float = field(default=0.0, metadata=_gauge(
        "The operator's bound: most accepted drafts per request-step the controller may give up (--max-tokens-given-up; +Inf: none, only the goodput guardrail)"))
    predicted_tokens_given_up: float = field(default=0.0, metadata=_gauge(
        "Predicted accepted drafts given up per request-step by the controller's policy, against verifying every row"))
    policy_writes_total: float = field(default=0.0, metadata=_counter("Policies written by the controller"))
    window_rows: float = field(default=0.0, metadata=_gauge("Request rows in the controller's estimation window"))
    ready: float = field(default=0.0, metadata=_gauge(
        "1 when the controller has enough data and a cost fit to choose a policy"))
    trials_total: float = field(default=0.0, metadata=_counter(
        "Short trials the controller ran of a rule whose step time it had not measured (the choice then uses the measured time)"))
    engine_queue_requests: float = field(default=0.0, metadata=_gauge(
        "Requests waiting in the engine (records' num_queued, or SGLang's sglang:num_queue_reqs with --engine-metrics)"))
    acceptance_changes_total: float = field(default=0.0, metadata=_counter(
        "Changes of acceptance forgotten (the drift test's, and rises of the first draft's acceptance on the "
        "recent rows under a rule that caps, where a longer rule would win had the capped drafts risen as "
        "much): each forgets the window and the calibration's older rows"))
    acceptance_moved: float = field(default=0.0, metadata=_gauge(
        "1 while the first draft's acceptance moved within the window, too little for the drift test (a few "
        "requests a batch): busy buckets are judged on their recent rows until the window has none from before it"))
    judged_on_recent_rows: float = field(default=0.0, metadata=_gauge(
        "Busy policy buckets the last decision judged on their recent rows alone (the last 20 s), as the load or "
        "the acceptance moved within the window (0: every bucket judged on the whole window)"))
    ticks_total: float = field(default=0.0, metadata=_counter("Controller ticks run (about two a second)"))
    tick_seconds_total: float = field(default=0.0, metadata=_counter(
        "Wall time spent in controller ticks (folding records, refitting, deciding): its rate() is the share of "
        "a core the ticks hold; divided by rate(vcap_controller_ticks_total), the mean tick"))


# (name, kind, help) of every reading, derived from ControllerReadings
CONTROLLER_METRICS = tuple((f"vcap_controller_{item.name}", item.metadata["kind"], item.metadata["help"])
                           for item in fields(ControllerReadings))


class AutoController:
    """Chooses and writes the policy in ``auto`` control mode; learns in every mode.

    ``engine_config`` returns the attached engine's geometry, or None while there is none (a
    pure-trace engine, as the evaluation harness drives, returns a constant one).
    """

    def __init__(self, control, config: ControllerConfig | None = None,
                 engine_config: Callable[[], SegmentConfig | None] = lambda: None):
        self.control, self.config, self.engine_config = control, config or ControllerConfig(), engine_config
        self._lock = threading.Lock()
        self._pending: deque = deque(maxlen=4096)
        self._subsample_rng = np.random.default_rng(0)   # fixed seed: a replayed trace decides the same way
        # a bad profile fails here, at start-up, with the file's problem in the message
        self.profile = load_step_profile(self.config.sps_table) if self.config.sps_table else None
        if self.config.prior_recording:   # absent is fine (the first run writes it); unreadable is not
            from ..recorder import check_recording
            try:
                check_recording(self.config.prior_recording)
            except (OSError, ValueError) as error:
                raise ValueError(f"--controller-prior: {error}") from None
        self.model: EngineModel | None = None
        self.poller = EngineQueuePoller(self.config.engine_metrics_url, self.config.engine_metrics_interval_s) \
            if self.config.engine_metrics_url else None
        self.last_write_s = None
        self._planned = None      # (when, policy generation) of the last decision
        self._relearning = False   # every row verified after a change of acceptance, until the next decision
        self._replaced = None      # (stopgap's generation, the policy it replaced) after a rise
        self._policies: dict[int, Policy] = {}   # generation -> policy in force then (the steps' rules)
        self._readings = ControllerReadings(max_tokens_given_up=float(self.config.max_tokens_given_up))

    # -- link thread ---------------------------------------------------------------------------

    def observe(self, ring: int, batch: RecordBatch) -> None:
        """Queue a bounded copy of a batch of records of one ring."""
        if len(batch) == 0:
            return
        observation = observe(ring, batch, self.config.rows_per_record, self._subsample_rng)
        with self._lock:
            self._pending.append(observation)

    # -- main loop -----------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Fold queued records in, refit, and in auto mode write a better policy if justified."""
        started = time.perf_counter()
        try:
            self._tick(now)
        finally:
            self._readings.ticks_total += 1
            self._readings.tick_seconds_total += time.perf_counter() - started

    def _tick(self, now: float) -> None:
        geometry = self.engine_config()
        if geometry is None:
            return
        model = self.model
        if model is None or model.shape != (geometry.max_bs, geometry.num_drafts, geometry.num_moe_layers):
            model = self.model = EngineModel(geometry, self.config, self.profile)
            if self.config.prior_recording:  # a recording of another geometry primes nothing
                try:
                    rows = self.prime_from_recording(self.config.prior_recording)
                    log.info("controller prior: %d rows from %s", rows, self.config.prior_recording)
                except (OSError, ValueError) as error:   # checked at the start; changed since
                    log.error("controller prior %s not used: %s", self.config.prior_recording, error)
                model = self.model
        with self._lock:
            observations = list(self._pending)
            self._pending.clear()
        self._note_policy()
        changes = model.changes
        for observation in observations:
            if observation.shape == model.shape:
                model.fold(observation)
                model.measure(observation, self._policies)
        if self.poller is not None:
            self.poller.poll_if_due(now)
        model.fit()
        self._readings.cost_fit_r2 = float(np.nan_to_num(model.cost.r2))
        self._readings.expert_curve_fit_r2 = float(np.nan_to_num(model.curve.r2))
        if model.steps:
            self._readings.observed_goodput_tokens_per_second = model.observed_goodput()
        self._decide(model, now)
        # after the decision: its reading of the recent rows may find a change too
        self._readings.acceptance_changes_total += model.changes - changes

    def prime_from_recording(self, path: str, max_steps: int = 20_000) -> int:
        """Start from the last recording (``vcap-sidecar --record`` files, read with
        :mod:`vcap.sidecar.recorder`): its newest ``max_steps`` steps are the prior of the
        calibration, the expert curve and the step cost. Returns the rows read (0 when the
        recording is missing or of another engine geometry than the attached engine's).

        Raises:
            ValueError, OSError: the recording cannot be read (not one, corrupt).
        """
        from ..recorder import read_newest
        from ..telemetry import unpack

        config, records = read_newest(path, max_steps)
        if config is None or not len(records):
            return 0
        geometry = self.engine_config() or config
        if _prior_geometry(geometry) != _prior_geometry(config):
            log.warning("controller prior %s: recorded on another engine geometry (%s) than this engine's (%s); "
                        "not used", path, _prior_geometry(config), _prior_geometry(geometry))
            return 0
        model = self.model = EngineModel(geometry, self.config, self.profile)
        rng = np.random.default_rng(0)
        observations = [observe(0, unpack(records[i:i + 256]), self.config.rows_per_record, rng)
                        for i in range(0, len(records), 256)]
        return model.prime([o for o in observations if o.shape == model.shape])

    def readings(self) -> ControllerReadings:
        """A copy of the current readings."""
        model = self.model
        queue = self.poller.value if self.poller is not None and self.poller.value is not None else (
            model.load.queue if model is not None else 0.0)
        if model is None:
            return replace(self._readings, engine_queue_requests=float(queue))
        return replace(self._readings, window_rows=float(model.window.count), engine_queue_requests=float(queue),
                       acceptance_moved=float(model.moved_at_ns is not None),
                       judged_on_recent_rows=float(model.buckets_on_recent_rows))

    def close(self) -> None:
        if self.poller is not None:
            self.poller.stop()

    # -- the decision --------------------------------------------------------------------------

    def _decide(self, model: EngineModel, now: float) -> None:
        state = self.control.state()
        own = state.policy.mode == "conf" and state.source == "auto"
        if model.changed:
            # the acceptance changed: what was learned is forgotten. When it rose, the policy in
            # force gives up more than it was chosen to: until enough new rows are in, every row
            # is verified (the guardrail's protection at a start). When it fell, verifying every
            # row would cost more than the policy in force: that stays until the next decision.
            model.changed = False
            log.info("controller: acceptance %s at draft position(s) %s (%s): the window and the older "
                     "calibration forgotten", "rose" if model.drift.rose else "fell",
                     ",".join(str(i + 1) for i in np.flatnonzero(model.drift.moved)), model.change_cause)
            if state.control_mode == "auto" and own:
                self._relearning = True
                if model.drift.rose and not _all_live(state.policy, model.num_drafts):
                    if self._write_policy(all_live_policy(model.num_drafts, state.policy.explore_period),
                                          state.generation, now):
                        self._replaced = (self.control.state().generation, state.policy)
                    return
        ready = model.ready(self.config.min_rows)
        self._readings.ready = float(ready)
        if not ready:
            return
        # in manual mode the decision feeds only the readings: made every few seconds, and at the
        # first tick after the operator writes a policy (the readings are then of the new one)
        if state.control_mode != "auto" and self._planned is not None and self._planned[1] == state.generation \
                and now - self._planned[0] < self.config.manual_plan_interval_s:
            return
        self._planned = (now, state.generation)
        # The stopgap is a protection, not a choice: the first decision after it is judged against
        # the rule it replaced, so that a rule the new rows cannot tell from the best (within the
        # gain a move needs) comes back instead of the first of a flat top (forty-third round).
        # Until that decision is written, the readings of the policy in force are the replaced one's.
        replaced = None
        if self._replaced is not None:
            generation, policy = self._replaced
            if generation == state.generation and own:
                replaced = policy
            else:
                self._replaced = None   # another write came after the stopgap: it is judged as it is
        judged_against = replaced or state.policy
        chosen = plan(model, judged_against, own, self.config)
        if model.rose_on_recent_rows and rise_matters(model, judged_against, self.config):
            # the drafts the rule in force caps are not seen on the recent rows, and had they risen
            # as much as the first, a longer rule would win: forget, and verify every row until
            # the new rows are in (the stopgap, as after the drift test's alarm)
            model.forget_after_rise()
            self._decide(model, now)
            return
        readings = self._readings
        readings.guardrail_hits_total += int(chosen.guardrail_hit)
        readings.predicted_goodput_tokens_per_second = chosen.predicted_goodput
        readings.current_goodput_tokens_per_second = chosen.current_goodput
        readings.predicted_tokens_given_up = chosen.predicted_given_up
        readings.explore_cost_ratio = chosen.explore_cost_in_force   # the period in force
        if state.control_mode != "auto" or not (chosen.changed or replaced):
            return
        # the all-live stopgap after a change of acceptance is left as soon as there is a decision
        if not (chosen.urgent or self._relearning) and self.last_write_s is not None \
                and now - self.last_write_s < self.config.min_interval_s:
            return
        if self._write_policy(policy_of(chosen, model.edges, model.num_drafts), state.generation, now):
            self._relearning = False
            self._replaced = None
            readings.trials_total += chosen.trials
            readings.explore_cost_ratio = chosen.explore_cost

    def _note_policy(self) -> None:
        state = self.control.state()
        if state.policy is not None:
            if len(self._policies) > 256:
                for generation in sorted(self._policies)[:128]:
                    del self._policies[generation]
            self._policies[state.generation] = state.policy

    def _write_policy(self, policy: Policy, generation: int, now: float) -> bool:
        try:
            self.control.set_policy(policy, "auto", who="controller", expected_generation=generation)
        except StaleGeneration:
            return False  # someone else wrote in between: decide again next tick
        self._note_policy()
        self.last_write_s = now
        self._readings.policy_writes_total += 1
        log.info("controller wrote %d bucket(s), explore period %d", len(policy.buckets), policy.explore_period)
        return True


def all_live_policy(num_drafts: int, explore_period: int = 0) -> Policy:
    """Every row verified, in the controller's own (``conf``) form."""
    return Policy("conf", num_drafts, (Bucket(1, num_drafts, num_drafts, (0.0,) * num_drafts),), explore_period)


def _all_live(policy: Policy, num_drafts: int) -> bool:
    return all(bucket.k_min >= num_drafts for bucket in policy.buckets)
