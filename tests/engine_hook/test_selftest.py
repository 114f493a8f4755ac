"""``vcap selftest`` end to end, small: a second process rewrites the policy while the hook runs;
every step and every record is checked against the reference (on a CPU: the interpreter, eagerly)."""
from vcap.engine_hook.selftest import SelftestConfig, run_selftest


def test_a_short_selftest_passes():
    config = SelftestConfig(steps=8, max_bs=4, layers=2, num_experts=64, num_expert_group=4, topk_group=2,
                            write_period_us=20000.0, sample_period=2)
    report = run_selftest(config, log=lambda line: None)
    assert report["failures"] == []
    assert report["steps"] == 8 and report["records_checked"] == 8 and report["reader_drops"] == 0


def test_the_vcap_command_on_a_cpu_machine_without_triton_interpret_set():
    # found by an outside review: `vcap selftest` chose the interpreter after importing Triton,
    # and died in a traceback unless the user had exported TRITON_INTERPRET=1 (as tests do)
    import os
    import subprocess
    import sys

    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the CPU path")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "vcap.engine_hook.cli", "selftest", "--steps", "4"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "OK: 4 steps checked" in done.stdout and "Traceback" not in done.stderr
