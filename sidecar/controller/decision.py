"""The decision: per batch-size bucket the rule of best predicted goodput within the guardrail,
the exploration period, and the policy that spells them."""

import logging
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from vcap.policy import Bucket, Policy, default_policy, rule_at

from .config import ControllerConfig
from .calibration import LiftedCalibration
from .goodput import BucketChoice, Evaluation, choose_rule, evaluate_rules
from .load import BucketLoad
from .measured import Correction, rule_key
from .model import EngineModel

__all__ = ["LeftRule", "Plan", "TrialState", "plan", "policy_of", "rise_matters"]

log = logging.getLogger("vcap.controller")

_EXPLORE_PERIODS = (16, 24, 32, 48, 64, 96, 128, 192, 256, 400, 600, 1000)


@dataclass(frozen=True, slots=True)
class Plan:
    rules: tuple[Bucket, ...]      # per bucket
    changed: bool                  # the policy in force should change
    urgent: bool                   # ... because a loaded bucket's rule breaks the guardrail
    guardrail_hit: bool            # a loaded bucket's goodput-best rule broke the guardrail
    explore_period: int
    explore_cost: float            # predicted fraction of goodput exploration costs
    explore_cost_in_force: float   # ... with the policy and period in force
    predicted_goodput: float       # tokens per second of the plan, exploration included
    current_goodput: float         # of the policy in force, its exploration included
    predicted_given_up: float      # accepted drafts per request-step, against all-live
    trials: int = 0                # buckets whose rule is a trial (run to measure its step time)


@dataclass(slots=True)
class TrialState:
    """A bucket's trials since its load (``bs``) or the acceptance last moved."""

    bs: int
    started_s: float
    count: int = 0
    between: int = 0                # trials of rules between two measured live lengths
    active: tuple | None = None    # the rule key on trial, until it is measured
    incumbent: tuple | None = None  # the rule key it is judged against
    proposed_over: tuple | None = None  # the rule key in force when it was proposed (its write may wait)
    ended: tuple | None = None      # a trial measured, judged against the incumbent until written
    steady_since: float = 0.0       # trials wait until the load has stayed trial_steady_s


@dataclass(frozen=True, slots=True)
class LeftRule:
    """The rule a busy bucket last left (its key) and the load it left it at."""

    key: tuple
    bs: float


class _Mix(NamedTuple):
    committed: float   # tokens
    seconds: float
    given_up: float    # tokens
    requests: float

    @property
    def goodput(self) -> float:
        return self.committed / self.seconds if self.seconds else 0.0


class _Choice(NamedTuple):
    index: int
    change: bool
    urgent: bool
    guardrail_hit: bool
    trial: bool = False


def plan(model: EngineModel, policy: Policy, own: bool, config: ControllerConfig) -> Plan:
    """What to write instead of ``policy`` in force, judged on the model's window and load.
    ``own``: the policy is one the controller wrote (its exploration period alone is no reason
    to write again)."""
    num_drafts = model.num_drafts
    loads = model.bucket_loads()
    rules = list(model.rules)
    for rule in (rule_at(policy, load.typical_bs, num_drafts) for load in loads):
        if rule not in rules:
            rules.append(rule)
    references = [rules.index(rule_at(policy, load.typical_bs, num_drafts)) for load in loads]
    keys = [rule_key(rule, num_drafts) for rule in rules]
    evaluations = model.evaluate_buckets(rules, loads)
    all_live = rules.index(rule_at(default_policy(num_drafts), 1, num_drafts))
    measured = config.trial_margin > 0
    if measured:
        model.step_times.expire(model.now_ns - int(config.trial_ttl_s * 1e9))
    choices, corrected = [], []
    for index, (load, reference, evaluation) in enumerate(zip(loads, references, evaluations)):
        corrections = None
        if measured and load.busy:
            corrections = model.step_times.correction(index, model.curve, model.cost, config.trial_min_steps,
                                                      config.trial_min_rows)
            if model.profile is not None:
                corrections = corrections.shaped(*model.profile_shape(load.typical_bs))
        correction = step_se = None
        if corrections is not None:
            correction, step_se = corrections.at(evaluation.mean_live), corrections.relative_se(evaluation.mean_live)
        corrected.append(correction)
        judged = reference
        trials = corrections is not None and load.time_share >= config.trial_min_share
        if trials:
            held, judged = _trial_in_force(index, load, keys, reference, model, config)
            if held is not None:
                choices.append(held)
                continue
        choice, searched = _choose(evaluation, load, judged, all_live, model, config, correction,
                                   _left_rule(index, load, keys, model), step_se)
        trial_ended = judged != reference
        if trial_ended:   # its rule stays only where it beat the incumbent
            if choice.index == reference:
                model.trials[index].ended = None
            choice = choice._replace(change=choice.index != reference, urgent=choice.index != reference)
        verdict = choice.index
        if trials:
            # a trial started as another ends is judged against that one's verdict, not against
            # the rule on trial: a rule that lost its trial must not come back as the incumbent
            incumbent = verdict if trial_ended else reference
            choice = _next_trial(choice, searched, index, keys, reference, incumbent, evaluation, corrections,
                                 model, config)
        if trials and not trial_ended:
            choice = _measured_guardrail_move(choice, index, keys, reference, all_live, evaluation, corrections,
                                              model, config)
        # the rule the bucket leaves: after a trial the incumbent, where the verdict is another rule,
        # even as a next trial starts (the verdict is its incumbent); else the rule in force, where
        # the choice moves (a trial's rule is a measurement, not a rule the bucket chose)
        if trial_ended:
            left = judged if verdict != judged else None
        else:
            left = reference if choice.change and not choice.trial else None
        if left is not None and load.busy:
            model.left[index] = LeftRule(keys[left], load.typical_bs)
        if trials:
            choice = _measured_move(choice, index, keys, reference, evaluation, corrections, model, config)
        if load.busy and log.isEnabledFor(logging.DEBUG):
            _log_choice(index, load, rules, judged, choice, searched, evaluation, correction)
        choices.append(choice)
    chosen = [choice.index for choice in choices]
    planned = _mix(evaluations, loads, chosen, model, corrected)
    current = _mix(evaluations, loads, references, model, corrected)
    explored = _mix(evaluations, loads, [all_live] * len(loads), model, corrected)
    chunks = (_mix(evaluations, loads, chosen, model, corrected, chunk=True),
              _mix(evaluations, loads, [all_live] * len(loads), model, corrected, chunk=True))
    window = _Costs(planned, explored, chunks)
    recent = _recent_costs(model, rules, loads, chosen, references, all_live, corrected)
    period, explore_cost = _explore(window, recent and recent[0], policy.explore_period, config)
    explore_cost_in_force = max(_explore_cost(policy.explore_period, costs.planned, costs.explored)
                                for costs in (_Costs(current, explored), recent and recent[1]) if costs)
    # the period in force is kept while its cost stays in band (_explore): one outside is rewritten.
    # An idle bucket (not BucketLoad.busy) is no reason to write on its own: its rule does nothing
    # to goodput now, and its prediction wobbles with the cost fit at batch sizes far from the
    # load's; it takes its best rule whenever a busy bucket or the period is written.
    changed = any(choice.change and load.busy for choice, load in zip(choices, loads)) \
        or period != policy.explore_period
    return Plan(rules=tuple(rules[i] for i in chosen), changed=changed,
                urgent=any(choice.urgent for choice in choices),
                guardrail_hit=any(choice.guardrail_hit for choice in choices),
                explore_period=period, explore_cost=explore_cost,
                explore_cost_in_force=explore_cost_in_force,
                predicted_goodput=planned.goodput * (1 - explore_cost),
                current_goodput=current.goodput * (1 - explore_cost_in_force),
                predicted_given_up=planned.given_up / planned.requests if planned.requests else 0.0,
                trials=sum(choice.trial for choice in choices))


def rise_matters(model: EngineModel, policy: Policy, config: ControllerConfig) -> bool:
    """Whether the rise of the first draft's acceptance read on the recent rows under a rule that
    hides the later drafts (``model.rise_logit``) is worth a forget and the all-live stopgap: had
    the hidden drafts risen as much (in logit), a rule verifying more drafts than the one in force
    would beat it, in a busy bucket on its recent rows at its load, by ``min_gain`` and by what the
    stopgap costs, paid back over the recent window: its loss against the rule in force for the
    ``bucket_rows`` rows the bucket is judged on again after a forget, over the window's rows.
    The first draft's acceptance of a few requests moves as they come and go: drawn61-2-accept
    (seed 2) read a rise of 0.09 at bs 5, 39 s after its change, where k=1 stayed best by 12%,
    and the stopgap cost 3% of the next 30 s (forty-sixth round); a rise the confidence head did
    not follow was forgotten for a predicted gain of 0.5%, where k=1 stayed best and the stopgap
    cost a third of 2.6 s (``bench/CONTROLLER_RESULTS.md``, forty-eighth round)."""
    num_drafts = model.num_drafts
    confidence, live, accepted, time_ns, bs = model.window_rows()
    recent = time_ns >= model.recent_since_ns
    lifted = LiftedCalibration(model.calibration, model.rise_logit)
    all_live = rule_at(default_policy(num_drafts), 1, num_drafts)
    for load in model.bucket_loads():
        if not load.busy:
            continue
        own = recent & load.at_load(bs)
        if not own.any():
            continue
        in_force = rule_at(policy, load.typical_bs, num_drafts)
        rules = [in_force, all_live] + [rule for rule in model.rules if rule not in (in_force, all_live)]
        evaluation = evaluate_rules(confidence[own], live[own], accepted[own], lifted, rules)
        goodput = evaluation.goodput(load.points, load.weights, model.curve, model.cost)
        stopgap_loss = max(0.0, 1.0 - goodput[1] / goodput[0]) * min(1.0, config.bucket_rows / own.sum())
        longer = evaluation.mean_live > evaluation.mean_live[0]
        if longer.any() and goodput[longer].max() > goodput[0] * (1 + config.min_gain + stopgap_loss):
            return True
    return False


def policy_of(plan: Plan, edges: tuple[int, ...], num_drafts: int) -> Policy:
    """The conf policy of ``plan``; a bucket whose rule is the one below it merges into it."""
    buckets = []
    for edge, rule in zip(edges, plan.rules):
        if buckets and (buckets[-1].k_min, buckets[-1].k_max, buckets[-1].thresholds) == (
                rule.k_min, rule.k_max, rule.thresholds):
            continue
        buckets.append(Bucket(edge, rule.k_min, rule.k_max, tuple(rule.thresholds)))
    return Policy("conf", num_drafts, tuple(buckets), plan.explore_period)


def _left_rule(index: int, load: BucketLoad, keys: list[tuple], model: EngineModel) -> int | None:
    """The rule (index into ``keys``) bucket ``index`` last left, while its load stays within 50%
    of the one then."""
    left = model.left.get(index)
    if left is None or abs(load.typical_bs - left.bs) > 0.5 * left.bs:
        return None
    return keys.index(left.key) if left.key in keys else None


def _choose(evaluation: Evaluation, load: BucketLoad, reference: int, all_live: int, model: EngineModel,
            config: ControllerConfig, correction: np.ndarray | None = None,
            left: int | None = None, step_se: np.ndarray | None = None) -> tuple[_Choice, BucketChoice]:
    """Leave the rule in force (``reference``) when it breaks the guardrail (for the best rule
    within it where that beats verifying every row, ``all_live``, by ``min_gain``, else for
    ``all_live``), or when the best one's gain beats the threshold by ``confidence_z`` standard
    errors (and by ``return_gain`` more where the best moves back toward the rule the bucket last
    left, ``left``: :func:`_moves_back`).
    ``correction``: per rule, measured over predicted step time; ``step_se``: its relative
    standard error. The gain's standard error holds the window's tokens and both rules' measured
    step times: at a steady load the rule in force is measured without end, and noisy step
    times would otherwise move it back and forth against a rule measured once."""
    c = config
    choice = choose_rule(evaluation, load.points, load.weights, model.curve, model.cost,
                         c.max_tokens_given_up, c.guardrail_z, reference, all_live, correction)
    loaded = load.share > 0   # any steps at all: a guardrail hit there is reported
    hit = loaded and choice.unconstrained != choice.best
    goodput = choice.goodput[reference]
    gain = choice.goodput[choice.best] / goodput - 1.0
    se = choice.goodput_se[choice.best] / goodput
    if step_se is not None:
        se = float(_gain_se(se, step_se[choice.best], step_se[reference], c))
    needed = (c.min_gain if load.busy else c.idle_bucket_gain) + \
        c.confidence_z * se + (c.return_gain if _moves_back(evaluation.mean_live, reference, choice.best, left, all_live)
                               else 0.0)
    violating = bool(choice.violating[reference])
    if violating:
        # the guardrail's move lands on the best rule within it only where that beats verifying
        # every row by the gain a move is worth: one nearer is as near the bound as the rule left,
        # and the next wobble of the fit sent drawn83-1-shift's drain (bs 57-54) from 0.1:1-5 to
        # 0.01:1-5 (+0.06% over every row) and on to every row within 2 s, each by the guardrail
        # (bench/CONTROLLER_RESULTS.md, fifty-fourth round). Its standard error is not added: the
        # guardrail already holds it, and with it drawn53-2-accept's bucket (bs 59) sat at every row
        # for 10 s beside 0.13:1-5, predicted 0.68% better
        margin = choice.goodput[choice.best] / choice.goodput[all_live] - 1.0
        landing = choice.best if margin > (c.min_gain if load.busy else c.idle_bucket_gain) else all_live
        return _Choice(landing, True, loaded, hit), choice
    if choice.best != reference and gain > needed:
        return _Choice(choice.best, True, False, hit), choice
    return _Choice(reference, False, False, hit), choice


def _moves_back(live: np.ndarray, reference: int, best: int, left: int | None, all_live: int) -> bool:
    """Whether ``best`` is the rule the bucket last left (``left``) or, unless that was verifying
    every row (``all_live``), lies on its side of the rule in force (``reference``) in predicted
    live rows per request (``live``): a move that reverses the bucket's last one. Near-equal rules
    on either side of the one in force moved a bucket back and forth as a drain passed through it
    (0.02, 0.04, 0.02, 0.04 thresholds at bs 57-41, bench/CONTROLLER_RESULTS.md, thirtieth round),
    where the exact rule left came back only once. Every row is where a bucket starts, and where
    a change of acceptance sends it: the first rule it leaves for is an approach, and a better one
    between the two is found next (0.7:1-3, then 0.2:1-2 at bs 96, thirty-first round)."""
    if left is None or best == reference:
        return False
    if best == left:
        return True
    return left != all_live and (live[best] - live[reference]) * (live[left] - live[reference]) > 0


def _log_choice(index: int, load: BucketLoad, rules: list[Bucket], reference: int, choice: _Choice,
                searched: BucketChoice, evaluation: Evaluation, correction: np.ndarray | None) -> None:
    """One DEBUG line per busy bucket and decision: the rule judged against, the choice, and the
    five rules of best predicted goodput (live rows and committed tokens per request and step,
    measured step-time correction)."""
    def rule(i: int) -> str:
        r = rules[i]
        fix = f" x{correction[i]:.3f}" if correction is not None else ""
        return (f"{r.thresholds[0]:g}:{r.k_min}-{r.k_max} {searched.goodput[i]:.1f} tok/s "
                f"(L {evaluation.mean_live[i]:.2f}, T {evaluation.tokens[i]:.3f}{fix})")
    top = [int(i) for i in np.argsort(-searched.goodput)[:5]]
    log.debug("bucket %d (bs %.1f, share %.2f): judged %s; chose %s%s; gain se %.4f; best: %s", index,
              load.typical_bs, load.share, rule(reference), rule(choice.index), " (trial)" if choice.trial else "",
              searched.goodput_se[searched.best] / max(searched.goodput[reference], 1e-9),
              "; ".join(rule(i) for i in top))


def _gain_se(relative_se, step_se, step_se_reference, config: ControllerConfig):
    """Relative standard error of a rule's gain over the reference: the window's tokens
    (``relative_se``) and both rules' measured step times, weighted by ``step_se_weight``."""
    return np.hypot(relative_se, config.step_se_weight * np.hypot(step_se, step_se_reference))


def _trial_in_force(index: int, load: BucketLoad, keys: list[tuple], reference: int, model: EngineModel,
                    config: ControllerConfig) -> tuple[_Choice | None, int]:
    """A bucket's trial in progress: ``(choice, reference)`` while it runs (or waits to be
    written), else ``(None, rule to judge against)``: the rule in force before a trial that just ended (its
    incumbent), or ``reference``. ``keys``: the candidate rules' keys."""
    c = config
    now_s = model.now_ns / 1e9
    state = model.trials.get(index)
    moved = state is not None and abs(load.typical_bs - state.bs) > 0.5 * state.bs
    if moved:
        model.step_times.drop_bucket(index)   # measured at another load
    if state is None or moved or now_s - state.started_s > c.trial_ttl_s:
        # at a start (or a change of acceptance) the load counts as steady; a load that arrives
        # in the bucket or moves later must stay trial_steady_s first (a drain passes through
        # buckets: no trials there)
        starting = now_s - (model.first_ns or 0) / 1e9 < c.trial_steady_s
        steady_since = now_s - c.trial_steady_s if starting and not moved else now_s
        state = model.trials[index] = TrialState(load.typical_bs, now_s, steady_since=steady_since)
    if state.active is None:
        if state.ended is not None and state.ended == keys[reference] and state.incumbent in keys:
            return None, keys.index(state.incumbent)   # the ended trial's verdict, until written
        state.ended = None
        return None, reference
    if state.active != keys[reference]:
        if state.active in keys and state.proposed_over == keys[reference]:
            # proposed, not yet in force (the write waits for the interval between writes)
            return _Choice(keys.index(state.active), True, False, False, True), reference
        state.active = None   # someone else's policy took over
        return None, reference
    if not model.step_times.enough(index, state.active, c.trial_min_steps, c.trial_min_rows):
        return _Choice(reference, False, False, False), reference   # the trial runs on
    state.active, state.ended = None, state.active
    return None, keys.index(state.incumbent) if state.incumbent in keys else reference


def _measured_move(choice: _Choice, index: int, keys: list[tuple], reference: int, evaluation: Evaluation,
                   corrections: Correction, model: EngineModel, config: ControllerConfig) -> _Choice:
    """A busy bucket's move to a rule whose live length no measured rule covers runs as a trial
    of that rule, as its own incumbent: held until it is measured, then judged as the rule in
    force on its measured step time, which stays as a correction. Without it the bucket moved
    back on the cost fit as soon as a few slow steps bent it, before the rule had a measurement of
    its own; the fit then forgot them under the rule in force's many steps, and the bucket tried
    the next rule beyond: drawn53-2-accept (seed 2, bs 55-66) left ``0.13:1-5`` for
    ``0.35:1-5`` predicted +0.9%, moved back after 8 steps (471 rows, short of a measurement),
    and 2.6 s later tried ``0.4:1-5`` predicted +2.6%, both about 2-5% behind
    (bench/CONTROLLER_RESULTS.md, fifty-second round). Judged against the rule it left instead,
    a move had to clear ``min_gain`` twice and a drain kept the older rule (drawn53-4-shift).
    Not counted against ``trial_max``: it is a move the model chose, not a proposal; a
    guardrail's move (urgent) is not held here (:func:`_measured_guardrail_move` holds one to every row)."""
    if not choice.change or choice.trial or choice.urgent or choice.index == reference:
        return choice
    c = config
    if corrections.covered(float(evaluation.mean_live[choice.index]), c.trial_spacing, c.trial_edge_spacing):
        return choice
    state = model.trials[index]
    state.active = state.incumbent = keys[choice.index]
    state.proposed_over = keys[reference]
    return choice._replace(trial=True)


def _measured_guardrail_move(choice: _Choice, index: int, keys: list[tuple], reference: int, all_live: int,
                             evaluation: Evaluation, corrections: Correction, model: EngineModel,
                             config: ControllerConfig) -> _Choice:
    """The guardrail's move from a measured rule to verifying every row (``all_live``) where
    every row's step time is not measured in the bucket runs as a trial of every row, judged
    against the rule left once measured: the guardrail then compares two measured step times.
    Judged on the fit alone, a fresh load's row cost priced too low sent drawn103-7-shift's
    bucket (bs 104, 8 s after a shift from 4) from ``0.04:1-5`` to every row, predicted 2.3%
    better; measured, every row ran 3.6% slower than predicted, and the bucket came back to a
    threshold 13 s later, two reversals (bench/CONTROLLER_RESULTS.md, fifty-fifth round).
    Where the guardrail was right the verdict keeps every row; not counted against
    ``trial_max``."""
    if not choice.urgent or choice.trial or choice.index != all_live or reference == all_live:
        return choice
    c = config
    live = evaluation.mean_live
    if corrections.covered(float(live[all_live]), c.trial_spacing, c.trial_edge_spacing) \
            or not corrections.covered(float(live[reference]), c.trial_spacing, c.trial_edge_spacing):
        return choice
    state = model.trials[index]
    state.active, state.incumbent, state.proposed_over = keys[all_live], keys[reference], keys[reference]
    return choice._replace(trial=True)


def _trial_margin(corrections: Correction, model: EngineModel, config: ControllerConfig) -> float:
    """How far below the best a rule may be predicted and still be worth a trial: the whole
    ``trial_margin`` while the cost fit is not identified or fewer than three live lengths are
    measured (a fit through two clusters of points is exact at both, whatever it says between
    them); else twice the largest measured error of the fit (plus 0.5%), at most ``trial_margin``."""
    if not model.cost.identified or len(corrections.live) < 3:
        return config.trial_margin
    return min(config.trial_margin, 0.005 + 2 * float(np.max(np.abs(corrections.ratio - 1.0))))


def _next_trial(choice: _Choice, searched: BucketChoice, index: int, keys: list[tuple], reference: int,
                incumbent: int, evaluation: Evaluation, corrections: Correction, model: EngineModel,
                config: ControllerConfig) -> _Choice:
    """The model proposes, measurement disposes: a busy bucket runs a rule that no measured rule
    covers in live length (predicted within :func:`_trial_margin` of the best, within the
    operator's bound; the model's best, and every second trial, where verifying every row gives the
    experts ``trial_far_pairs`` (row, expert) pairs each, the one farthest in live length from
    every measured rule) until it has ``trial_min_steps`` steps and ``trial_min_rows``
    rows, then chooses again with its measured step time, against ``incumbent``: the rule in
    force before the trial, or where one trial just ended, that trial's verdict. Once those
    ``trial_max`` trials are spent, or no rule is left uncovered, up to ``trial_max`` more run
    rules between two measured live lengths whose step time may bend
    there (:func:`_between_candidates`), within ``trial_between_s`` of the load settling. A trial is judged by no guardrail: it is short, its
    rule is predicted near the best, and the counts hold until its load or the acceptance moves,
    or ``trial_ttl_s`` pass."""
    c = config
    state = model.trials[index]
    if model.now_ns / 1e9 - state.steady_since < c.trial_steady_s:
        return choice
    goodput = searched.goodput
    allowed = np.isfinite(goodput)
    if np.isfinite(c.max_tokens_given_up):   # within the operator's bound as choose_rule judges it
        allowed &= evaluation.given_up + c.guardrail_z * evaluation.given_up_se <= c.max_tokens_given_up
    if not allowed.any():
        return choice
    best = float(goodput[allowed].max())
    margin = _trial_margin(corrections, model, c)
    live = evaluation.mean_live
    near = [int(i) for i in np.argsort(-goodput) if allowed[i] and goodput[i] >= (1 - margin) * best and i != reference]
    candidates = [i for i in near if not corrections.covered(float(live[i]), c.trial_spacing, c.trial_edge_spacing)]
    if state.count >= c.trial_max or not candidates:
        # while the measurements are fresh: later the bound moves with the noise of the rule in
        # force, measured without end (on jittery steps one such trial came at 177 s of a steady load)
        if state.between >= c.trial_max or model.now_ns / 1e9 - state.steady_since > c.trial_between_s:
            return choice
        between = _between_candidates(near, searched, best, live, reference, corrections, c)
        if not between:
            return choice
        state.between += 1
        state.active, state.incumbent, state.proposed_over = keys[between[0]], keys[incumbent], keys[reference]
        return _Choice(between[0], True, False, choice.guardrail_hit, True)
    candidate = candidates[0]
    pairs = state.bs * model.stride * model.curve.top_k / model.curve.num_experts
    if state.count % 2 and len(corrections.live) and pairs >= c.trial_far_pairs:
        # every second trial: the candidate farthest in live length from every measured rule. The
        # fit is exact where it was measured and least known far from there: where the experts get
        # a tile of (row, expert) pairs or more, a fused MoE's tiles bend the cost between measured
        # live lengths (below, the cost is linear in distinct experts, as the fit has it)
        distance = [float(np.min(np.abs(corrections.live - live[i]))) for i in candidates]
        candidate = candidates[int(np.argmax(distance))]
    state.count += 1
    state.active, state.incumbent, state.proposed_over = keys[candidate], keys[incumbent], keys[reference]
    return _Choice(candidate, True, False, choice.guardrail_hit, True)


def _between_candidates(near: list[int], searched: BucketChoice, best: float, live: np.ndarray, reference: int,
                        corrections: Correction, config: ControllerConfig) -> list[int]:
    """Rules of ``near`` (predicted near the best) between two measured live lengths, not
    measured themselves, that would beat the best by ``min_gain`` and ``confidence_z`` standard
    errors (:func:`_gain_se`, as a change is judged) if their correction were the lower of the two
    measured around them, most promising first.

    A measured rule within ``trial_spacing`` covers a rule only where the step time is straight;
    where it bends between two measurements (at bs 256 uniform on the H200 loop, k=2 cost 1.7%
    more than k=1 and k=3 12% more than k=2), a rule between them was held at a correction
    interpolated too high, and auto stayed on a rule 1.2% behind k=2. Without the standard errors,
    jittery step times (10%, bs 4) put such trials at 68 s and 232 s of a steady load
    (bench/CONTROLLER_RESULTS.md, seventeenth round)."""
    if len(corrections.live) < 2 or not near:
        return []
    rules, goodput = np.asarray(near), searched.goodput
    at = corrections.at(live[rules])
    optimistic = goodput[rules] * at / corrections.lowest_around(live[rules])
    se = _gain_se(searched.goodput_se[rules] / goodput[rules], corrections.relative_se(live[rules]),
                  corrections.relative_se(live[reference]), config)
    keep = (optimistic > (1 + config.min_gain + config.confidence_z * se) * best) & np.array(
        [not corrections.covered(float(x), config.trial_edge_spacing, config.trial_edge_spacing) for x in live[rules]])
    order = np.argsort(-optimistic[keep], kind="stable")
    return [int(i) for i in rules[keep][order]]


def _mix(evaluations: list[Evaluation], loads: list[BucketLoad], chosen: list[int], model: EngineModel,
         corrected: list, chunk: bool = False) -> _Mix:
    """Predicted totals per step of the load with rule ``chosen[i]`` in bucket ``i``, judged on
    ``evaluations[i]`` (step times corrected by measurement where ``corrected[i]`` is given);
    ``chunk``: per chunk of the window (arrays of committed tokens and seconds)."""
    committed = seconds = given_up = requests = 0.0
    for evaluation, load, index, correction in zip(evaluations, loads, chosen, corrected):
        if load.share <= 0:
            continue
        tokens = evaluation.chunk_tokens if chunk else evaluation.tokens
        for bs, weight in zip(load.points, load.weights):
            w = load.share * weight
            committed += w * bs * tokens[..., index]
            step_ns = evaluation.step_time_ns(bs, model.curve, model.cost, chunk=chunk, correction=correction)
            seconds += w * step_ns[..., index] / 1e9
            given_up += w * bs * evaluation.given_up[index]
            requests += w * bs
    return _Mix(committed, seconds, given_up, requests)


def _goodput_lost(period: int, planned: _Mix, explored: _Mix):
    """Fraction of the plan's goodput lost when one step in ``period`` verifies every row
    (``explored``) and the others follow the plan; elementwise over chunks (arrays), unclamped."""
    mixed = ((period - 1) * planned.committed + explored.committed) / (
        (period - 1) * np.maximum(planned.seconds, 1e-12) + np.maximum(explored.seconds, 1e-12))
    return 1.0 - mixed * planned.seconds / planned.committed


def _explore_cost(period: int, planned: _Mix, explored: _Mix) -> float:
    """Fraction of goodput lost when one step in ``period`` verifies every row (``explored``)
    and the others follow the plan."""
    if period <= 0 or planned.goodput <= 0:
        return 0.0
    return max(0.0, float(_goodput_lost(period, planned, explored)))


def _explore_cost_se(period: int, chunks: tuple[_Mix, _Mix]) -> float:
    """Standard error of :func:`_explore_cost` over the window's chunks (``chunks``: the plan and
    every row verified, per chunk)."""
    (planned, explored), count = chunks, np.size(chunks[0].committed)
    if period <= 0 or count <= 1 or not np.all(planned.committed > 0):
        return 0.0
    return float(np.std(_goodput_lost(period, planned, explored), ddof=1) / np.sqrt(count))


class _Costs(NamedTuple):
    """What exploration is judged on: the plan, every row verified, and both per chunk."""
    planned: _Mix
    explored: _Mix
    chunks: tuple[_Mix, _Mix] | None = None


def _recent_costs(model: EngineModel, rules: list[Bucket], loads: list[BucketLoad], chosen: list[int],
                  references: list[int], all_live: int, corrected: list) -> tuple[_Costs, _Costs] | None:
    """Exploration's terms for the plan and for the rules in force, judged on each busy bucket's
    rows of the last ``moved_window_s`` (:meth:`EngineModel.evaluate_buckets` with ``recent``);
    None where the window is that recent already. Exploration costs now: after a fall of
    acceptance every all-live step costs more at once, while the window (60 s at a small batch
    size) follows over a minute, and at a few requests a batch the drift test has too little
    evidence to forget it (bench/CONTROLLER_RESULTS.md, thirty-ninth round)."""
    used = sorted(set(chosen) | set(references) | {all_live})
    evaluations = model.evaluate_buckets([rules[i] for i in used], loads, recent=True)
    if evaluations is None:
        return None
    at = {rule: i for i, rule in enumerate(used)}
    corrected = [None if correction is None else correction[used] for correction in corrected]

    def mix(picked: list[int], chunk: bool = False) -> _Mix:
        return _mix(evaluations, loads, [at[i] for i in picked], model, corrected, chunk)

    every = [all_live] * len(loads)
    planned = _Costs(mix(chosen), mix(every), (mix(chosen, chunk=True), mix(every, chunk=True)))
    return planned, _Costs(mix(references), planned.explored)


def _explore(window: _Costs, recent: _Costs | None, period_in_force: int,
             config: ControllerConfig) -> tuple[int, float]:
    """Exploration period to use, and the fraction of goodput it is predicted to cost: the
    dearer of the window's and its recent rows' estimates (``recent``, :func:`_recent_costs`).
    The period in force stays while its cost is within ``[target / 4, 1.5 * target]`` give or
    take ``confidence_z`` standard errors over each estimate's chunks (:func:`_explore_cost_se`):
    the cost is a small difference of two noisy ratios, and a steady load's period must not
    follow its noise (bench/CONTROLLER_RESULTS.md, sixteenth round). Either estimate above the
    band lengthens the period; both below it shorten it."""
    c = config
    estimates = [costs for costs in (window, recent) if costs is not None]

    def cost(period: int) -> float:
        return max(_explore_cost(period, costs.planned, costs.explored) for costs in estimates)

    if c.explore_period:
        return c.explore_period, cost(c.explore_period)
    target = c.explore_cost_target
    if period_in_force:
        held = [_explore_cost(period_in_force, costs.planned, costs.explored) for costs in estimates]
        margins = [c.confidence_z * _explore_cost_se(period_in_force, costs.chunks) if costs.chunks else 0.0
                   for costs in estimates]
        if max(h - m for h, m in zip(held, margins)) <= 1.5 * target \
                and max(h + m for h, m in zip(held, margins)) >= target / 4:
            return period_in_force, max(held)
    periods = [p for p in _EXPLORE_PERIODS if c.min_explore_period <= p <= c.max_explore_period] or [c.max_explore_period]
    period = next((p for p in periods if cost(p) <= target), periods[-1])
    return period, cost(period)
