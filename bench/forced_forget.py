"""Run a bench script with the controller's drift test made to fire once at a given record time.

A diagnostic: on the GPU loop the drift test fired on some runs of a trace and not on others
(``CONTROLLER_RESULTS.md``, forty-first round), so the path after a forget could not be compared
run against run. This wrapper makes every controller in the process forget once, at ``--at``
seconds of record time, as if the test had fired there, with ``--moved`` positions and
``--rose`` as the alarm would set them; the test's own alarms still act as before.

    python bench/forced_forget.py --at 43 --rose -- bench/eval_controller.py --drawn 9 --draw-seed 47 \\
        --only drawn47-8-accept --seed 1 --replicas 3 --step-noise 0.01 --from-state 4
"""

import argparse
import os
import runpy
import sys

import numpy as np

from vcap.sidecar.controller import model as controller_model


def force_forget(at_s: float, moved: str, rose: bool) -> None:
    """Patch :class:`EngineModel` so that each instance forgets once, at ``at_s`` of record time."""
    at_ns = int(at_s * 1e9)
    drifted = controller_model.EngineModel._drifted

    def forced(self, observation) -> bool:
        fired = drifted(self, observation)
        if not getattr(self, "_forced", False) and self.now_ns >= at_ns:
            self._forced = True
            drift = self.drift
            positions = np.arange(1, drift.num_drafts + 1)
            drift.moved = np.ones(drift.num_drafts, bool) if moved == "all" else np.isin(
                positions, [int(p) for p in moved.split(",")])
            drift.rose = rose
            return True
        return fired

    controller_model.EngineModel._drifted = forced


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--at", type=float, required=True, help="record time (s) of the forced forget")
    parser.add_argument("--moved", default="all", help="positions that moved: all, or e.g. 1,2")
    parser.add_argument("--rose", action="store_true", help="the alarm says acceptance rose (all-live stopgap)")
    parser.add_argument("script", help="the bench script to run, then its arguments")
    args, rest = parser.parse_known_args()
    force_forget(args.at, args.moved, args.rose)
    sys.path.insert(0, os.path.dirname(os.path.abspath(args.script)))
    sys.argv = [args.script] + [a for a in rest if a != "--"]
    runpy.run_path(args.script, run_name="__main__")


if __name__ == "__main__":
    main()
