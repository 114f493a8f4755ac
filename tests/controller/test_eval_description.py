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
