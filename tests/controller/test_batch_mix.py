"""bench/batch_mix.py: which requests fill the simulated engine's batch under a static rule
(SYNTHETIC requests, a few hundred steps)."""

import pytest

from tests.utils import import_bench

(batch_mix,) = import_bench("batch_mix")


def test_without_a_spread_every_request_is_alike_and_a_cap_commits_less():
    off = batch_mix.batch_mix("off", 0.0, bs=16, steps=300, warm_up=100, seed=3)
    capped = batch_mix.batch_mix("k=1", 0.0, bs=16, steps=300, warm_up=100, seed=3)
    assert off["shift"] == 0.0 and capped["shift"] == 0.0
    assert 1.0 < capped["tokens"] <= 2.0 < off["tokens"] <= 6.0   # k=1: one draft and the target's token


def test_with_a_spread_the_slow_requests_fill_the_batch_least_under_k1():
    # arrivals have mean shift 0; the requests that draft badly stay longer, most where the rule
    # lets the others draft furthest (off), least where every request gets one draft (k=1)
    off = batch_mix.batch_mix("off", 0.5, bs=32, steps=3000, warm_up=500, seed=3)
    capped = batch_mix.batch_mix("k=1", 0.5, bs=32, steps=3000, warm_up=500, seed=3)
    assert off["shift"] < -0.05
    assert abs(capped["shift"]) < abs(off["shift"]) / 2


def test_the_table_names_each_spread_and_rule(capsys):
    assert batch_mix.main(["--rules", "off,k=1", "--spread", "0", "--bs", "8", "--steps", "60", "--warm-up", "10"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 0 |")]
    assert [row.split("|")[2].strip() for row in rows] == ["off", "k=1"]
    assert all(float(row.split("|")[3]) == pytest.approx(0.0) for row in rows)


@pytest.mark.parametrize("label", ["conf0.2", "conf0.3k2-5", "k=2", "off"])
def test_a_rule_judged_on_its_own_rows_gives_the_live_rows_the_engine_ran(label):
    # the controller's reading of a rule (live_for_rules on the running product) and the
    # simulated engine's cutoff agree row for row on the rows that rule made
    mix = batch_mix.batch_mix(label, 0.5, bs=16, steps=200, warm_up=20, seed=5)
    assert batch_mix.judged_live(label, mix["confidence"], 16) == pytest.approx(mix["live"], rel=1e-9)


@pytest.mark.parametrize("label", ["conf0.2", "k=2"])
def test_a_rule_judged_on_its_own_rows_commits_the_tokens_the_engine_committed(label):
    # on its own rows a rule's accepted drafts are all observed: the controller's prediction
    # (evaluate_rules through the calibration the rows taught) is the engine's count
    mix = batch_mix.batch_mix(label, 0.5, bs=16, steps=200, warm_up=20, seed=5)
    assert batch_mix.judged_tokens(label, mix, 16) == pytest.approx(mix["tokens"], rel=1e-9)


def test_exploration_steps_teach_the_calibration_but_stay_out_of_the_measured_rows():
    mix = batch_mix.batch_mix("k=1", 0.5, bs=16, steps=400, warm_up=20, seed=5, explore=4)
    assert mix["live"] == 2.0                          # k=1 alone: one draft and the target's row
    assert (mix["live_rows"] == 6).mean() == pytest.approx(0.25, abs=0.01)   # every fourth step verifies all
    # what the all-live steps showed: the second draft's acceptance is learned, not the prior's
    assert mix["calibration"].trials[1].sum() > 100


def test_a_drawn_trace_gives_its_request_knobs(capsys):
    assert batch_mix.main(["--drawn", "drawn47-4-shift", "--draw-seed", "47", "--rules", "conf0.2,conf0.1",
                           "--spread", "0.5", "--bs", "8", "--steps", "80", "--warm-up", "10", "--explore", "8"]) == 0
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines() if line.startswith("| 0.5 |")]
    assert [row[2].strip() for row in rows] == ["conf0.2", "conf0.1"]
    assert len(rows[0]) == 9 and float(rows[0][7]) == pytest.approx(float(rows[0][4]), rel=0.05)
