"""bench/eval_controller.py logs auto's writes as one line per policy; bench/static_policy.py runs
such a line again as a static rule, so the line must spell the policy exactly."""

import os
import sys

import pytest

_BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench")
sys.path.insert(0, _BENCH)
try:
    import eval_controller
finally:
    sys.path.remove(_BENCH)


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


@pytest.mark.parametrize("fields", ["no_such_field:1", "trial_max:x", "trial_steady_s", "max_tokens_given_up:0.2"])
def test_eval_controller_refuses_a_bad_variant_before_it_runs(fields, capsys):
    with pytest.raises(SystemExit) as exit_info:
        eval_controller.main(["--controller", fields, "--only", "shift-4-96-skew1.5"])
    assert exit_info.value.code == 2
    assert "--controller" in capsys.readouterr().err
