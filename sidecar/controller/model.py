"""The controller's model of one engine geometry: calibrated acceptance, expert union and step
cost, load per batch size, and the window of recent request rows that candidate rules are
evaluated on."""

from collections import deque

import numpy as np

from vcap.policy import Bucket, Policy, rule_at
from vcap.segment import SegmentConfig

from .calibration import AcceptanceCalibration, AcceptanceDrift, logit
from .config import ControllerConfig
from .cost_model import ExpertCurve, StepCostFit
from .goodput import Evaluation, candidate_grid, evaluate_rules
from .load import BucketLoad, LoadTracker
from .measured import StepTimes, rule_key
from .samples import Observation, SampleRing, recency_weights
from .step_profile import StepProfile

__all__ = ["EngineModel", "SteadySpread"]


class SteadySpread:
    """How far the first draft's acceptance of the last ``moved_window_s`` strays from the older
    rows' while nothing moved: the root mean square of :meth:`EngineModel.acceptance_difference`
    over the ticks without a move, per request (the square times the window's mean batch size),
    decayed over ``half_life_s`` of record time; 0 until ``min_s`` of it were seen.

    Within the window, the chunks' spread misses the spread between requests: at three
    requests a batch the same few long requests fill the recent rows, so their chunks agree
    while their mean is not the older rows'. There the difference strayed 1.6 times its median
    standard error over 900 s of a steady load, and the hold was on 15% of the time
    (bench/CONTROLLER_RESULTS.md, forty-first round)."""

    MAX_STEP_S = 5.0   # a reading stands for at most this long (none are taken while idle)

    def __init__(self, half_life_s: float, min_s: float):
        self.half_life_s, self.min_s = half_life_s, min_s
        self.seconds = 0.0          # seconds seen, decayed
        self._squares = 0.0         # decayed sum of seconds x difference^2 x batch size
        self._last_ns = None

    def add(self, difference: float, bs: float, now_ns: int) -> None:
        seconds = 0.0 if self._last_ns is None else min(max(0.0, (now_ns - self._last_ns) / 1e9), self.MAX_STEP_S)
        self._last_ns = now_ns
        keep = 0.5 ** (seconds / self.half_life_s)
        self.seconds = keep * self.seconds + seconds
        self._squares = keep * self._squares + seconds * difference ** 2 * bs

    def sd(self, bs: float) -> float:
        if self.seconds < max(self.min_s, 1e-9):
            return 0.0
        return float(np.sqrt(self._squares / self.seconds / max(bs, 1.0)))


class EngineModel:
    """Learns from :class:`Observation` s of one geometry (``shape``); not thread safe."""

    def __init__(self, geometry: SegmentConfig, config: ControllerConfig, profile: StepProfile | None = None):
        num_drafts, layers = geometry.num_drafts, geometry.num_moe_layers
        self.shape = (geometry.max_bs, num_drafts, layers)
        self.stride, self.max_bs = geometry.stride, geometry.max_bs
        self.edges = tuple(e for e in config.bucket_edges if e <= geometry.max_bs)[:geometry.max_buckets]
        self.config = config
        self.profile = profile      # the engine's start-up step-time profile (step_profile.py)
        self.calibration = AcceptanceCalibration(num_drafts, half_life_rows=config.calibration_half_life_rows)
        self.window = SampleRing(config.window_rows, ((num_drafts,), np.float32), ((), np.int64), ((), np.int64),
                                 ((), np.int64), ((), np.int64))   # confidence, live, accepted, time_ns, bs
        self.drift = AcceptanceDrift(num_drafts, self.recent_confidence, config.drift_allowance,
                                     config.drift_threshold, config.drift_slack, config.drift_block_s,
                                     config.moved_window_s)
        self.curve = ExpertCurve(layers, geometry.num_experts, geometry.top_k, geometry.stride * geometry.max_bs,
                                 max_rho=geometry.stride)
        self.cost = StepCostFit(num_layers=layers)
        self.load = LoadTracker(geometry.max_bs, config.load_half_life_s)
        self.rules = candidate_grid(num_drafts)
        # rows, experts, time_ns
        self.unions = SampleRing(2 * config.cost_samples, ((), np.int64), ((layers,), np.int64), ((), np.int64))
        # experts, bs, step_ns, time_ns, live rows
        self.costs = SampleRing(config.cost_samples, *[((), np.float64)] * 5)
        self.steps = deque(maxlen=4096)  # (ring, policy run, tokens, step_ns); run: generation, -1 fallback
        self.step_times = StepTimes(self.edges, config.step_time_memory, config.trial_max_steps)   # measured
        self.trials: dict[int, "TrialState"] = {}                          # per bucket (decision.py)
        self.left: dict[int, "LeftRule"] = {}                              # per bucket (decision.py)
        self._keys: dict[tuple[int, int], tuple] = {}                      # (generation, bs) -> rule key
        self.now_ns = 0
        self.first_ns = None        # the first record's time, or the last change of acceptance's
        self.changes = 0            # changes of acceptance detected
        self.changed = False        # one was detected since the controller last looked
        self.change_cause = ""      # what read the last one (the controller's log)
        self.moved_at_ns = None     # the last reading of acceptance_moved, while it holds
        # that reading began with a rise of the first draft's acceptance, the later drafts hidden;
        # and the rise it reads now, in logit (the later drafts may have risen as much)
        self.rose_on_recent_rows = False
        self.rise_logit = 0.0
        self.steady_spread = SteadySpread(config.moved_spread_half_life_s, config.moved_spread_min_s)
        self.buckets_on_recent_rows = 0   # busy buckets the last plan judged on their recent rows
        self.primed_rows = 0        # rows of a past recording the model starts from (prime)
        self._cost_prior = None     # (alpha, beta, gamma, delta) identified on the recording
        self._rows_seen = None      # the last per-live-row cost measured (live rows per request varied)

    @property
    def num_drafts(self) -> int:
        return self.stride - 1

    def fitted_step_ns(self, bs: float, live: np.ndarray) -> np.ndarray:
        """The cost fit's step time at batch size ``bs`` and ``live`` rows per request."""
        rows = bs * np.asarray(live, dtype=np.float64)
        return self.cost.predict(self.curve.total(rows), np.full_like(rows, bs), rows)

    def profile_shape(self, bs: float) -> tuple[np.ndarray, np.ndarray]:
        """The start-up profile's step time over the cost fit's at batch size ``bs``, at live
        lengths per request from 1 to ``stride`` (``Correction.shaped``)."""
        live = np.linspace(1.0, self.stride, 8 * self.num_drafts + 1)
        return live, self.profile.seconds(bs, bs * live) * 1e9 / self.fitted_step_ns(bs, live)

    def fold(self, observation: Observation) -> None:
        o = observation
        if len(o.time_ns):
            self.now_ns = max(self.now_ns, int(o.time_ns.max()))
            if self.first_ns is None:
                self.first_ns = int(o.time_ns.min())
        if len(o.live) and self.calibration.rows_seen >= self.config.min_rows and self._drifted(o):
            self.forget("the drift test, on the " + ("confidence" if self.drift.by_confidence else "acceptance"))
        self.calibration.update(o.confidence, o.live, o.accepted)
        kept = o.row_in_window
        self.window.add(o.confidence[kept], o.live[kept], o.accepted[kept], o.row_time_ns[kept], o.row_bs[kept])
        self.load.add(o.bs, o.time_ns, o.num_queued, o.step_ns)
        runs = np.where(o.fallback, -1, o.generation)
        self.steps.extend((o.ring, int(run), int(tokens), int(step_ns))
                          for run, tokens, step_ns in zip(runs, o.tokens, o.step_ns))
        if len(o.sampled_bs):
            # every sampled step is two points of the union curve: all rows and live rows
            self.unions.add(np.concatenate([self.stride * o.sampled_bs, o.sampled_live_rows]),
                            np.concatenate([o.experts_all, o.experts_live]),
                            np.concatenate([o.sampled_time_ns, o.sampled_time_ns]))
            self.costs.add(o.experts_live.sum(axis=1), o.sampled_bs, o.sampled_step_ns, o.sampled_time_ns,
                           o.sampled_live_rows)

    def measure(self, o: Observation, policies: dict[int, Policy]) -> None:
        """Keep the step times of ``o`` per bucket and rule; ``policies``: generation -> the policy
        written then (steps of an unknown generation are left out)."""
        all_live = (self.num_drafts, self.num_drafts, ())
        keys = []
        for generation, bs, explore, fallback in zip(o.generation, o.bs, o.explore, o.fallback):
            if fallback:
                keys.append(None)
                continue
            if explore:
                keys.append(all_live)
                continue
            policy = policies.get(int(generation))
            if policy is None:
                keys.append(None)
                continue
            cached = self._keys.get((int(generation), int(bs)))
            if cached is None:
                if len(self._keys) > 4096:
                    self._keys.clear()
                cached = self._keys[(int(generation), int(bs))] = rule_key(rule_at(policy, int(bs), self.num_drafts),
                                                                           self.num_drafts)
            keys.append(cached)
        self.step_times.add(self.step_times.bucket_of(o.bs), keys, o.bs, o.live_rows, o.step_ns, o.time_ns)

    def _drifted(self, o: Observation) -> bool:
        """Position 1 is verified in every row whatever the policy; later positions are judged
        only on exploration steps (every row verified), where the policy selects nothing."""
        live, accepted = o.live.copy(), o.accepted.copy()
        capped = ~o.row_explore
        live[capped] = np.minimum(live[capped], 2)
        accepted[capped] = np.minimum(accepted[capped], 1)
        return self.drift.update(self.calibration.predict(o.confidence), live, accepted, o.confidence,
                                 o.row_time_ns, o.row_bs)

    def forget(self, cause: str) -> None:
        """The acceptance changed (``cause``: what read it, for the log): start again from what the
        engine does now."""
        c = self.config
        self.change_cause = cause
        self.calibration.forget(c.forget_keep, self.drift.moved, c.forget_moved_keep, c.forget_max_drafts)
        self.window.clear()
        self.moved_at_ns = None
        self.rose_on_recent_rows = False
        self.rise_logit = 0.0
        self.buckets_on_recent_rows = 0
        self.steps.clear()
        self.step_times.clear()   # the tokens and the live lengths of every rule moved
        self.trials.clear()
        self.left.clear()
        self.first_ns = self.now_ns
        self.changes += 1
        self.changed = True

    def forget_after_rise(self) -> None:
        """The first draft's acceptance rose on the recent rows (:meth:`_judged_on_recent`), the
        rule in force verified a second draft in fewer than ``rise_seen_share`` of them, and the
        rise matters (:func:`.decision.rise_matters`): forget as the drift test's alarm of a rise
        would, with every position moved. That test can miss such a rise at a small batch when the
        confidence head follows the acceptance: the calibration stays right where drafts are
        verified, and the confidence alone is not read below four requests. Judged on the recent
        rows, the hidden drafts' old calibration keeps the cap (drawn59-5-accept: k=1 held 49 s
        after a rise at bs 3). Where the second draft is seen, the recent rows show the rise, and a
        false reading (a few long requests, before the steady spread is learned) would cost a
        forget: drawn59-8-accept read one at bs 2 before its change (``bench/CONTROLLER_RESULTS.md``,
        forty-fourth round)."""
        self.drift.moved = np.ones(self.num_drafts, dtype=bool)
        self.drift.rose = True
        self.drift.reset()
        self.forget("a rise of the first draft on the recent rows, the rule in force capping the rest")

    def prime(self, observations: list[Observation], prior_rows: float = 2000.0) -> int:
        """Start from a past recording of this geometry (the last one, as a prior): its calibration
        worth at most ``prior_rows`` rows, its expert curve, and its step-cost fit where it was
        identified (kept until the new data identifies one). Its rows are not judged on: the
        first decision still waits for new rows, a third of ``min_rows`` of them. Returns the
        recorded rows read."""
        rows = 0
        unions, costs = [], []
        for o in observations:
            self.calibration.update(o.confidence, o.live, o.accepted)
            rows += len(o.live)
            if len(o.sampled_bs):
                unions.append((np.concatenate([self.stride * o.sampled_bs, o.sampled_live_rows]),
                               np.concatenate([o.experts_all, o.experts_live])))
                costs.append((o.experts_live.sum(axis=1), o.sampled_bs, o.sampled_step_ns, o.sampled_live_rows))
        if rows:
            self.calibration.forget(min(1.0, prior_rows / rows))
        if unions:
            self.curve.fit(np.concatenate([u[0] for u in unions]), np.concatenate([u[1] for u in unions]))
        if costs:
            fit = StepCostFit(num_layers=self.cost.num_layers)
            experts, bs, step_ns, live_rows = (np.concatenate([c[i] for c in costs]) for i in range(4))
            fit.fit(experts, bs, step_ns, live_rows=live_rows)
            if fit.ready:
                self.cost.set_prior(fit.alpha, fit.beta, fit.gamma, fit.delta)
                if fit.identified:
                    self._cost_prior = (fit.alpha, fit.beta, fit.gamma, fit.delta)
                if fit.rows_identified:
                    self._rows_seen = fit.delta
        self.primed_rows = rows
        return rows

    def fit(self) -> None:
        half_life = self.config.sample_half_life_s
        if self.unions.count >= 8:
            rows, experts, time_ns = self.unions.arrays()
            self.curve.fit(rows, experts, recency_weights(time_ns, self.now_ns, half_life))
        if self.costs.count >= self.cost.min_point_samples:
            experts, bs, step_ns, time_ns, live_rows = self.costs.arrays()
            weights = recency_weights(time_ns, self.now_ns, half_life)
            self.cost.fit(experts, bs, step_ns, weights, live_rows=live_rows)
            if not self.cost.identified and self._cost_prior is not None:
                # one operating point: the recording's identified split beats the modelled one
                self.cost.set_prior(*self._cost_prior)
            elif self.cost.identified:
                self._cost_prior = None
            if self.cost.rows_identified:
                self._rows_seen = self.cost.delta
            elif self._rows_seen is not None and self.cost.ready and weights.sum() > 0:
                # the rows term was measured before (a capping policy): that beats the modelled
                # split, and keeps the controller from going back and forth between the two
                mean_rows = float(np.average(live_rows, weights=weights))
                self.cost.alpha += (self.cost.delta - self._rows_seen) * mean_rows
                self.cost.delta = self._rows_seen

    def window_rows(self) -> tuple[np.ndarray, ...]:
        """``(confidence, live, accepted, time_ns, bs)`` of the window's rows younger than
        ``window_max_age_s`` (``bs``: the batch size of each row's step)."""
        rows = self.window.arrays()
        recent = rows[3] >= self.now_ns - self.config.window_max_age_s * 1e9
        return rows if recent.all() else tuple(column[recent] for column in rows)

    def recent_confidence(self, since_ns: int) -> np.ndarray | None:
        """The mean confidence per draft position of the window's rows from ``since_ns`` on (None
        while there are none): where the drift test's slow mean of the confidence starts again
        after a stretch where it was not read (:class:`AcceptanceDrift`)."""
        confidence, _, _, time_ns, _ = self.window_rows()
        recent = time_ns >= since_ns
        return confidence[recent].mean(axis=0, dtype=np.float64) if recent.any() else None

    @property
    def recent_since_ns(self) -> float:
        """Where the recent rows begin (record clock): ``moved_window_s`` before now."""
        return self.now_ns - self.config.moved_window_s * 1e9

    def observed_goodput(self) -> float:
        """Committed tokens per second of one engine (the mean over rings: under attention DP
        each rank is an engine of its own, as the predictions are), over the recent steps that
        ran the policy of the newest step (its exploration steps included). Steps of earlier
        policies (a trial, the start) would make a model that is right look wrong."""
        newest = self.steps[-1][1]
        per_ring = {}
        for ring, run, tokens, step_ns in self.steps:
            if run != newest:
                continue
            total = per_ring.setdefault(ring, [0, 0])
            total[0] += tokens
            total[1] += step_ns
        rates = [t / (ns / 1e9) for t, ns in per_ring.values() if ns > 0]
        return float(np.mean(rates)) if rates else 0.0

    def ready(self, min_rows: int) -> bool:
        if self.changes:
            needed = self.config.relearn_rows
        else:
            needed = max(1, min_rows // 3) if self.primed_rows else min_rows
        return len(self.window_rows()[1]) >= needed and self.cost.ready and self.curve.fitted

    def bucket_loads(self) -> list[BucketLoad]:
        """The load of each policy bucket ``[edge, next edge)``."""
        bounds = zip(self.edges, self.edges[1:] + (self.max_bs + 1,))
        return [self.load.points(low, high) for low, high in bounds]

    def evaluate(self, rules: list[Bucket]) -> Evaluation:
        """``rules`` on the window (see :mod:`vcap.sidecar.controller.goodput`)."""
        return evaluate_rules(*self.window_rows()[:3], self.calibration, rules)

    def acceptance_difference(self, live: np.ndarray, accepted: np.ndarray,
                              time_ns: np.ndarray) -> tuple[float, float] | None:
        """The first draft's acceptance over the window's last ``moved_window_s`` less that over
        its older rows, and the standard error of that within the window; None with fewer than
        two chunks on either side. The rows are averaged over ``moved_chunk_s`` of record time,
        and the standard error is the spread of those means: it holds the spread between the few
        requests of a small batch, so a change the drift test cannot see at three requests a
        batch (its unit is a request per block, bench/CONTROLLER_RESULTS.md, thirty-eighth
        round) shows here. The first draft is verified in every row whatever the policy."""
        c = self.config
        verified = live >= 2
        if not verified.any():
            return None
        chunk = ((self.now_ns - time_ns[verified]) // (c.moved_chunk_s * 1e9)).astype(np.int64)
        rows = np.bincount(chunk)
        means = np.bincount(chunk, accepted[verified] >= 1)[rows > 0] / rows[rows > 0]
        newer = np.flatnonzero(rows > 0) < c.moved_window_s / c.moved_chunk_s
        recent, older = means[newer], means[~newer]
        if len(recent) < 2 or len(older) < 2:
            return None
        # two-sample standard error of the difference, the chunks' variance pooled over both
        deviations = np.concatenate([recent - recent.mean(), older - older.mean()])
        se = np.sqrt(deviations @ deviations / (len(means) - 2) * (1 / len(recent) + 1 / len(older)))
        return float(recent.mean() - older.mean()), float(se)

    def acceptance_moved(self, difference: float, se: float, bs: float) -> bool:
        """Whether the ``difference`` of :meth:`acceptance_difference` is over ``drift_allowance``
        and ``moved_acceptance_z`` times the larger of its standard error ``se`` and its spread
        while nothing moved at batch size ``bs`` (:class:`SteadySpread`)."""
        c = self.config
        noise = max(se, self.steady_spread.sd(bs))
        return abs(difference) > c.drift_allowance + c.moved_acceptance_z * noise

    def _judged_on_recent(self, live: np.ndarray, accepted: np.ndarray, time_ns: np.ndarray,
                          bs: np.ndarray) -> bool:
        """Whether the acceptance moved within the window: from a reading of
        :meth:`acceptance_moved` until the window holds no row from over ``moved_window_s``
        before it. The reading comes and goes with the noise of a few requests while the rows
        from before the move stay (on the H100 it went on and off every tick for 10 s). While
        it does not hold, the difference read is one more of the steady spread's."""
        difference = self.acceptance_difference(live, accepted, time_ns)
        mean_bs = float(bs.mean()) if len(bs) else 1.0
        if difference is not None and self.acceptance_moved(*difference, mean_bs):
            recent = time_ns >= self.recent_since_ns
            if self.moved_at_ns is None:
                self.rose_on_recent_rows = difference[0] > 0 and bool(recent.any()) \
                    and np.mean(live[recent] >= 3) < self.config.rise_seen_share
            verified = recent & (live >= 2)
            if self.rose_on_recent_rows and verified.any():
                now = float(np.mean(accepted[verified] >= 1))
                self.rise_logit = float(logit(now) - logit(now - difference[0]))
            self.moved_at_ns = self.now_ns
        elif self.moved_at_ns is not None and (
                not len(time_ns) or time_ns.min() >= self.moved_at_ns - self.config.moved_window_s * 1e9):
            self.moved_at_ns = None
            self.rose_on_recent_rows, self.rise_logit = False, 0.0
        if difference is not None and self.moved_at_ns is None:
            self.steady_spread.add(difference[0], mean_bs, self.now_ns)
        return self.moved_at_ns is not None

    def evaluate_buckets(self, rules: list[Bucket], loads: list[BucketLoad],
                         recent: bool = False) -> list[Evaluation] | None:
        """``rules`` per bucket, on the whole window; but where the load moved within the window
        (over ``1 - settled_share`` of its rows ran more than 50% from a busy bucket's typical
        batch size), that bucket is judged on its rows of the last ``moved_window_s`` at its own
        load, once it has ``bucket_rows`` of them. So is every busy bucket where the acceptance
        moved within the window (:meth:`_judged_on_recent`), or with ``recent``; None where
        ``recent`` and the window holds no older rows (it is recent already). How many buckets were
        judged on their recent rows is kept in ``buckets_on_recent_rows`` (the plan's call, without
        ``recent``; exported as ``vcap_controller_judged_on_recent_rows``).

        The requests in a batch are not the window's: a drain leaves the slowest requests, and
        at bs 8 the batch is 8 of them. After shift-128-8's drain on the H200, the window still
        held the drain's rows and every rule's tokens at bs 8 came out 2-3.5% low, the longer
        rules' most (``bench/CONTROLLER_RESULTS.md``, twenty-sixth round). At a steady load the
        whole window stays: its last seconds alone follow the noise of a few requests. So does
        an idle bucket's (not ``BucketLoad.busy``): its rule does nothing to goodput now."""
        confidence, live, accepted, time_ns, bs = self.window_rows()
        c = self.config
        since = self.recent_since_ns
        if recent and (not len(time_ns) or time_ns.min() >= since):
            return None
        # with ``recent`` (a second call of the same decision) the reading is already taken
        on_recent = recent or self._judged_on_recent(live, accepted, time_ns, bs)
        whole = None
        evaluations = []
        on_recent_rows = 0
        for load in loads:
            if load.busy and len(bs):
                at_load = load.at_load(bs)
                own = at_load & (time_ns >= since)
                if (on_recent or at_load.mean() < c.settled_share) and own.sum() >= c.bucket_rows:
                    evaluations.append(evaluate_rules(confidence[own], live[own], accepted[own], self.calibration,
                                                      rules))
                    on_recent_rows += 1
                    continue
            if whole is None:
                whole = self.evaluate(rules)
            evaluations.append(whole)
        if not recent:
            self.buckets_on_recent_rows = on_recent_rows
        return evaluations
