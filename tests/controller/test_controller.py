"""The controller in auto mode against a real segment and a SYNTHETIC simulated engine stepping
in the test thread; and the guardrail on adversarial (miscalibrated) SYNTHETIC traces."""

import numpy as np
import pytest

from vcap.engine_hook.sim import SimConfig, SimulatedEngine, create_segment
from vcap.policy import Bucket, Policy
from vcap.segment import RingReader
from vcap.sidecar.controller import AutoController, ControllerConfig
from vcap.sidecar.controller.cost_model import ExpertCurve, StepCostFit
from vcap.sidecar.controller.goodput import Evaluation, choose_rule
from vcap.sidecar.controller.load import read_engine_queue
from vcap.sidecar.policy_control import PolicyControl
from vcap.sidecar.telemetry import unpack

from .drive import drive


def _drive(engine, segment, control, controller, seconds, tick_s=0.5, on_tick=None):
    reader = RingReader(segment, 0, from_start=True)
    next_tick, writes, tokens, ns = tick_s, [], 0, 0
    while engine.engine_time_ns < seconds * 1e9:
        segment.heartbeat[0] += 1  # the sidecar's lease, renewed every step
        engine.step()
        records = reader.read()
        controller.observe(0, unpack(records))
        for record in records:
            bs = int(record["bs"])
            tokens += int(record["accepted"][:bs].sum()) + bs
            ns += int(record["step_ns"])
        now = engine.engine_time_ns / 1e9
        if now >= next_tick:
            generation = control.generation
            controller.tick(now)
            if control.generation != generation:
                writes.append(now)
            if on_tick:
                on_tick(now)
            next_tick = now + tick_s
    return writes, tokens / ns * 1e9


@pytest.fixture
def engine_setup(segment_name):
    config = SimConfig(max_bs=64, mean_bs=24, num_moe_layers=8, ring_slots=256, seed=5)  # SYNTHETIC
    segment = create_segment(segment_name, config)
    control = PolicyControl(segment_name)
    control.attach(segment)
    engine = SimulatedEngine(config, segment)
    yield config, segment, control, engine
    segment.unlink()
    segment.close()


def test_auto_mode_converges_without_flapping(engine_setup):
    config, segment, control, engine = engine_setup
    control.set_control_mode("auto")
    # the operator's explicit bound (off by default) holds when set
    controller = AutoController(control, ControllerConfig(min_rows=500, max_tokens_given_up=0.1),
                                engine_config=lambda: segment.config)
    writes, goodput = _drive(engine, segment, control, controller, seconds=40)
    readings = controller.readings()
    assert writes and writes[0] < 15, writes            # it acted early
    assert len([w for w in writes if w > 20]) <= 1, writes  # and then held still
    assert control.source == "auto" and control.policy.mode == "conf"
    assert control.policy.explore_period > 0
    assert readings.cost_fit_r2 > 0.95
    assert readings.ready == 1.0
    assert readings.predicted_tokens_given_up <= 0.1 + 1e-9
    # the engine follows the written generation
    assert int(RingReader(segment, 0, from_start=True).read()[-1]["generation"]) == control.generation
    assert goodput > 0


def test_ticks_and_their_wall_time_are_counted_even_when_a_tick_fails(engine_setup):
    import time

    config, segment, control, engine = engine_setup
    controller = AutoController(control, ControllerConfig(min_rows=500), engine_config=lambda: segment.config)
    ticks = []
    started = time.perf_counter()
    _drive(engine, segment, control, controller, seconds=5, on_tick=ticks.append)
    elapsed = time.perf_counter() - started
    readings = controller.readings()
    assert readings.ticks_total == len(ticks) > 0
    assert 0 < readings.tick_seconds_total <= elapsed

    def broken():
        raise RuntimeError("engine geometry unreadable")
    controller.engine_config = broken
    with pytest.raises(RuntimeError):
        controller.tick(6.0)
    assert controller.readings().ticks_total == len(ticks) + 1
    assert controller.readings().tick_seconds_total > readings.tick_seconds_total


def test_manual_set_policy_switches_auto_off(engine_setup):
    config, segment, control, engine = engine_setup
    control.set_control_mode("auto")
    controller = AutoController(control, ControllerConfig(min_rows=500), engine_config=lambda: segment.config)
    manual = Policy("fixed", 2, (Bucket(1, 1, 5, (0.0,) * 5),))

    def operator(now):
        if 10 <= now < 10.6:
            control.set_policy(manual, "manual", who="operator")

    _drive(engine, segment, control, controller, seconds=20, on_tick=operator)
    assert control.control_mode == "manual" and control.source == "manual"
    assert control.policy.mode == "fixed" and control.policy.fixed_k == 2


@pytest.mark.parametrize("overrides", [
    dict(conf_bias=-3.0, accept_first=0.9, accept_last=0.5),          # head far too pessimistic
    dict(conf_scale=-1.0, accept_first=0.8, accept_last=0.3),         # head anti-correlated
])
def test_guardrail_holds_on_adversarial_heads(segment_name, overrides):
    config = SimConfig(max_bs=64, mean_bs=16, num_moe_layers=8, ring_slots=256, seed=7, **overrides)  # SYNTHETIC
    segment = create_segment(segment_name, config)
    try:
        control = PolicyControl(segment_name)
        control.attach(segment)
        control.set_control_mode("auto")
        engine = SimulatedEngine(config, segment)
        uncapped = []
        draw = engine.acceptance.accepted_drafts
        engine.acceptance.accepted_drafts = lambda p, rng: uncapped.append(draw(p, rng)) or uncapped[-1]
        limit = 0.1
        controller = AutoController(control, ControllerConfig(min_rows=500, max_tokens_given_up=limit),
                                    engine_config=lambda: segment.config)
        reader = RingReader(segment, 0, from_start=True)
        given_up = requests = 0
        next_tick = 0.5
        while engine.engine_time_ns < 30e9:
            segment.heartbeat[0] += 1
            engine.step()
            records = reader.read()
            controller.observe(0, unpack(records))
            bs = int(records[0]["bs"])
            if engine.engine_time_ns > 10e9:  # measured after the first decisions
                given_up += int((uncapped[-1] - records[0]["accepted"][:bs]).sum())
                requests += bs
            if engine.engine_time_ns / 1e9 >= next_tick:
                controller.tick(engine.engine_time_ns / 1e9)
                next_tick += 0.5
        assert given_up / requests <= limit * 1.25, given_up / requests   # measured, with sampling noise
        assert controller.readings().predicted_tokens_given_up <= limit + 1e-9
    finally:
        segment.unlink()
        segment.close()


def _random_evaluation(rng, rules: int = 30) -> Evaluation:
    """SYNTHETIC tokens, live lengths and tokens given up for ``rules`` candidate rules."""
    return Evaluation(tokens=rng.uniform(1, 3, rules), mean_live=rng.uniform(1, 6, rules),
                      given_up=rng.uniform(0, 0.5, rules), given_up_se=rng.uniform(0, 0.05, rules),
                      chunk_tokens=rng.uniform(1, 3, (8, rules)), chunk_live=rng.uniform(1, 6, (8, rules)))


def test_choose_rule_never_picks_a_rule_over_the_guardrail():
    rng = np.random.default_rng(0)
    evaluation = _random_evaluation(rng)
    evaluation.given_up[0], evaluation.given_up_se[0] = 0.0, 0.0
    curve = ExpertCurve(4, 384, 6, 600)
    cost = StepCostFit()
    cost.set_prior(1e6, 1e4)
    for limit in (0.0, 0.05, 0.1, 0.3):
        choice = choose_rule(evaluation, np.array([16.0]), np.ones(1), curve, cost, limit, 2.0, 0)
        assert evaluation.given_up[choice.best] + 2.0 * evaluation.given_up_se[choice.best] <= limit + 1e-12


def test_default_guardrail_keeps_a_rule_only_where_its_gain_over_all_live_beats_its_uncertainty():
    rng = np.random.default_rng(1)
    evaluation = _random_evaluation(rng)
    curve = ExpertCurve(4, 384, 6, 600)
    cost = StepCostFit()
    cost.set_prior(1e6, 1e4)
    assert ControllerConfig().max_tokens_given_up == float("inf")
    choice = choose_rule(evaluation, np.array([16.0]), np.ones(1), curve, cost, float("inf"), 2.0, 0, all_live=0)
    chunk = evaluation.goodput(np.array([16.0]), np.ones(1), curve, cost, chunk=True)
    se = (chunk / chunk[:, [0]]).std(axis=0, ddof=1) / np.sqrt(8) * choice.goodput[0]
    lower = choice.goodput - 2.0 * se
    assert choice.best == 0 or lower[choice.best] >= choice.goodput[0]
    assert choice.goodput[choice.best] == choice.goodput[choice.feasible].max()
    assert not choice.feasible.all()   # noisy rules are held back


@pytest.mark.parametrize("near_gain, lands_on, from_every_row", [(0.002, 0, 0), (0.007, 2, 0), (0.02, 2, 2)])
def test_the_guardrails_move_lands_on_every_row_unless_the_best_beats_it_by_min_gain(
        monkeypatch, near_gain, lands_on, from_every_row):
    # SYNTHETIC search outcome: rule 0 verifies every row, rule 1 is in force and predicted 1%
    # below it (over the guardrail), rule 2 is the best within it at ``near_gain`` above every row,
    # its gain's standard error 0.3%. A rule nearer every row than min_gain (0.5%) is as near the
    # bound as the one left: the guardrail sends the bucket to every row, not on to the next wobble
    from types import SimpleNamespace

    from vcap.sidecar.controller import decision
    from vcap.sidecar.controller.goodput import BucketChoice

    goodput = np.array([1000.0, 990.0, 1000.0 * (1 + near_gain)])

    def search(evaluation, points, weights, curve, cost, bound, z, reference, all_live, correction):
        assert all_live == 0
        violating = goodput < goodput[all_live] * 0.995
        return BucketChoice(best=2, unconstrained=2, goodput=goodput, goodput_se=np.full(3, 3.0),
                            feasible=~violating, violating=violating)

    monkeypatch.setattr(decision, "choose_rule", search)
    load = SimpleNamespace(points=None, weights=None, share=0.9, busy=True)
    model = SimpleNamespace(curve=None, cost=None)
    evaluation = SimpleNamespace(mean_live=np.array([6.0, 4.0, 5.5]))
    choice, _ = decision._choose(evaluation, load, 1, 0, model, ControllerConfig())
    assert (choice.index, choice.change, choice.urgent) == (lands_on, True, True)
    # from every row, a move needs min_gain and one standard error more
    choice, _ = decision._choose(evaluation, load, 0, 0, model, ControllerConfig())
    assert choice.index == from_every_row


def test_engine_queue_reader_parses_sglang_metrics(tmp_path):
    page = tmp_path / "metrics"
    page.write_text('# HELP sglang:num_queue_reqs queued\nsglang:num_queue_reqs{model="x"} 7.0\n'
                    'sglang:num_queue_reqs{model="y"} 2\nsglang:num_queue_reqs_total 99\n')
    assert read_engine_queue(page.as_uri()) == 9.0
    assert read_engine_queue("http://127.0.0.1:9/metrics", timeout_s=0.2) is None


def _replay(seconds: float) -> list:
    """Drive a pure-trace engine under the controller; return the policies it wrote."""
    config = SimConfig(max_bs=64, mean_bs=16, seed=3)
    engine = SimulatedEngine(config)
    control = PolicyControl("replay")
    control.set_control_mode("auto")
    controller = AutoController(control, ControllerConfig(), engine_config=config.segment_config)
    return [policy for _, policy in drive(engine, controller, control, seconds)]


def test_a_replayed_trace_gives_the_same_decisions():
    # the row subsample is seeded: the evaluation harness compares policies on paired traces
    first = _replay(8.0)
    assert first, "the controller should have written a policy within 8 s"
    assert _replay(8.0) == first


def test_going_back_to_the_rule_a_bucket_left_needs_the_return_gain():
    from dataclasses import replace

    from vcap.policy import default_policy, rule_at
    from vcap.sidecar.controller.decision import LeftRule, plan
    from vcap.sidecar.controller.measured import rule_key

    # SYNTHETIC: steady bs 48, steep acceptance: capping pays, so the model's best is not all-live
    config = SimConfig(max_bs=64, mean_bs=48, load_noise=0.0, num_moe_layers=8, accept_first=0.7,
                       accept_last=0.05, seed=3)
    control = PolicyControl("return-gain")
    control.set_control_mode("manual")        # it learns without writing: all-live stays in force
    controller = AutoController(control, ControllerConfig(), engine_config=config.segment_config)
    drive(SimulatedEngine(config), controller, control, 12.0)
    model, all_live = controller.model, default_policy(config.num_drafts)
    # every positive predicted gain is a reason to change; no trials (their own path)
    eager = ControllerConfig(min_gain=0.0, confidence_z=0.0, trial_margin=0.0, return_gain=0.0)
    chosen = plan(model, all_live, True, eager)
    bucket = next(i for i, load in enumerate(model.bucket_loads()) if load.share > 0.5)
    stay, move = rule_key(rule_at(all_live, 48, 5), 5), rule_key(chosen.rules[bucket], 5)
    assert chosen.changed and move != stay
    # the change leaves all-live: that is the rule this bucket last left, at bs 48
    assert model.left[bucket].key == stay
    assert model.left[bucket].bs == pytest.approx(48, rel=0.2)

    def rule_chosen(settings: ControllerConfig) -> tuple:
        return rule_key(plan(model, all_live, True, settings).rules[bucket], config.num_drafts)

    # the best is the rule the bucket last left: a return needs return_gain more
    model.left[bucket] = LeftRule(move, 48.0)
    assert rule_chosen(replace(eager, return_gain=10.0)) == stay
    assert rule_chosen(eager) == move
    # ... or any rule on its side of the one in force: here the bucket last left a rule of fewer
    # rows than all-live (k=1), and the best (fewer rows too) is not that rule
    fewer = rule_key(Bucket(1, 1, 1, (0.0,) * 5), 5)
    assert fewer != move
    model.left[bucket] = LeftRule(fewer, 48.0)
    assert rule_chosen(replace(eager, return_gain=10.0)) == stay
    # ... only at the load it left it at, and only until the acceptance changes
    model.left[bucket] = LeftRule(move, 8.0)
    assert rule_chosen(replace(eager, return_gain=10.0)) == move
    model.left[bucket] = LeftRule(move, 48.0)
    model.forget("a test")
    assert not model.left


def test_a_move_reverses_the_last_one_only_toward_the_side_it_came_from():
    from vcap.sidecar.controller.decision import _moves_back

    live = np.array([2.0, 3.0, 4.0, 5.0])   # predicted live rows per request of four rules
    every_row = 3                            # rule 3 verifies every row
    # in force: rule 1 (3.0); the bucket last left rule 2 (4.0, more rows)
    assert _moves_back(live, 1, 2, 2, every_row)          # that very rule
    assert _moves_back(live, 1, 3, 2, every_row)          # another rule of more rows
    assert not _moves_back(live, 1, 0, 2, every_row)      # fewer rows: onward, not back
    assert not _moves_back(live, 1, 2, None, every_row)   # no rule left at this load
    assert not _moves_back(live, 1, 1, 2, every_row)      # staying is no move
    assert not _moves_back(np.array([2.0, 3.0, 3.0, 5.0]), 1, 2, 0, every_row)   # the same rows: no side
    # leaving every row (a start, a change of acceptance) is an approach: a rule between the two
    # is free to follow; only every row itself needs the return gain
    assert not _moves_back(live, 1, 2, every_row, every_row)
    assert _moves_back(live, 1, every_row, every_row, every_row)


def test_debug_log_names_the_rule_each_busy_bucket_runs(engine_setup, caplog):
    import logging
    import re

    from vcap.policy import rule_at

    config, segment, control, engine = engine_setup
    control.set_control_mode("auto")
    controller = AutoController(control, ControllerConfig(min_rows=500), engine_config=lambda: segment.config)
    with caplog.at_level(logging.DEBUG, logger="vcap.controller"):
        _drive(engine, segment, control, controller, seconds=30)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("bucket ")]
    assert lines, "no decision was logged"
    last = re.match(r"bucket \d+ \(bs ([\d.]+), share [\d.]+\): judged .*?; chose ([\d.]+):(\d)-(\d) ", lines[-1])
    assert last, lines[-1]
    bs, threshold, k_min, k_max = float(last[1]), float(last[2]), int(last[3]), int(last[4])
    # the last choice logged is the rule in force at that batch size (no trial pending at the end)
    rule = rule_at(control.policy, round(bs), config.num_drafts)
    assert (rule.thresholds[0], rule.k_min, rule.k_max) == pytest.approx((threshold, k_min, k_max)), lines[-1]


def test_manual_mode_decides_only_for_the_readings_every_few_seconds(engine_setup, monkeypatch):
    # in manual mode the decision feeds only the readings: made every manual_plan_interval_s, not
    # at every tick, and at the tick after an operator's write; switching to auto decides at once
    import vcap.sidecar.controller.auto as auto_module

    config, segment, control, engine = engine_setup
    decided = []
    real_plan = auto_module.plan

    def counted_plan(*args, **kwargs):
        decided.append(engine.engine_time_ns / 1e9)
        return real_plan(*args, **kwargs)

    monkeypatch.setattr(auto_module, "plan", counted_plan)
    controller = AutoController(control, ControllerConfig(min_rows=500, manual_plan_interval_s=5.0),
                                engine_config=lambda: segment.config)
    ticks = []
    _drive(engine, segment, control, controller, seconds=30, on_tick=ticks.append)
    assert control.control_mode == "manual" and len(ticks) >= 50
    assert len(decided) >= 3 and np.all(np.diff(decided) >= 5.0 - 1e-9), decided
    assert controller.readings().predicted_goodput_tokens_per_second > 0
    # ticks at chosen times: one a full interval on decides, the next 0.5 s later does not, unless
    # the operator wrote a policy in between
    at = engine.engine_time_ns / 1e9 + 5.0
    controller.tick(at)
    before = len(decided)
    controller.tick(at + 0.5)
    assert len(decided) == before
    control.set_policy(Policy("fixed", 1, (Bucket(1, 2, 2, (0.0,) * config.num_drafts),)), "manual", "test")
    controller.tick(at + 1.0)
    controller.tick(at + 1.5)
    assert len(decided) == before + 1
    control.set_control_mode("auto")
    controller.tick(at + 2.0)
    assert len(decided) == before + 2
