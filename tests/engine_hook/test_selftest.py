"""``vcap selftest`` end to end, small: a second process rewrites the policy while the hook runs;
every step and every record is checked against the reference (on a CPU: the interpreter, eagerly)."""
from vcap.engine_hook.selftest import SelftestConfig, run_selftest


def test_a_short_selftest_passes():
    config = SelftestConfig(steps=8, max_bs=4, layers=2, num_experts=64, num_expert_group=4, topk_group=2,
                            write_period_us=20000.0, sample_period=2)
    report = run_selftest(config, log=lambda line: None)
    assert report["failures"] == []
    assert report["steps"] == 8 and report["records_checked"] == 8 and report["reader_drops"] == 0
