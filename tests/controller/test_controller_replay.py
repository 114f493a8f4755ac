"""bench/controller_replay.py: what auto was fed, captured and replayed into a fresh controller,
gives the same writes (the GPU runs are diagnosed on the CPU this way)."""

import os
import sys

_BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench")
sys.path.insert(0, _BENCH)
try:
    import controller_replay
    import eval_controller
finally:
    sys.path.remove(_BENCH)


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
