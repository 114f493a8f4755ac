"""bench/forced_forget.py makes the controller forget once at a chosen record time (a diagnostic of
the path after a change of acceptance): on a trace whose acceptance never changes, the one forget
counted must be the forced one, at that time."""

from tests.utils import import_bench
from vcap.sidecar.controller.model import EngineModel

eval_controller, forced_forget = import_bench("eval_controller", "forced_forget")


def _steady_trace():
    # SYNTHETIC: a steady load, no change of acceptance
    return dict(eval_controller.TRACES["steady-bs8-attn"], seconds=16)


def test_without_the_wrapper_a_steady_trace_forgets_nothing():
    assert eval_controller.run_trace(_steady_trace(), None, seed=1)["acceptance_changes"] == 0


def test_the_forced_forget_fires_once_at_its_time_and_a_rise_writes_the_stopgap(monkeypatch):
    monkeypatch.setattr(EngineModel, "_drifted", EngineModel._drifted)   # restored after the test
    forced_forget.force_forget(8.0, "all", rose=True)
    result = eval_controller.run_trace(_steady_trace(), None, seed=1)
    assert result["acceptance_changes"] == 1
    assert len(result["stopgap_writes"]) == 1 and 8.0 <= result["stopgap_writes"][0] < 9.0
