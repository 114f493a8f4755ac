"""bench/controller_replay.py: what auto was fed, captured and replayed into a fresh controller,
gives the same writes (the GPU runs are diagnosed on the CPU this way)."""

import types

import numpy as np
import pytest

from tests.utils import import_bench
from vcap.sidecar.controller import ControllerConfig
from vcap.sidecar.controller.goodput import evaluate_rules

controller_replay, eval_controller = import_bench("controller_replay", "eval_controller")


def test_a_captured_run_replays_to_the_same_writes(tmp_path):
    # a short SYNTHETIC trace with a load change: writes before and after it
    trace = dict(eval_controller.TRACES["shift-4-96-skew1.5"], seconds=30, shift_after_s=12.0)
    captured = controller_replay.capture(trace, seed=3)
    assert len(captured["result"]["writes"]) >= 2
    path = str(tmp_path / "cap.pkl.xz")
    controller_replay.save(captured, path)
    _, writes = controller_replay.replay(controller_replay.load(path))
    assert writes == [tuple(w) for w in captured["result"]["writes"]]
    # stopped early, it has made the writes up to then and no later one (write times are rounded
    # to 10 ms; the ticks are 0.5 s apart)
    cut = captured["result"]["writes"][1][0] + 0.01
    _, early = controller_replay.replay(captured, until=cut)
    assert early == writes[:2]


def test_a_capture_made_before_a_config_field_existed_replays_with_its_default():
    trace = dict(eval_controller.TRACES["shift-4-96-skew1.5"], seconds=12, shift_after_s=6.0)
    captured = controller_replay.capture(trace, seed=3)
    config = captured["events"][0][1]
    # the configuration as an older version pickled it: one field fewer, one changed
    fields = {name: getattr(config, name) for name in ControllerConfig.__dataclass_fields__}
    del fields["return_gain"]
    fields["min_gain"] = 0.02
    older = types.SimpleNamespace(**fields)
    rebuilt = controller_replay.current_config(older)
    assert rebuilt.min_gain == 0.02 and rebuilt.return_gain == ControllerConfig().return_gain
    captured["events"][0] = ("init", older, captured["events"][0][2])
    controller, _ = controller_replay.replay(captured)
    assert controller.config.min_gain == 0.02


def test_inspect_judges_every_rule_on_the_window_or_its_recent_rows():
    trace = dict(eval_controller.TRACES["shift-4-96-skew1.5"], seconds=16, shift_after_s=8.0)
    captured = controller_replay.capture(trace, seed=3)
    controller, _ = controller_replay.replay(captured, until=15.0)
    model = controller.model
    whole = controller_replay.judge(controller, bs=96)
    recent = controller_replay.judge(controller, bs=96, recent_s=4.0)
    confidence, live, accepted, time_ns, _ = model.window.arrays()
    kept = time_ns >= model.now_ns - 4e9
    assert 0 < kept.sum() < len(kept) and recent[0]["rows"] == kept.sum() and whole[0]["rows"] == len(kept)
    expected = evaluate_rules(confidence[kept], live[kept], accepted[kept], model.calibration, model.rules)
    np.testing.assert_allclose([r["tokens"] for r in recent], expected.tokens)
    np.testing.assert_allclose([r["tokens"] for r in whole], model.evaluate(model.rules).tokens)
    step_ns = expected.step_time_ns(96, model.curve, model.cost)
    np.testing.assert_allclose([r["goodput"] for r in recent], 96 * expected.tokens / step_ns * 1e9)
    assert [r["rule"] for r in whole][:1] == ["0:1-1"]   # fixed k = 1 spelled as threshold:k_min-k_max
    # the rows the decision judges bs 96's bucket on
    decided = controller_replay.judge(controller, bs=96, as_decided=True)
    bucket = list(model.edges).index(64)
    expected = model.evaluate_buckets(model.rules, model.bucket_loads())[bucket]
    np.testing.assert_allclose([r["tokens"] for r in decided], expected.tokens)
    assert decided[0]["rows"] is None


def test_replay_runs_the_capture_with_a_field_changed_and_times_the_ticks(tmp_path, capsys):
    # SYNTHETIC short trace; a 90% gain threshold holds back the writes the captured run made
    trace = dict(eval_controller.TRACES["shift-4-96-skew1.5"], seconds=16, shift_after_s=8.0)
    captured = controller_replay.capture(trace, seed=3)
    path = str(tmp_path / "cap.pkl.xz")
    controller_replay.save(captured, path)
    ticks = sum(1 for event in captured["events"] if event[0] == "tick")
    assert controller_replay.main(["replay", path]) == 0
    out = capsys.readouterr().out
    assert "same writes as the captured run: True" in out and f"{ticks} ticks, wall time" in out
    assert controller_replay.main(["replay", path, "--controller", "min_gain:0.9"]) == 0
    out = capsys.readouterr().out
    assert "same writes as the captured run: False" in out and f"{ticks} ticks, wall time" in out
    with pytest.raises(SystemExit):   # a field ControllerConfig does not have: refused, not replayed
        controller_replay.main(["replay", path, "--controller", "no_such_field:1"])
    assert "no_such_field" in capsys.readouterr().err
