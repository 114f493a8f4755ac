"""bench/eval_controller.py logs auto's writes as one line per policy; bench/static_policy.py runs
such a line again as a static rule, so the line must spell the policy exactly."""

import copy
import json
import math
import os

import numpy as np
import pytest

from tests.utils import BENCH as _BENCH, import_bench

eval_controller, static_grid = import_bench("eval_controller", "static_grid")


def test_the_policies_auto_writes_read_back_from_their_log_lines():
    # a short SYNTHETIC trace: the controller's own writes, not policies made up for the test
    trace = dict(eval_controller.TRACES["shift-4-96-skew1.5"], seconds=40, shift_after_s=15.0)
    result = eval_controller.run_trace(trace, None, seed=2)
    assert len(result["writes"]) >= 2
    for _, line in result["writes"]:
        policy = eval_controller.policy_of_description(line)
        assert eval_controller._describe(policy) == line
        assert policy.mode == "conf" and policy.buckets[0].min_bs == 1


@pytest.mark.parametrize("line", ["", "explore/16", "1:0.3 explore/16", "1:0.3:1-x"])
def test_a_line_that_spells_no_policy_is_refused(line):
    with pytest.raises(ValueError):
        eval_controller.policy_of_description(line)


@pytest.mark.parametrize("label,k_min,k_max,threshold", [
    ("conf0.3", 1, 5, 0.3), ("conf0.1k3", 1, 3, 0.1), ("conf0.6k2-5", 2, 5, 0.6), ("conf.45k4", 1, 4, 0.45)])
def test_a_rule_label_spells_its_policy(label, k_min, k_max, threshold):
    (bucket,) = static_grid.rule(label).buckets
    assert (bucket.k_min, bucket.k_max, bucket.thresholds) == (k_min, k_max, (threshold,) * static_grid.D)
    assert static_grid.rule("k=2").fixed_k == 2 and static_grid.rule("off").mode == "off"


@pytest.mark.parametrize("label", ["conf", "conf1.5", "conf0.3k6", "conf0.3k4-2", "k=0", "k=6", "conf0.3 ", "on"])
def test_a_label_that_spells_no_rule_is_refused(label):
    with pytest.raises(ValueError):
        static_grid.rule(label)


def test_both_benchmarks_judge_on_the_full_grid():
    # issue 12: fixed k 1-4 and off, thresholds 0.05-0.9, thresholds with k bounds
    assert eval_controller.STATIC is static_grid.GRID and len(static_grid.GRID) == 20
    bounds = {(b.k_min, b.k_max) for p in static_grid.GRID.values() if p.mode == "conf" for b in p.buckets}
    thresholds = {b.thresholds[0] for p in static_grid.GRID.values() if p.mode == "conf" for b in p.buckets}
    assert {(1, 2), (1, 3), (2, 5), (1, 5)} <= bounds and min(thresholds) == 0.05 and max(thresholds) == 0.9
    assert set(static_grid.SHORT) < set(static_grid.GRID)


def test_a_controller_variant_changes_only_the_fields_it_names():
    # eval_controller --controller and bench_loop --auto NAME=...: a variant of the committed config
    default = eval_controller.ControllerConfig()
    variant = eval_controller.controller_config("trial_steady_s:5,trial_max:3,max_tokens_given_up:inf",
                                                min_rows=300)
    assert (variant.trial_steady_s, variant.trial_max, variant.min_rows) == (5.0, 3, 300)
    assert isinstance(variant.trial_max, int) and variant.max_tokens_given_up == float("inf")
    assert variant.sample_half_life_s == default.sample_half_life_s
    with pytest.raises(AttributeError):
        eval_controller.controller_config("no_such_field:1")
    with pytest.raises(ValueError):   # the config's own check: a share above 1
        eval_controller.controller_config("trial_min_share:2")


@pytest.mark.parametrize("count", ["1", "-2"])
def test_eval_controller_refuses_a_from_state_count_without_a_next_best(count, capsys):
    with pytest.raises(SystemExit) as exit_info:
        eval_controller.main(["--from-state", count, "--only", "shift-4-96-skew1.5"])
    assert exit_info.value.code == 2
    assert "--from-state" in capsys.readouterr().err


def test_eval_controller_refuses_an_unknown_rule_to_run_from_autos_state(capsys):
    with pytest.raises(SystemExit) as exit_info:
        eval_controller.main(["--also-from-state", "conf0.75,conf0.7", "--only", "shift-4-96-skew1.5"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "no static rule conf0.7 " in err and "conf0.75," in err   # names the bad one, lists the rules


@pytest.mark.parametrize("also", ["k=2", "k=2,k=2"])
def test_eval_controller_refuses_one_rule_alone_from_autos_state(also, capsys):
    # with --from-state 0 that rule would be the only run from auto's state: no next best to score against
    with pytest.raises(SystemExit) as exit_info:
        eval_controller.main(["--from-state", "0", "--also-from-state", also, "--only", "shift-4-96-skew1.5"])
    assert exit_info.value.code == 2
    assert "at least 2 rules" in capsys.readouterr().err


@pytest.mark.parametrize("fields", ["no_such_field:1", "trial_max:x", "trial_steady_s", "max_tokens_given_up:0.2"])
def test_eval_controller_refuses_a_bad_variant_before_it_runs(fields, capsys):
    with pytest.raises(SystemExit) as exit_info:
        eval_controller.main(["--controller", fields, "--only", "shift-4-96-skew1.5"])
    assert exit_info.value.code == 2
    assert "--controller" in capsys.readouterr().err
    assert eval_controller.CONTROLLER_FIELDS == ""   # the refused variant is not left in force


def _per_second(goodput: list[float]) -> dict:
    """A run's per-second record (SYNTHETIC): ``goodput[i]`` tokens in second ``i``."""
    n = len(goodput)
    return {"second": {"tokens": list(goodput), "ns": [1e9] * n, "given_up": [0.0] * n, "requests": [1] * n}}


def test_settle_in_longer_windows_ignores_a_one_second_dip_but_not_a_slow_rule():
    reference = _per_second([100.0] * 60)
    dip = _per_second([100.0] * 40 + [85.0] + [100.0] * 19)      # one second 15% short at 40 s
    slow = _per_second([90.0] * 20 + [100.0] * 40)               # 10% short for the first 20 s
    settle = eval_controller._settle
    assert settle(dip, {}, 0, 60, 0.0, reference=reference) == 41.0               # 5 s windows: 3% short
    assert settle(dip, {}, 0, 60, 0.0, reference=reference, window_s=10) == 0.0   # 10 s windows: 1.5% short
    # a rule that is slow for 20 s fails either test until at most 2% of a window is left at 90
    assert settle(slow, {}, 0, 60, 0.0, reference=reference) == 19.0
    assert settle(slow, {}, 0, 60, 0.0, reference=reference, window_s=10) == 18.0


def _run(goodput_per_second: list[float]) -> dict:
    """A run as run_trace reports it, per second only (tokens over one second of engine time)."""
    return {"second": {"tokens": list(goodput_per_second), "ns": [1e9] * len(goodput_per_second),
                       "given_up": [0.0] * len(goodput_per_second), "requests": [1.0] * len(goodput_per_second)}}


def test_the_held_out_floor_chooses_on_the_other_seeds_and_scores_on_this_one():
    # SYNTHETIC runs of three rules on three seeds: k=2 is best on seeds 1 and 2, conf0.3 got lucky
    # on seed 0 and leads it by 3%
    seeds = [{"k=2": _run([100.0] * 4), "conf0.3": _run([103.0] * 4), "off": _run([90.0] * 4)},
             {"k=2": _run([100.0] * 4), "conf0.3": _run([98.0] * 4), "off": _run([90.0] * 4)},
             {"k=2": _run([101.0] * 4), "conf0.3": _run([99.0] * 4), "off": _run([91.0] * 4)}]
    label, regret = eval_controller.held_out_floor(seeds, 0, 0.0, 4.0)
    assert label == "k=2" and regret == pytest.approx(1 - 100 / 103)
    # for seed 1, seed 0's luck outweighs seed 2's 2% for k=2: conf0.3 is chosen, and costs 2% there
    label, regret = eval_controller.held_out_floor(seeds, 1, 0.0, 4.0)
    assert label == "conf0.3" and regret == pytest.approx(1 - 98 / 100)
    # a hindsight combination counts in the window's best, as in auto's regret, never as the choice
    seeds[2]["hindsight-free"] = _run([104.0] * 4)
    label, regret = eval_controller.held_out_floor(seeds, 2, 0.0, 4.0)
    assert label == "conf0.3" and regret == pytest.approx(1 - 99 / 104)
    assert eval_controller.held_out_floor(seeds[:1], 0, 0.0, 4.0) is None


def test_the_held_out_floor_reads_only_the_window():
    seeds = [{"k=2": _run([100.0, 100.0, 50.0]), "conf0.3": _run([90.0, 90.0, 200.0])},
             {"k=2": _run([100.0, 100.0, 50.0]), "conf0.3": _run([95.0, 95.0, 200.0])}]
    label, regret = eval_controller.held_out_floor(seeds, 0, 0.0, 2.0)
    assert label == "k=2" and regret == pytest.approx(0.0)
    label, regret = eval_controller.held_out_floor(seeds, 0, 2.0, 3.0)
    assert label == "conf0.3" and regret == pytest.approx(0.0)


def _timed_run(ns_per_second: list[float], live: list[float]) -> dict:
    """A SYNTHETIC run that commits 100 tokens over 10 requests a second, in the given times."""
    n = len(ns_per_second)
    return {"second": {"tokens": [100.0] * n, "ns": list(ns_per_second), "given_up": [0.0] * n,
                       "requests": [10.0] * n, "live": list(live)}}


def test_the_timing_noise_pairs_only_rules_that_verified_the_same_rows():
    # k=1 and conf0.9 verify 2 rows a request every second; the second run's steps took 2% longer
    # over its last 10 s. conf0.3 verified other rows (it varies) and k=2 more: neither pairs
    runs = {"k=1": _timed_run([1e9] * 20, [20.0] * 20),
            "conf0.9": _timed_run([1e9] * 10 + [1.02e9] * 10, [20.0] * 20),
            "conf0.3": _timed_run([1e9] * 20, [20.0] * 19 + [25.0]),
            "k=2": _timed_run([1e9] * 20, [30.0] * 20),
            "auto": _timed_run([1e9] * 20, [20.0] * 20)}
    pairs, gaps = eval_controller.timing_noise(runs, window_s=10)
    assert pairs == [("conf0.9", "k=1")]
    assert gaps == pytest.approx([0.0, abs(math.log(1 / 1.02))])
    del runs["conf0.9"]
    assert eval_controller.timing_noise(runs) == ([], [])


def test_a_run_from_autos_state_is_autos_run_until_the_change():
    # a short SYNTHETIC drain: 128 requests in flight, 8 from 12 s on
    trace = dict(eval_controller.TRACES["shift-128-8-skew1.5"], seconds=24, shift_after_s=12.0)
    auto = eval_controller.run_trace(trace, None, seed=2)
    at = auto["change_steps"]["12"]
    assert len(auto["write_steps"]) == len(auto["writes"]) >= 2 and 0 < at < auto["steps"]
    # every write replayed at the step it took effect: the same run, to the nanosecond
    replayed = [(step, eval_controller.policy_of_description(line))
                for step, (_, line) in zip(auto["write_steps"], auto["writes"])]
    again = eval_controller.run_trace(trace, None, seed=2, schedule=replayed)
    assert again["second"] == auto["second"] and again["writes"] == []
    # k=2 from auto's state: auto's run to the second before the change, its own after; it takes
    # over at the change's first step (by engine time, as the change), exactly where auto was
    k2 = eval_controller.from_auto_state(trace, auto, 12.0, eval_controller.STATIC["k=2"], seed=2)
    assert k2["change_steps"] == auto["change_steps"]
    by_step = eval_controller.run_trace(trace, None, seed=2, schedule=[
        *[(step, policy) for step, policy in replayed if step < at], (at, eval_controller.STATIC["k=2"])])
    assert by_step["second"] == k2["second"]
    assert k2["second"]["tokens"][:12] == auto["second"]["tokens"][:12]
    assert k2["second"]["live"][13:] != auto["second"]["live"][13:]
    assert {live / requests for live, requests in zip(k2["second"]["live"][13:], k2["second"]["requests"][13:])} == {3.0}
    with pytest.raises(ValueError):   # a scheduled run has no policy of its own to start from
        eval_controller.run_trace(trace, eval_controller.STATIC["k=1"], seed=2, schedule=replayed)


def test_a_rule_run_twice_from_autos_state_reads_the_measurements_own_noise():
    # the short SYNTHETIC drain again: on the simulator a second run from the same state is the
    # same run, and the noise it reads is 0
    trace = dict(eval_controller.TRACES["shift-128-8-skew1.5"], seconds=24, shift_after_s=12.0)
    auto = eval_controller.run_trace(trace, None, seed=2)
    first, again = (eval_controller.from_auto_state(trace, auto, 12.0, eval_controller.STATIC["k=2"], seed=2)
                    for _ in range(2))
    auto.update(from_state={"12": {"k=2": first}}, from_state_again={"12": {"k=2": again}})
    assert eval_controller.replica_noise(auto, window_s=4) == [0.0, 0.0, 0.0]   # 12-16, 16-20, 20-24
    # SYNTHETIC: the second run 10% faster from 18 s on; windows from the change only
    faster = {"second": dict(first["second"], tokens=[t * (1.1 if i >= 18 else 1.0)
                                                       for i, t in enumerate(first["second"]["tokens"])])}
    auto["from_state_again"] = {"12": {"k=2": faster}}
    gaps = eval_controller.replica_noise(auto, window_s=6)   # 12-18, 18-24
    assert gaps == pytest.approx([0.0, math.log(1.1)])
    assert eval_controller.replica_noise({"from_state": auto["from_state"]}) == []   # no second run: nothing read
    # as the settle test reads it (by (f), a window starting every second): 0 for the one run, and
    # log 1.1 in the windows wholly after 18 s for SYNTHETIC 10% more tokens in the same engine time
    auto["from_state_again"] = {"12": {"k=2": again}}
    assert eval_controller.replica_noise(auto, window_s=4, matched=True) == [0.0] * 10   # 12-16 .. 21-25
    faster = copy.deepcopy(first)
    faster["second"]["tokens"] = [t * (1.1 if i >= 18 else 1.0) for i, t in enumerate(first["second"]["tokens"])]
    faster["sizes"] = [[s, b, t * (1.1 if s >= 18 else 1.0), ns] for s, b, t, ns in first["sizes"]]
    auto["from_state_again"] = {"12": {"k=2": faster}}
    gaps = eval_controller.replica_noise(auto, window_s=6, matched=True)   # 12-18 .. 19-25
    assert len(gaps) == 8 and gaps[0] == 0.0 and gaps[-2:] == pytest.approx([math.log(1.1)] * 2)
    assert all(later >= earlier - 1e-12 for earlier, later in zip(gaps, gaps[1:]))   # rising, to rounding


def test_settle_from_autos_state_is_judged_against_the_best_run_from_there():
    # SYNTHETIC runs from a change at 0: k=2 best over the segment, conf0.3 1% behind; auto 6%
    # short for its first 12 s, then level with k=2
    runs = {"k=2": _run([100.0] * 40), "conf0.3": _run([99.0] * 40), "k=1": _run([90.0] * 40)}
    auto = _run([94.0] * 12 + [100.0] * 28)
    row = eval_controller._from_state_scores(auto, runs, 0.0, 30.0, 40.0)
    assert (row["from_state_best_label"], row["from_state_twin_label"]) == ("k=2", "conf0.3")
    assert row["auto_regret_from_state"] == pytest.approx(1 - (12 * 94 + 18 * 100) / 30 / 100)
    assert row["auto_settle_from_state_5s"] == 11.0     # 5 s windows: at most one slow second, 1.2%
    assert row["auto_settle_from_state_10s"] == 9.0     # 10 s windows: at most 3 slow seconds, 1.8%
    assert row["twin_settle_from_state_5s"] == row["twin_settle_from_state_10s"] == 0.0


def _run_of(goodput_per_second: list[float], within: list[list[float]]) -> dict:
    """A run per second, one request verifying 3 rows (2 drafts) a second, whose rows would have
    accepted ``within[s][k - 1]`` drafts with k verified each (k = 1..5)."""
    run = _run(goodput_per_second)
    run["second"]["live"] = [3.0] * len(goodput_per_second)
    run["second"]["accepted_within"] = [list(row) for row in within]
    return run


RICH = [0.8, 1.5, 2.0, 2.3, 2.5]     # accepted drafts with k = 1..5 verified: 2.5 tokens at depth 2
POOR = [0.75, 1.44, 1.9, 2.2, 2.4]   # 2.44 tokens at depth 2
DEEP = [0.8, 1.5, 2.3, 2.9, 3.4]     # RICH's first two drafts, more accepted beyond them


def test_at_autos_requests_a_run_whose_requests_were_accepted_more_is_scaled_down():
    # SYNTHETIC runs from a change at 0: over 10-25 s auto's batch holds requests that commit
    # 2.44 tokens at depth 2 against the best run's 2.5, and auto commits that much less; a rule
    # truly 4% slower on the same requests stays 4% behind
    ratio = (1 + POOR[1]) / (1 + RICH[1])
    best = _run_of([100.0] * 40, [RICH] * 40)
    auto = _run_of([100.0] * 10 + [100.0 * ratio] * 15 + [100.0] * 15, [RICH] * 10 + [POOR] * 15 + [RICH] * 15)
    slow = _run_of([100.0 / 1.04] * 40, [RICH] * 40)
    row = eval_controller._from_state_scores(auto, {"k=2": best, "conf0.3": slow}, 0.0, 30.0, 40.0)
    assert row["auto_settle_from_state_10s"] == 17.0   # as measured: 2.4% behind until 25 s (17-27 s: 1.9%)
    assert row["auto_settle_from_state_10s_adjusted"] == 0.0          # at its own requests: level
    assert row["auto_regret_from_state_adjusted"] == pytest.approx(0.0, abs=1e-12)
    assert row["auto_regret_from_state"] > 0.01
    assert row["twin_settle_from_state_10s_adjusted"] is None         # the slow rule: behind throughout
    assert eval_controller._adjusted_goodput(best, auto, 10.0, 20.0) == pytest.approx(100.0 * ratio)


def test_requests_that_differ_only_beyond_a_runs_depth_do_not_scale_it():
    # 3 rows a request verify 2 drafts: acceptance at positions 3-5 commits nothing there
    best, auto = _run_of([100.0] * 20, [RICH] * 20), _run_of([100.0] * 20, [DEEP] * 20)
    assert eval_controller._adjusted_goodput(best, auto, 0.0, 10.0) == pytest.approx(100.0)
    # at depth 1.5 the tokens are interpolated between 1 and 2 drafts
    assert eval_controller._potential(best, 0.0, 10.0, 1.5) == pytest.approx(1 + (0.8 + 1.5) / 2)
    # a file written before the per-depth record: nothing to scale by
    del best["second"]["accepted_within"]
    assert eval_controller._adjusted_goodput(best, auto, 0.0, 10.0) is None


def test_a_run_records_what_its_rows_would_accept_at_every_depth():
    # SYNTHETIC short run at k=2: 2 drafts verified, so what was accepted is what would be at depth 2
    trace = dict(eval_controller.TRACES["steady-bs8-attn"], seconds=6)
    run = eval_controller.run_trace(trace, eval_controller.STATIC["k=2"], seed=2)
    second = run["second"]
    within = np.asarray(second["accepted_within"])
    accepted = np.asarray(second["tokens"]) - np.asarray(second["requests"])
    np.testing.assert_allclose(within[:, 1], accepted)
    np.testing.assert_allclose(within[:, -1], accepted + np.asarray(second["given_up"]))   # every draft
    assert (np.diff(within, axis=1) >= 0).all() and within[:, 0].sum() > 0


def test_the_rules_run_from_autos_state_are_the_best_after_the_change():
    # SYNTHETIC: changes at 2 s and 4 s of a 6 s trace; k=1 leads before 2 s and after 4 s, k=2
    # between them, off never
    params = {"load": "shift", "shift_after_s": 2.0, "accept_change_s": 4.0, "seconds": 6}
    static = {"k=1": _run([120.0, 120.0, 90.0, 90.0, 120.0, 120.0]),
              "k=2": _run([100.0, 100.0, 100.0, 100.0, 100.0, 100.0]),
              "off": _run([80.0] * 6)}
    assert eval_controller._best_after(static, params, 2.0) == ["k=2", "k=1", "off"]
    assert eval_controller._best_after(static, params, 4.0) == ["k=1", "k=2", "off"]


def test_in_a_drain_the_rules_run_from_autos_state_are_also_the_best_at_its_batch_sizes():
    # SYNTHETIC drain after a change at 0 s: auto's batch holds 5 requests. "k=2" drained slower
    # and holds 7, so it leads as run; "k=4" makes the most of 5 requests; "off" is slowest both ways
    params = {"load": "shift", "shift_after_s": 0.0, "seconds": 10}
    auto = _run_by_size({5: (500.0, 100.0)})
    static = {"k=2": _run_by_size({5: (50.0, 10.0), 7: (980.0, 100.0)}),   # 1.0 and 1.4 tokens per ns per request
              "k=4": _run_by_size({5: (600.0, 100.0)}),                     # 1.2
              "conf0.3": _run_by_size({5: (550.0, 100.0)}),                 # 1.1
              "off": _run_by_size({5: (450.0, 100.0)})}
    for run in (auto, *static.values()):   # the same requests in every batch
        run["second"].update(live=[3.0] * 10, accepted_within=[RICH] * 10)
    assert eval_controller._best_after(static, params, 0.0) == ["k=2", "k=4", "conf0.3", "off"]
    # alternately at auto's batch sizes and requests (the first there first) and as run
    assert eval_controller._best_after(static, params, 0.0, auto) == ["k=4", "k=2", "conf0.3", "off"]
    # a rule that reading cannot read (its batch elsewhere) still comes in as run
    static["conf0.6"] = _run_by_size({9: (2000.0, 100.0)})
    static["conf0.6"]["second"].update(live=[3.0] * 10, accepted_within=[RICH] * 10)
    assert eval_controller._best_after(static, params, 0.0, auto)[:3] == ["k=4", "conf0.6", "conf0.3"]


def test_a_regret_read_against_the_rules_a_reading_can_read_says_how_many_it_cannot():
    auto = _run_by_size({5: (500.0, 100.0)})
    runs = [_run_by_size({5: (550.0, 100.0)}), _run_by_size({9: (2000.0, 100.0)})]
    regret, unread = eval_controller._regret_read(auto, runs, 0, 10, eval_controller._batch_goodput)
    assert regret == pytest.approx(1 - 500 / 550) and unread == 1   # a lower bound: one not read
    regret, unread = eval_controller._regret_read(auto, runs, 0, 10)   # as run: every run read
    assert regret == pytest.approx(1 - 500 / 2000) and unread == 0
    assert eval_controller._regret_read(auto, runs[1:], 0, 10, eval_controller._batch_goodput) == (None, 1)
    row = {"auto_regret_free_matched": 0.0123, "matched_unread": 2}
    assert eval_controller._read_pct(row, "auto_regret_free_matched", "matched_unread") == ">= +1.23% (2 not read)"
    row["matched_unread"] = 0
    assert eval_controller._read_pct(row, "auto_regret_free_matched", "matched_unread") == "+1.23%"


def test_the_steady_window_after_a_change_is_also_read_against_the_runs_from_autos_state():
    # the GPU's drawn29-1-shift (a drain, bs 93 to 6) of the thirty-first round: its steady
    # window after the change is read against the six rules run from auto's state at 30 s
    import lzma
    with lzma.open(os.path.join(_BENCH, "runs", "gpu31_drawn29-1-shift_s1.json.xz"), "rt") as f:
        stored = json.load(f)
    scores = eval_controller._rescored(stored)["drawn29-1-shift"]["windows"]
    after = next(w for w in scores if w["window"] == "steady" and w["start"] == 60.0)
    auto = stored["results"]["drawn29-1-shift"]["auto"]
    runs = auto["from_state"]["30"]
    assert len(runs) == 6
    best = max(eval_controller._window(run, 60, 90)[0] for run in runs.values())
    assert after["auto_regret_from_state"] == pytest.approx(1 - eval_controller._window(auto, 60, 90)[0] / best)
    matched = [eval_controller._matched_goodput(run, auto, 60, 90) for run in runs.values()]
    assert after["from_state_matched_unread"] == sum(m is None for m in matched)
    assert after["auto_regret_from_state_matched"] == pytest.approx(
        1 - eval_controller._window(auto, 60, 90)[0] / max(m for m in matched if m is not None))
    # the windows before the change have no such reading, and neither does the transition's own key set
    assert all("from_state_matched_unread" not in w for w in scores if w["start"] < 60.0)


def test_the_summary_reads_a_run_kept_as_json_xz_as_it_reads_the_json(tmp_path, capsys):
    # bench/runs keeps the GPU rounds' result files xz-compressed (a tenth of the size)
    import lzma
    import shutil
    stored = os.path.join(_BENCH, "runs", "gpu_traces26_s1_shift-128-8-skew1.5.json.xz")
    plain, packed = tmp_path / "run.json", tmp_path / "run.json.xz"
    shutil.copy(stored, packed)
    with lzma.open(stored, "rb") as source, open(plain, "wb") as target:
        shutil.copyfileobj(source, target)
    eval_controller._summarize([str(plain)])
    from_json = capsys.readouterr().out
    eval_controller._summarize([str(packed)])
    assert from_json == capsys.readouterr().out and "shift-128-8-skew1.5 | steady 60-90" in from_json


def test_the_summary_of_files_of_different_traces_shows_every_trace(capsys):
    # the twenty-ninth round summarizes files of three traces together; each trace's rows come
    # from the files that hold it, whichever file comes first
    runs = os.path.join(_BENCH, "runs")
    fall = os.path.join(runs, "gpu_traces29_s2_accept-fall-bs48.json.xz")
    shift = os.path.join(runs, "gpu_traces29_s2_shift-4-96-skew1.5.json.xz")
    shift_other_seed = os.path.join(runs, "gpu_traces29_s3_shift-4-96-skew1.5.json.xz")
    eval_controller._summarize([fall, shift, shift_other_seed])
    together = capsys.readouterr().out
    eval_controller._summarize([shift, shift_other_seed])
    shift_alone = capsys.readouterr().out
    for line in shift_alone.splitlines():
        if line.startswith("| shift-4-96-skew1.5 |"):
            assert line in together
    assert "| accept-fall-bs48 | steady 60-90 |" in together
    assert together.count("| shift-4-96-skew1.5 | steady 60-90 |") == 1


def test_drawn_traces_are_the_same_for_a_seed_and_every_one_runs():
    # SYNTHETIC workloads drawn at random: one draw seed gives the same traces, another different ones
    drawn = eval_controller.drawn_traces(6, seed=7)
    assert drawn == eval_controller.drawn_traces(6, seed=7)
    assert drawn != eval_controller.drawn_traces(6, seed=8)
    assert [name.rsplit("-", 1)[1] for name in drawn] == ["steady", "shift", "accept"] * 2
    for name, params in drawn.items():
        assert 2 <= params["mean_bs"] <= 192 and params["accept_last"] <= params["accept_first"] - 0.15
        changes = eval_controller.changes_of(params)
        assert changes == ([] if name.endswith("steady") else [30.0])
        if name.endswith("shift"):
            low, high = sorted((params["mean_bs"], params["shift_bs"]))
            assert high >= 3 * low
        if name.endswith("accept"):
            assert abs(params["accept_first_after"] - params["accept_first"]) >= 0.15
    # the simulator takes every knob drawn: a short run of each kind at k=2
    for name, params in list(drawn.items())[:3]:
        short = dict(params, seconds=4, **{key: 2.0 for key in ("shift_after_s", "accept_change_s") if key in params})
        run = eval_controller.run_trace(short, eval_controller.STATIC["k=2"], seed=1)
        assert run["goodput"] > 0, name


def test_a_steady_load_of_a_trace_keeps_its_knobs_and_drops_its_changes():
    # --steady-bs: each trace's own knobs at a steady load, its changes left out
    steady = eval_controller.traces_of("drawn7-1-shift,drawn7-2-accept", False, 6, 7, steady_bs=30)
    assert list(steady) == ["drawn7-1-shift", "drawn7-2-accept"]
    for name, params in steady.items():
        assert eval_controller.changes_of(params) == [] and params["mean_bs"] == 30 and params["load"] == "steady"
        drawn = eval_controller.drawn_traces(6, seed=7)[name]
        assert params["router_skew"] == drawn["router_skew"] and params["accept_first"] == drawn["accept_first"]
        assert "accept_first_after" not in params and "shift_bs" not in params
        assert eval_controller.run_trace(dict(params, seconds=2), eval_controller.STATIC["k=1"], seed=1)["goodput"] > 0


def test_the_summary_scores_a_run_of_drawn_traces_again(capsys):
    # a result file of --drawn names its traces by the draw: the summary draws them again from
    # the file's arguments (it printed no row for them before)
    assert eval_controller.traces_of(None, False, 6, 7) == eval_controller.drawn_traces(6, seed=7)
    eval_controller._summarize([os.path.join(_BENCH, "runs", "drawn29_s1.json.xz")])
    out = capsys.readouterr().out
    for name in eval_controller.drawn_traces(9, seed=29):
        assert f"| {name} | cold 0-10 |" in out


def test_a_stored_run_with_the_size_record_is_read_at_autos_batch_sizes_and_requests():
    # the thirtieth round's stored draw: every change from auto's state gets reading (f), and
    # the stored runs settle by it (bench/CONTROLLER_RESULTS.md)
    import lzma
    with lzma.open(os.path.join(_BENCH, "runs", "drawn31_r30_s1.json.xz"), "rt") as f:
        scores = eval_controller._rescored(json.load(f))
    transitions = [w for result in scores.values() for w in result["windows"] if w["window"] == "transition"]
    assert len(transitions) == 6
    assert all(w["auto_settle_from_state_10s_matched"] is not None for w in transitions)
    assert max(w["auto_settle_from_state_10s_matched"] for w in transitions) < 30


def test_a_rule_that_verifies_more_rows_does_so_on_every_confidence_row():
    # fresh random rules and SYNTHETIC confidence rows: the direction read from the rules alone
    # agrees with the engine's reference rule on every row
    from vcap.engine_hook.reference import live_lengths
    from vcap.policy import Bucket, Policy
    rng = np.random.default_rng()
    D = eval_controller.D
    confidence = rng.uniform(0.0, 1.0, size=(256, D)).astype(np.float32)

    def random_rule() -> Bucket:
        k_min = int(rng.integers(1, D + 1))
        thresholds = tuple(float(t) for t in rng.choice([0.0, 0.05, 0.2, 0.4, 0.7], size=D))
        return Bucket(1, k_min, int(rng.integers(k_min, D + 1)), thresholds)

    seen = {-1: 0, 0: 0, 1: 0}
    for _ in range(400):
        old = random_rule()
        new = old if rng.random() < 0.1 else random_rule()
        direction = eval_controller._rows_direction(old, new)
        seen[direction] += 1
        live = [live_lengths(confidence, Policy("conf", D, (rule,)), 256, D + 1) for rule in (old, new)]
        if direction > 0:
            assert (live[1] >= live[0]).all() and new != old
        if direction < 0:
            assert (live[1] <= live[0]).all() and new != old
    assert min(seen.values()) > 0


def test_reversals_per_bucket_follow_the_rules_not_the_load():
    # SYNTHETIC write logs. A drain: each bucket the load reaches gets fewer rows, once
    # (the measured live length may rise and fall as the load moves; no reversal)
    drain = {"bucket_ns": [1.0] * len(eval_controller.EDGES), "trial_writes": [41.0],
             "writes": [(2.0, "1:0.3:1-3 explore/192"),
                        (35.0, "1:0.3:1-3 32:0.5:1-2 explore/192"),
                        (41.0, "1:0.3:1-3 8:0.1:1-5 32:0.5:1-2 explore/192"),   # a trial, left out
                        (44.0, "1:0.3:1-3 8:0.6:1-2 32:0.5:1-2 explore/192")]}
    assert eval_controller._bucket_reversals(drain, 30.0, 90.0) == 0
    # bucket 8 to fewer rows, back to more, to fewer again: two reversals there
    flip = dict(drain, trial_writes=[], writes=drain["writes"] + [(50.0, "1:0.3:1-3 8:0.2:1-4 32:0.5:1-2 explore/192"),
                                                                (60.0, "1:0.3:1-3 8:0.6:1-2 32:0.5:1-2 explore/192")])
    assert eval_controller._bucket_reversals(flip, 30.0, 90.0) == 3   # the trial at 41 s now counts
    assert eval_controller._bucket_reversals(flip, 30.0, 55.0) == 2
    # a bucket the load never reached does not count
    unreached = dict(flip, bucket_ns=[0.0 if edge in (8, 16) else 1.0 for edge in eval_controller.EDGES])
    assert eval_controller._bucket_reversals(unreached, 30.0, 90.0) == 0


def test_a_bucket_on_trial_is_left_out_of_the_writes_made_while_it_runs():
    # SYNTHETIC write log in the shape of drawn31-2-accept s2 on the CPU (thirty-second round):
    # bucket 16 tries 0.4 from 37 s; bucket 8's trial ends at 43 s, and bucket 16's rule on trial
    # rides in that write; its own trial ends at 60 s, back at the incumbent 0.13; at 65 s it moves
    # to 0.5 (fewer rows, as its first move)
    writes = [(37.0, "1:0.13:1-2 16:0.4:1-2 explore/400"),
              (41.0, "1:0.7:1-2 16:0.4:1-2 explore/400"),
              (43.0, "1:0.13:1-2 16:0.4:1-2 explore/400"),
              (60.0, "1:0.13:1-2 explore/400"),
              (65.0, "1:0.13:1-2 16:0.5:1-2 explore/400")]
    reached = [1.0 if edge in (8, 16) else 0.0 for edge in eval_controller.EDGES]
    per_bucket = {"bucket_ns": reached, "writes": writes, "trial_writes": [37.0, 41.0],
                  "trial_buckets": [(37.0, [16]), (41.0, [8, 16]), (43.0, [16])]}
    assert eval_controller._bucket_reversals(per_bucket, 30.0, 90.0) == 0
    # without the record, the trial's rule at 43 s reads as bucket 16's choice: 0.4, 0.13, 0.5
    older = {key: value for key, value in per_bucket.items() if key != "trial_buckets"}
    assert eval_controller._bucket_reversals(older, 30.0, 90.0) == 2
    # a bucket not on trial moves in a trial's write: counted (bucket 8 to more rows at 41 s,
    # back to fewer at 43 s)
    moved = dict(per_bucket, trial_buckets=[(37.0, [16]), (41.0, [16]), (43.0, [16])])
    assert eval_controller._bucket_reversals(moved, 30.0, 90.0) == 1


def test_the_stopgap_at_a_change_of_acceptance_can_be_read_as_a_new_start():
    # SYNTHETIC write log: the acceptance rose at 30 s; auto verified every row (the stopgap),
    # left it for 0.7 in bucket 8, then moved to 0.4 (more rows again)
    rise = {"bucket_ns": [1.0] * len(eval_controller.EDGES), "trial_writes": [], "stopgap_writes": [33.0],
            "writes": [(8.0, "1:0.6:1-2 explore/192"), (33.0, "1:0:5-5 explore/192"),
                       (42.0, "1:0.7:1-2 explore/192"), (50.0, "1:0.4:1-2 explore/192")]}
    assert eval_controller._bucket_reversals(rise, 30.0, 90.0) == 2              # the stopgap as a move
    assert eval_controller._bucket_reversals(rise, 30.0, 90.0, reset_at_stopgap=True) == 1
    # a write of every row that was not the stopgap (recorded: none) is a move either way
    chosen = dict(rise, stopgap_writes=[])
    assert eval_controller._bucket_reversals(chosen, 30.0, 90.0, reset_at_stopgap=True) == 2
    # files before the record: a write of every row is taken for the stopgap
    older = {key: value for key, value in rise.items() if key != "stopgap_writes"}
    assert eval_controller._stopgaps(older) == {33.0}


def test_a_run_records_the_stopgap_it_writes_when_the_acceptance_rises():
    # SYNTHETIC short accept-rise trace: auto's only writes of every row are its stopgaps
    trace = dict(eval_controller.TRACES["accept-rise-bs48"], seconds=30, accept_change_s=15.0)
    auto = eval_controller.run_trace(trace, None, seed=1)
    assert auto["acceptance_changes"] >= 1 and auto["stopgap_writes"]
    every_row = {when for when, text in auto["writes"]
                 if eval_controller._every_row(eval_controller.policy_of_description(text))}
    assert set(auto["stopgap_writes"]) == every_row and min(every_row) >= 15.0
    # each write that put a trial in force records a bucket on trial, one the run's load reached
    on_trial = dict(auto["trial_buckets"])
    assert auto["trial_writes"] and set(auto["trial_writes"]) <= set(on_trial)
    reached = {edge for edge, ns in zip(eval_controller.EDGES, auto["bucket_ns"]) if ns > 0}
    assert all(set(edges) <= reached for edges in on_trial.values())


def _run_by_bucket(tokens: list[float], ns: list[float], seconds: int = 10) -> dict:
    """A SYNTHETIC run spending the same time in each batch-size bucket every second."""
    buckets = len(eval_controller.EDGES)
    tokens, ns = np.pad(tokens, (0, buckets - len(tokens))), np.pad(ns, (0, buckets - len(ns)))
    return {"second": {"tokens": [tokens.sum()] * seconds, "ns": [ns.sum()] * seconds,
                       "given_up": [0.0] * seconds, "requests": [1.0] * seconds,
                       "bucket_tokens": [tokens.tolist()] * seconds, "bucket_ns": [ns.tolist()] * seconds}}


def test_a_reference_is_scored_at_autos_batch_sizes():
    # SYNTHETIC: the reference makes 10% more of every bucket than auto, but its batch drained
    # slower and spends 3/4 of its time in the slow small bucket: its own goodput is lower
    auto = _run_by_bucket([100.0, 300.0], [100.0, 100.0])        # 1 and 3 tokens per ns
    reference = _run_by_bucket([330.0, 330.0], [300.0, 100.0])   # 1.1 and 3.3
    assert eval_controller._window(reference, 0, 10)[0] < eval_controller._window(auto, 0, 10)[0]
    at_batch = eval_controller._batch_goodput(reference, auto, 0, 10)
    assert at_batch == pytest.approx(1.1 * eval_controller._window(auto, 0, 10)[0])
    # auto is more than 2% short of it in every window: it never settles there; it does on the raw goodput
    assert eval_controller._settle(auto, {}, 0, 10, 0.0, reference=reference, window_s=5,
                                   scaled=eval_controller._batch_goodput) is None
    assert eval_controller._settle(auto, {}, 0, 10, 0.0, reference=reference, window_s=5) == 0.0
    # SYNTHETIC: a reading that cannot read a window counts it as not settled, so the settle time
    # is an upper bound; one unread window no longer voids the whole reading
    def unread_at(*seconds):
        return lambda run, at, start, end: None if start in seconds else eval_controller._window(run, start, end)[0]
    assert eval_controller._settle(auto, {}, 0, 10, 0.0, reference=auto, window_s=5, scaled=unread_at(1)) == 2.0
    assert eval_controller._settle(auto, {}, 0, 10, 0.0, reference=auto, window_s=5, scaled=unread_at(0)) == 1.0
    assert eval_controller._settle(auto, {}, 0, 10, 0.0, reference=auto, window_s=5, scaled=unread_at(5)) is None
    # less than half of auto's time in buckets the reference served: no comparison
    elsewhere = _run_by_bucket([0.0, 330.0, 50.0], [0.0, 100.0, 300.0])
    lopsided = _run_by_bucket([100.0, 300.0], [300.0, 100.0])
    assert eval_controller._batch_goodput(elsewhere, lopsided, 0, 10) is None
    # files before the per-bucket record
    assert eval_controller._batch_goodput(_run([100.0] * 10), auto, 0, 10) is None


def test_a_run_records_its_steps_per_exact_batch_size_as_its_buckets_and_seconds_hold_them():
    # SYNTHETIC short shift: the record per second and exact batch size sums to each second's
    # totals and to the run's per-bucket record
    trace = dict(eval_controller.TRACES["shift-4-96-skew1.5"], seconds=6, shift_after_s=3.0)
    run = eval_controller.run_trace(trace, eval_controller.STATIC["k=2"], seed=2)
    table = np.asarray(run["sizes"])
    assert len(table) and (table[:, 3] > 0).all()
    buckets = eval_controller._bucket_of(np.arange(1, 257))
    whole_tokens, whole_ns = np.zeros(len(eval_controller.EDGES)), np.zeros(len(eval_controller.EDGES))
    for second in range(7):
        tokens, ns = eval_controller._by_size(run["sizes"], second, second + 1, 257)
        assert tokens[0] == ns[0] == 0
        assert tokens.sum() == pytest.approx(run["second"]["tokens"][second])
        assert ns.sum() == pytest.approx(run["second"]["ns"][second])
        whole_tokens += np.bincount(buckets, weights=tokens[1:], minlength=len(whole_tokens))
        whole_ns += np.bincount(buckets, weights=ns[1:], minlength=len(whole_ns))
    np.testing.assert_allclose(whole_tokens, run["bucket_tokens"])
    np.testing.assert_allclose(whole_ns, run["bucket_ns"])
    assert len({int(size) for size in table[:, 1]}) > 2   # the shift moved it through several sizes
    # steps and live rows per (second, size): the same cells, summing to each second's requests and live rows
    steps = np.asarray(run["size_live"])
    assert sorted(map(tuple, steps[:, :2])) == sorted(map(tuple, table[:, :2]))
    for second in range(7):
        here = steps[steps[:, 0] == second]
        assert (here[:, 1] * here[:, 2]).sum() == run["second"]["requests"][second]
        assert here[:, 3].sum() == run["second"]["live"][second]


def _run_by_size(by_size: dict, seconds: int = 10) -> dict:
    """A SYNTHETIC run spending the same time at each batch size every second (``{size: (tokens,
    ns)}``), with the bucket record that goes with it."""
    run = _run_by_bucket([0.0], [0.0], seconds)
    run["sizes"] = [[s, size, tokens, ns] for s in range(seconds) for size, (tokens, ns) in by_size.items()]
    buckets = eval_controller._bucket_of(np.array(list(by_size)))
    for key, column in (("bucket_tokens", 0), ("bucket_ns", 1)):
        values = np.bincount(buckets, weights=[v[column] for v in by_size.values()], minlength=len(eval_controller.EDGES))
        run["second"][key] = [values.tolist()] * seconds
    run["second"]["tokens"] = [sum(v[0] for v in by_size.values())] * seconds
    run["second"]["ns"] = [sum(v[1] for v in by_size.values())] * seconds
    return run


def test_at_autos_batch_sizes_a_run_one_request_larger_in_the_same_bucket_is_not_counted_faster():
    # SYNTHETIC drain: the same rule makes 1 token per ns per request; auto's batch holds 5
    # requests, the reference's 7 (it drained slower). Both sizes are in one bucket
    assert eval_controller._bucket_of(np.array([5]))[0] == eval_controller._bucket_of(np.array([7]))[0]
    auto = _run_by_size({5: (500.0, 100.0), 7: (70.0, 10.0)})
    reference = _run_by_size({5: (50.0, 10.0), 7: (700.0, 100.0)})
    window = eval_controller._window(auto, 0, 10)[0]
    assert eval_controller._window(reference, 0, 10)[0] > 1.2 * window
    # per bucket it reads 22% faster than auto; per exact size it is auto's equal
    by_bucket = {key: value for key, value in reference.items() if key != "sizes"}
    assert eval_controller._batch_goodput(by_bucket, auto, 0, 10) > 1.2 * window
    assert eval_controller._batch_goodput(reference, auto, 0, 10) == pytest.approx(window)
    # ... and its sizes must cover half of auto's time there
    elsewhere = _run_by_size({6: (600.0, 100.0), 7: (7.0, 1.0)})
    assert eval_controller._batch_goodput(elsewhere, auto, 0, 10) is None


def test_at_autos_batch_sizes_and_requests_both_partings_of_a_drain_are_undone():
    # SYNTHETIC drain, the same rule in both runs: the reference's batch holds 7 requests most of
    # the time and auto's 5, and auto's requests are accepted less (POOR against RICH: a rule that
    # commits more per step finishes the well-accepted requests sooner)
    ratio = (1 + POOR[1]) / (1 + RICH[1])
    auto = _run_by_size({5: (500.0 * ratio, 100.0)})
    reference = _run_by_size({5: (50.0, 10.0), 7: (700.0, 100.0)})
    for run, within in ((auto, POOR), (reference, RICH)):
        run["second"].update(live=[3.0] * 10, accepted_within=[within] * 10)
    window = eval_controller._window(auto, 0, 10)[0]
    assert eval_controller._adjusted_goodput(reference, auto, 0, 10) > 1.2 * window   # the batch left in
    assert eval_controller._batch_goodput(reference, auto, 0, 10) == pytest.approx(window / ratio)   # the requests
    assert eval_controller._matched_goodput(reference, auto, 0, 10) == pytest.approx(window)
    # a rule 4% faster on the same batch and requests stays 4% ahead
    faster = _run_by_size({5: (52.0, 10.0), 7: (728.0, 100.0)})
    faster["second"].update(live=[3.0] * 10, accepted_within=[RICH] * 10)
    assert eval_controller._matched_goodput(faster, auto, 0, 10) == pytest.approx(1.04 * window)
    # either record missing: no reading
    del reference["second"]["accepted_within"]
    assert eval_controller._matched_goodput(reference, auto, 0, 10) is None


def _row_cost_run(slope: float, lives: list[float], sizes=(40, 41, 42), seconds=(30, 31, 32)) -> dict:
    """A SYNTHETIC run whose step time is ``level(bs) * exp(slope * live)`` at each live length
    per request in ``lives`` (one per second), 10 steps at each size each second."""
    run = {"sizes": [], "size_live": []}
    for second, live in zip(seconds, lives):
        for bs in sizes:
            step_ns = 1e8 * (1 + bs / 100) * math.exp(slope * live)
            run["sizes"].append([second, bs, 100.0, 10 * step_ns])
            run["size_live"].append([second, bs, 10.0, 10 * bs * live])
    return run


def test_the_cost_of_a_live_row_is_read_within_a_batch_size_and_beside_the_fits():
    # SYNTHETIC: step time grows 6% per live row per request at every size; the fit's probes say 2%
    auto = _row_cost_run(0.06, [5.0, 5.0, 4.9])
    auto["second"] = {"tokens": [0.0] * 40}
    auto["from_state"] = {"30": {"k=3": _row_cost_run(0.06, [4.0, 4.0, 3.9]), "k=2": _row_cost_run(0.06, [3.0] * 3)}}
    auto["cost_probes"] = [[30.5 + t, 41, [1e8 * math.exp(0.02 * live) for live in range(1, 7)]] for t in range(3)]
    measured, predicted, sizes = eval_controller.row_cost(auto, 30, 40)
    assert measured == pytest.approx(0.06, rel=1e-6)
    assert predicted == pytest.approx(0.02, rel=0.05)   # log-linear interpolation of the probe points
    assert sizes == 3
    cell = eval_controller._row_cost_cell(auto)
    assert cell == "6.0% / 2.0% (3)"
    # a level that differs between sizes is not read as a slope: only live lengths at one size count
    auto["from_state"]["30"]["k=2"] = _row_cost_run(0.06, [3.0] * 3, sizes=(90,))
    assert eval_controller.row_cost(auto, 30, 40)[0] == pytest.approx(0.06, rel=1e-6)
    # no step in the window, no probe in it, or every run at one live length per size: nothing to read
    assert eval_controller.row_cost(auto, 36, 40) is None
    assert eval_controller.row_cost({**auto, "cost_probes": []}, 30, 40) is None
    flat = {key: value for key, value in auto.items() if key != "from_state"}
    flat["size_live"] = _row_cost_run(0.06, [5.0] * 3)["size_live"]
    assert eval_controller.row_cost(flat, 30, 40) is None


def test_auto_records_its_cost_fits_step_time_at_every_live_length_per_tick():
    # a short SYNTHETIC trace: the probes come from the controller's own fit, once it has one
    trace = dict(eval_controller.TRACES["shift-4-96-skew1.5"], seconds=20, shift_after_s=8.0)
    result = eval_controller.run_trace(trace, None, seed=2)
    probes = result["cost_probes"]
    assert probes and all(len(step_ns) == 6 for _, _, step_ns in probes)
    assert [t for t, _, _ in probes] == sorted(t for t, _, _ in probes)
    for _, bs, step_ns in probes:
        assert bs > 0 and np.all(np.diff(step_ns) >= 0)   # more live rows never cost less


def test_auto_against_off_is_read_over_every_pair_of_runs():
    # on the simulator auto and off run again are the same runs: every pair reads the first's ratio
    trace = dict(eval_controller.TRACES["shift-128-8-skew1.5"], seconds=16, shift_after_s=8.0)
    auto = eval_controller.run_trace(trace, None, seed=2)
    off = eval_controller.run_trace(trace, eval_controller.STATIC["off"], seed=2)
    again = {label: eval_controller.run_trace(trace, policy, seed=2)
             for label, policy in (("auto", None), ("off", eval_controller.STATIC["off"]))}
    auto["replicas"] = {label: [run] for label, run in again.items()}
    by_label = {"auto": auto, "off": off}
    first = auto["goodput"] / off["goodput"] - 1
    assert eval_controller.vs_off_pairs(by_label) == pytest.approx([first, first], rel=0, abs=1e-12)
    assert eval_controller.own_spread(by_label, "auto", 0, 16) == 0.0
    # SYNTHETIC pairs: auto's second run 4% faster over 8-16 s, off's second 2% slower there
    runs = {"auto": _per_second([100.0] * 16), "off": _per_second([100.0] * 16)}
    runs["auto"]["replicas"] = {"auto": [_per_second([100.0] * 8 + [104.0] * 8)],
                                "off": [_per_second([100.0] * 8 + [98.0] * 8)]}
    assert eval_controller.vs_off_pairs(runs, 8, 16) == pytest.approx([0.0, 104 / 98 - 1])
    assert eval_controller.vs_off_pairs(runs, 0, 8) == pytest.approx([0.0, 0.0])
    # each run half their log ratio from the two runs' mean log: about 2% (off: 1%)
    assert eval_controller.own_spread(runs, "auto", 8, 16) == pytest.approx(math.log(1.04) / 2)
    assert eval_controller.own_spread(runs, "off", 8, 16) == pytest.approx(math.log(1 / 0.98) / 2)
    del runs["auto"]["replicas"]
    assert eval_controller.own_spread(runs, "auto", 8, 16) is None   # one run: no spread to read
    assert eval_controller.vs_off_pairs(runs, 8, 16) == [0.0]


def test_each_pair_is_also_read_with_off_at_autos_batch_sizes():
    # SYNTHETIC pairs: off makes 2% more of every batch size than auto, but auto spends more of its
    # time at the larger, faster size (4 tokens per ns at bs 8, 2 at bs 4). Its own goodput is
    # higher; at its batch sizes off's is 2% higher. The second pair's off records no sizes (and no buckets)
    auto = _run_by_size({4: (200.0, 100.0), 8: (1200.0, 300.0)})
    off = _run_by_size({4: (612.0, 300.0), 8: (408.0, 100.0)})
    assert eval_controller._window(auto, 0, 10)[0] > eval_controller._window(off, 0, 10)[0]
    auto["replicas"] = {"auto": [_run_by_size({4: (200.0, 100.0), 8: (1200.0, 300.0)})], "off": [_run([100.0] * 10)]}
    for run in (auto, off, *auto["replicas"]["auto"], *auto["replicas"]["off"]):
        run["goodput"] = eval_controller._window(run, 0, 10)[0]
    by_label = {"auto": auto, "off": off}
    assert eval_controller.vs_off_pairs_at_sizes(by_label) == [pytest.approx(1 / 1.02 - 1), None]
    assert eval_controller.vs_off_pairs_at_sizes(by_label, 2, 6) == [pytest.approx(1 / 1.02 - 1), None]
    assert eval_controller.vs_off_pairs(by_label)[0] > 0   # the plain reading says the opposite


def test_replicas_run_auto_and_off_in_alternating_order():
    traces = {"a": {"seconds": 10}, "b": {"seconds": 20}}
    jobs = eval_controller.replica_jobs(traces, 3, seed=5)
    assert [(name, label) for name, _, label, _, _ in jobs] == [
        ("a", "auto"), ("a", "off"), ("a", "off"), ("a", "auto"), ("a", "auto"), ("a", "off"),
        ("b", "auto"), ("b", "off"), ("b", "off"), ("b", "auto"), ("b", "auto"), ("b", "off")]
    # off runs its static rule, auto the controller (no policy), on the trace's own parameters and
    # seed; on the simulator both runs of a pair draw that pair's own step-time jitter
    assert all(policy is (None if label == "auto" else eval_controller.STATIC["off"])
               and params == {**traces[name], "jitter_seed": i // 2 % 3 + 1} and seed == 5
               for i, (name, params, label, policy, seed) in enumerate(jobs))
    # on the GPU each run measures its own: the trace as it is
    assert all(params is traces[name] for name, params, *_ in eval_controller.replica_jobs(traces, 3, 5, False))
    assert eval_controller.replica_jobs(traces, 0, seed=5) == []


def test_eval_controller_refuses_step_noise_on_the_gpu_or_out_of_range(capsys):
    for bad in (["--device", "cuda", "--step-noise", "0.01"], ["--step-noise", "-0.1"], ["--step-noise", "nan"]):
        with pytest.raises(SystemExit) as exit_info:
            eval_controller.main([*bad, "--only", "shift-4-96-skew1.5"])
        assert exit_info.value.code == 2
        assert "--step-noise" in capsys.readouterr().err


def test_eval_controller_refuses_a_negative_number_of_replicas(capsys):
    with pytest.raises(SystemExit) as exit_info:
        eval_controller.main(["--replicas", "-1", "--only", "shift-4-96-skew1.5"])
    assert exit_info.value.code == 2
    assert "--replicas" in capsys.readouterr().err


def test_each_replica_of_auto_and_off_is_scored_like_the_first_run():
    # SYNTHETIC: a load change at 20 s after which k=2 commits 10% more than every other rule; auto's
    # first run takes k=2's pace from 30 s on, its replica never does; off and its replica never do
    params = {"seconds": 60, "load": "shift", "shift_after_s": 20.0}
    by_label = {label: _per_second([100.0] * 60) for label in eval_controller.STATIC}
    by_label["k=2"] = _per_second([100.0] * 20 + [110.0] * 40)
    for label in ("auto", "auto-bounded"):
        by_label[label] = dict(_per_second([100.0] * 30 + [110.0] * 30), writes=[], goodput=105.0, given_up=0.0,
                               metrics={"vcap_controller_expert_curve_fit_r2": 1.0,
                                        "vcap_controller_cost_fit_r2": 1.0})
        by_label[label]["second"]["live"] = [2.0] * 60
        by_label[label]["bucket_ns"] = [60e9] + [0.0] * (len(eval_controller.EDGES) - 1)   # all at bs 1
    for label in eval_controller.STATIC:
        by_label[label].update(goodput=sum(by_label[label]["second"]["tokens"]) / 60, given_up=0.0)
    by_label["auto"]["replicas"] = {"auto": [dict(_per_second([100.0] * 60), goodput=100.0)],
                                    "off": [dict(_per_second([100.0] * 60), goodput=100.0)]}
    scores = eval_controller.score("synthetic", params, by_label)
    rows = {row["window"] + str(int(row["start"])): row for row in scores["windows"]}
    # from 28 s every 10 s window of auto's first run is within 2% of k=2's (28-38: 108 against 110)
    assert rows["transition20"]["replica_settle_10s"] == {"auto": [8.0, None], "off": [None, None]}
    assert rows["steady50"]["replica_regret"] == {"auto": pytest.approx([0.0, 1 - 100 / 110]),
                                                  "off": pytest.approx([1 - 100 / 110] * 2)}
    assert rows["steady50"]["auto_vs_off_pairs"] == pytest.approx([0.1, 0.0])
    assert scores["whole"]["vs_off_pairs"] == pytest.approx([0.05, 0.0])


def test_replicas_with_rules_from_autos_state_end_to_end(tmp_path, monkeypatch):
    # the whole harness on the simulator with SYNTHETIC step-time jitter (--step-noise), where each
    # pair of replicas draws its own noise as each run on a GPU measures its own: auto and off run
    # again, and the picked rules run from each auto run's own state (a drawn trace at bs ~13 with
    # a rise of acceptance, capped at 40 s with the change at 15 s)
    out, name = tmp_path / "replicas.json", "drawn31-2-accept"
    assert eval_controller.main(["--drawn", "9", "--draw-seed", "31", "--quick", "--only", name, "--replicas", "1",
                                 "--from-state", "2", "--no-again", "--step-noise", "0.02", "--jobs", "2",
                                 "--json", str(out)]) == 0
    stored = json.loads(out.read_text())
    auto, off = stored["results"][name]["auto"], stored["results"][name]["off"]
    (replica,), (off_again,) = auto["replicas"]["auto"], auto["replicas"]["off"]
    assert off_again["second"]["ns"] != off["second"]["ns"] and replica["second"]["ns"] != auto["second"]["ns"]
    assert replica["writes"] != [] and auto["writes"] != []
    assert list(replica["from_state"]) == list(auto["from_state"]) == ["15"]
    first, again = auto["from_state"]["15"], replica["from_state"]["15"]
    assert len(first) == 2 and sorted(again) == sorted(first)
    # each rule starts from its own run's state: that run, second for second, up to the change
    for run, rules in ((auto, first), (replica, again)):
        for rule in rules.values():
            assert all(rule["second"][key][:15] == run["second"][key][:15] for key in ("tokens", "ns"))
    assert all(again[label]["second"]["ns"][:15] != first[label]["second"]["ns"][:15] for label in first)
    # scored: both pairs, and each run read from its own state
    scores = stored["scores"][name]
    assert len(scores["whole"]["vs_off_pairs"]) == 2 and len(set(scores["whole"]["vs_off_pairs"])) == 2
    settle = next(row for row in scores["windows"] if row["window"] == "transition")["replica_settle_from_state"]
    assert len(settle) == 2
    # a 40 s trace has no steady window after the change: with 10 s transitions it has, 25-40 s
    monkeypatch.setattr(eval_controller, "TRANSITION_S", 10)
    params = eval_controller.traces_of(name, True, 9, 31, step_noise=0.02)[name]
    rows = eval_controller.score(name, params, stored["results"][name])["windows"]
    regret = next(row for row in rows if row["window"] == "steady" and row["start"] == 25)["replica_regret_from_state"]
    assert len(regret) == 2 and regret[0] != regret[1] and None not in (regret[0][0], regret[1][0])


def _scaled_after(run: dict, change: int, factor: float) -> dict:
    """A copy of ``run`` that committed ``factor`` times its tokens from ``change`` on (SYNTHETIC),
    in the same engine time at the same batch sizes."""
    scaled = copy.deepcopy(run)
    scaled["second"]["tokens"] = [t * (factor if i >= change else 1.0) for i, t in enumerate(run["second"]["tokens"])]
    scaled["sizes"] = [[s, b, t * (factor if s >= change else 1.0), ns] for s, b, t, ns in run["sizes"]]
    return scaled


def test_the_settle_of_the_runs_mean_averages_out_each_runs_own_noise():
    # a SYNTHETIC drain, 128 requests then 8 from 12 s, with three rules run from auto's state
    trace = dict(eval_controller.TRACES["shift-128-8-skew1.5"], seconds=28, shift_after_s=12.0)
    auto = eval_controller.run_trace(trace, None, seed=2)
    rules = {label: eval_controller.from_auto_state(trace, auto, 12.0, eval_controller.STATIC[label], seed=2)
             for label in ("k=2", "conf0.3", "off")}
    auto["from_state"] = {"12": rules}
    best = eval_controller._ranked(rules, 12.0, 28.0)[0]
    ratios = eval_controller._settle_ratios(auto, {}, 12.0, 28.0, eval_controller.LOOSE, reference=rules[best],
                                            window_s=10, scaled=eval_controller._matched_goodput)
    assert len(ratios) == 7 and None not in ratios and max(ratios) < 1.08
    single = eval_controller._from_state_scores(auto, rules, 12.0, 22.0, 28.0)
    pooled = eval_controller.pooled_settle([auto, auto], 12.0, 28.0)
    # the same run twice: the mean is that run, and so is the next best's
    assert pooled == (single["auto_settle_from_state_10s_matched"], single["twin_settle_from_state_10s_matched"])
    # two runs 10% below and 11% above it from the change on (their own rules unchanged): either
    # alone reads 10% short or far ahead; their mean reads the run itself
    below, above = (_scaled_after(auto, 12, factor) for factor in (0.9, 1 / 0.9))
    assert eval_controller._settle_ratios(below, {}, 12.0, 28.0, eval_controller.LOOSE, reference=rules[best],
                                          window_s=10, scaled=eval_controller._matched_goodput) == \
        pytest.approx([0.9 * r for r in ratios])
    assert eval_controller.pooled_settle([below], 12.0, 28.0)[0] is None
    assert eval_controller.pooled_settle([below, above], 12.0, 28.0) == pooled
    # below twice and auto once: the mean is 7% short in every window, never settled
    assert eval_controller.pooled_settle([below, below, auto], 12.0, 28.0)[0] is None
    # a run without rules from its state at that change cannot be read with the others
    assert eval_controller.pooled_settle([auto, {**auto, "from_state": {}}], 12.0, 28.0) is None


def _scored(windows: list, vs_off_pairs: list) -> dict:
    """A trace's scores as :func:`eval_controller.score` gives them, with only what the goals
    read (SYNTHETIC values)."""
    return {"windows": windows, "whole": {"vs_off": {"auto": vs_off_pairs[0]}, "vs_off_pairs": vs_off_pairs}}


def test_each_goal_is_read_where_the_rounds_read_it():
    # before a change: each run from time 0; after it: each run from its own state (a drain
    # leaves runs from time 0 in other states); settling: the runs' mean; reversals: the choice in
    # any one bucket with the stopgap as a new start; the whole trace: the mean of the pairs
    windows = [
        dict(window="cold", start=0.0, end=10.0, replica_regret={"auto": [0.09, 0.08]}),
        dict(window="steady", start=10.0, end=30.0, auto_regret_free=0.004, replica_regret={"auto": [0.004, 0.021]}),
        dict(window="transition", start=30.0, end=60.0, pooled_settle_from_state=(38.0, 28.0),
             auto_settle_segment_10s=0.0, auto_bucket_reversals=2, auto_bucket_reversals_reset=1),
        dict(window="steady", start=60.0, end=90.0, auto_regret_free=0.13, replica_regret={"auto": [0.13, 0.12]},
             replica_regret_from_state=[(0.019, 0), (-0.02, 1)]),
    ]
    rows = eval_controller.goal_readings(_scored(windows, [0.004, -0.03]))
    assert [(goal.split()[0], span, met) for goal, span, _, met in rows] == [
        ("steady", "steady 10-30", False),          # the second run's 2.1%
        ("within", "transition 30-60", False),      # the runs' mean 38 s, not the first run's 0 s
        ("reversals", "transition 30-60", True),    # one, the stopgap read as a new start
        ("steady", "steady 60-90", True),           # 1.9% from its state, not 13% from time 0
        ("never", "whole trace", False),            # the pairs' mean -1.3%
    ]
    assert "(1 not read)" in rows[3][2] and "28.0 s" in rows[1][2]
    # a settle test that never passes is missed; a run scored before the pooled reading falls back
    windows[2] = dict(window="transition", start=30.0, end=60.0, auto_settle_segment_10s=None)
    windows[3] = dict(window="steady", start=60.0, end=90.0, auto_regret_free=0.013)
    rows = eval_controller.goal_readings(_scored(windows, [0.01]))
    assert [met for *_, met in rows] == [False, False, True, True]
    assert "the first run, from time 0" in rows[1][2] and "no reading from auto's state" in rows[2][2]


def test_the_goals_of_a_stored_run_are_printed_and_counted(capsys):
    # the twenty-ninth round's stored draw (one run of auto, no replicas): every trace gets its
    # rows, and the count at the end is the rows' own
    assert eval_controller.main(["--goals", os.path.join(_BENCH, "runs", "drawn29_s1.json.xz")]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "drawn29_s1" in line]
    for name in eval_controller.drawn_traces(9, seed=29):
        assert any(f"| {name} | never more than 1% below off | whole trace |" in row for row in rows), name
    missed = sum(row.endswith("| **missed** |") for row in rows)
    assert f"{len(rows) - missed} of {len(rows)} readings meet their goal; {missed} missed" in out


def test_the_long_runs_writes_per_hour_are_a_goal_of_their_own(tmp_path, capsys):
    # SYNTHETIC writes of a --long run: two after the first minute of 600 s, 13.3 per hour
    stored = {"args": {"only": eval_controller.LONG_TRACE, "long": 600.0},
              "results": {eval_controller.LONG_TRACE + "-long": {"auto": {"writes": [[10.0, "a"], [70.0, "b"], [400.0, "c"]]}}}}
    path = tmp_path / "long.json"
    path.write_text(json.dumps(stored))
    eval_controller._print_goals([str(path)])
    out = capsys.readouterr().out
    assert "| <= 10 writes per hour | after 60 s | 13.3 | **missed** |" in out
    assert "0 of 1 readings meet their goal; 1 missed" in out
