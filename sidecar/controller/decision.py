"""The decision: per batch-size bucket the rule of best predicted goodput within the guardrail,
the exploration period, and the policy that spells them."""

from dataclasses import dataclass
from typing import NamedTuple

from vcap.policy import Bucket, Policy, default_policy, rule_at

from .config import ControllerConfig
from .goodput import Evaluation, choose_rule
from .load import BucketLoad
from .model import EngineModel

__all__ = ["Plan", "plan", "policy_of"]

_EXPLORE_PERIODS = (16, 24, 32, 48, 64, 96, 128, 192, 256, 400, 600, 1000)
# below this share of the steps a bucket counts as idle (idle_bucket_gain applies)
_BUSY_SHARE = 0.02


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
    current_goodput: float         # of the policy in force
    predicted_given_up: float      # accepted drafts per request-step, against all-live


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
    evaluation = model.evaluate(rules)
    all_live = rules.index(rule_at(default_policy(num_drafts), 1, num_drafts))
    choices = [_choose(evaluation, load, reference, all_live, model, config)
               for load, reference in zip(loads, references)]
    chosen = [choice.index for choice in choices]
    planned, current = _mix(evaluation, loads, chosen, model), _mix(evaluation, loads, references, model)
    explored = _mix(evaluation, loads, [all_live] * len(loads), model)
    period, explore_cost = _explore(planned, explored, policy.explore_period, config)
    # the period in force is kept while its cost stays in band (_explore): one outside is rewritten.
    # An idle bucket (under _BUSY_SHARE of the steps) is no reason to write on its own: its rule
    # does nothing to goodput now, and its prediction wobbles with the cost fit at batch sizes
    # far from the load's; it takes its best rule whenever a busy bucket or the period is written.
    changed = any(choice.change and load.share >= _BUSY_SHARE for choice, load in zip(choices, loads)) \
        or period != policy.explore_period
    return Plan(rules=tuple(rules[i] for i in chosen), changed=changed,
                urgent=any(choice.urgent for choice in choices),
                guardrail_hit=any(choice.guardrail_hit for choice in choices),
                explore_period=period, explore_cost=explore_cost,
                explore_cost_in_force=_explore_cost(policy.explore_period, current, explored),
                predicted_goodput=planned.goodput * (1 - explore_cost),
                current_goodput=current.goodput,
                predicted_given_up=planned.given_up / planned.requests if planned.requests else 0.0)


def policy_of(plan: Plan, edges: tuple[int, ...], num_drafts: int) -> Policy:
    """The conf policy of ``plan``; a bucket whose rule is the one below it merges into it."""
    buckets = []
    for edge, rule in zip(edges, plan.rules):
        if buckets and (buckets[-1].k_min, buckets[-1].k_max, buckets[-1].thresholds) == (
                rule.k_min, rule.k_max, rule.thresholds):
            continue
        buckets.append(Bucket(edge, rule.k_min, rule.k_max, tuple(rule.thresholds)))
    return Policy("conf", num_drafts, tuple(buckets), plan.explore_period)


def _choose(evaluation: Evaluation, load: BucketLoad, reference: int, all_live: int, model: EngineModel,
            config: ControllerConfig) -> _Choice:
    """Leave the rule in force (``reference``) for the best one when it breaks the guardrail,
    or when the best one's gain beats the threshold by ``confidence_z`` standard errors."""
    c = config
    choice = choose_rule(evaluation, load.points, load.weights, model.curve, model.cost,
                         c.max_tokens_given_up, c.guardrail_z, reference, all_live)
    busy = load.share > 0
    hit = busy and choice.unconstrained != choice.best
    goodput = choice.goodput[reference]
    gain = choice.goodput[choice.best] / goodput - 1.0
    needed = (c.min_gain if load.share >= _BUSY_SHARE else c.idle_bucket_gain) + \
        c.confidence_z * choice.goodput_se[choice.best] / goodput
    violating = bool(choice.violating[reference])
    if violating or (choice.best != reference and gain > needed):
        return _Choice(choice.best, True, busy and violating, hit)
    return _Choice(reference, False, False, hit)


def _mix(evaluation: Evaluation, loads: list[BucketLoad], chosen: list[int], model: EngineModel) -> _Mix:
    """Predicted totals per step of the load with rule ``chosen[i]`` in bucket ``i``."""
    committed = seconds = given_up = requests = 0.0
    for load, index in zip(loads, chosen):
        if load.share <= 0:
            continue
        for bs, weight in zip(load.points, load.weights):
            w = load.share * weight
            committed += w * bs * evaluation.tokens[index]
            seconds += w * evaluation.step_time_ns(bs, model.curve, model.cost)[index] / 1e9
            given_up += w * bs * evaluation.given_up[index]
            requests += w * bs
    return _Mix(committed, seconds, given_up, requests)


def _explore_cost(period: int, planned: _Mix, explored: _Mix) -> float:
    """Fraction of goodput lost when one step in ``period`` verifies every row (``explored``)
    and the others follow the plan."""
    if period <= 0 or planned.goodput <= 0:
        return 0.0
    mixed = ((period - 1) * planned.committed + explored.committed) / (
        (period - 1) * max(planned.seconds, 1e-12) + max(explored.seconds, 1e-12))
    return max(0.0, 1.0 - mixed / planned.goodput)


def _explore(planned: _Mix, explored: _Mix, period_in_force: int, config: ControllerConfig) -> tuple[int, float]:
    """Exploration period to use, and the fraction of goodput it is predicted to cost. The
    period in force stays while its cost is within ``[target / 4, 2 * target]``."""
    c = config

    def cost(period: int) -> float:
        return _explore_cost(period, planned, explored)

    if c.explore_period:
        return c.explore_period, cost(c.explore_period)
    target = c.explore_cost_target
    if period_in_force and target / 4 <= cost(period_in_force) <= 2 * target:
        return period_in_force, cost(period_in_force)
    periods = [p for p in _EXPLORE_PERIODS if c.min_explore_period <= p <= c.max_explore_period] or [c.max_explore_period]
    period = next((p for p in periods if cost(p) <= target), periods[-1])
    return period, cost(period)
